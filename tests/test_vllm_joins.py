"""Loads in two parts reported as one (:mod:`kvarena.integrations.vllm.joins`)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvarena.integrations.vllm.joins import Joins


def test_a_load_of_one_part_is_reported_as_it_ends():
    joins = Joins()
    assert joins.settle(({"a", "b"}, {"b"}), (set(), set())) == ({"a", "b"}, {"b"})


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_load_in_two_parts_is_reported_once_both_end(order):
    joins = Joins()
    joins.expect(["r"])
    parts = [({"r"}, set()), ({"r"}, set())]
    first, second = (parts[i] for i in order)
    assert joins.settle(first, (set(), set())) == (set(), set())
    assert joins.waiting == 1
    assert joins.settle((set(), set()), second) == ({"r"}, set())
    assert joins.waiting == 0


def test_both_parts_ending_in_one_step_report_once():
    joins = Joins()
    joins.expect(["r"])
    assert joins.settle(({"r"}, set()), ({"r"}, set())) == ({"r"}, set())
    assert joins.waiting == 0


@pytest.mark.parametrize("bad", [0, 1])
def test_a_failed_part_fails_the_request_once_the_other_ends(bad):
    joins = Joins()
    joins.expect(["r", "s"])
    parts = [({"r"}, set()), ({"r"}, set())]
    parts[bad] = ({"r"}, {"r"})
    assert joins.settle(parts[0], (set(), set())) == (set(), set())  # the other still writes
    # "s" ends its first part in the same step; only "r" is over
    assert joins.settle(({"s"}, set()), parts[1]) == ({"r"}, {"r"})
    assert joins.settle((set(), set()), ({"s"}, set())) == ({"s"}, set())
