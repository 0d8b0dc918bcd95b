"""The grids a cache layout declares (``integrations.vllm.page_grids``): the same rows as its spans.

A storage's spans (each layer's page, payload order) become runs once; the
grids planned from them for any objects must be exactly the rows the spans
give those objects (payload offset + span, span's place + block x step), in
as few grids as the blocks allow.
"""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")  # the package imports the connector

import itertools

from kvarena.integrations.vllm.page_grids import SpanRuns, worth_grids

PAGE = 1 << 20


def spans_of(layout: str):
    """(group, payload, at, step, length) of a storage holding two groups of three
    layers: layer-major (each layer its own region, a block a page apart),
    block-major (a block's layers side by side), or a token-major page (each
    layer's page two rows with a gap)."""
    rows = []
    pos = 0
    for g in range(2):
        for layer in range(3):
            i = 3 * g + layer
            if layout == "layer-major":
                rows.append((g, pos, i * 64 * PAGE, PAGE, PAGE))
            elif layout == "block-major":
                rows.append((g, pos, i * PAGE, 6 * PAGE, PAGE))
            else:  # two rows of half a page, a gap between
                half = PAGE // 2
                rows.append((g, pos, i * 2 * PAGE, 12 * PAGE, half))
                rows.append((g, pos + half, i * 2 * PAGE + PAGE, 12 * PAGE, half))
                pos += PAGE
                continue
            pos += PAGE
    cols = np.array(rows, dtype=np.int64)
    return [cols[:, k] for k in range(5)]


def expand(grids):
    return Counter(
        (s0 + k * os_ + c * ss, d0 + k * od + c * ds, n)
        for s0, d0, count, n, ss, ds, outer, os_, od in grids
        for k in range(outer)
        for c in range(count)
    )


@pytest.mark.parametrize(
    ("layout", "runs"), [("layer-major", 2), ("block-major", 2), ("token-major", 2)]
)
def test_a_groups_layers_are_one_run_where_they_advance_evenly(layout, runs):
    found = SpanRuns.of(*spans_of(layout)).runs
    assert len(found) == runs
    assert [r[0] for r in found] == [0, 1] and {r[3] for r in found} == {
        6 if layout == "token-major" else 3
    }


def test_a_span_of_another_length_or_rows_that_would_overlap_start_a_run():
    group = np.zeros(4, dtype=np.int64)
    payload = np.array([0, 100, 200, 300])
    at = np.array([0, 1000, 2000, 2050])  # the last step (50) under the length (100)
    step = np.full(4, 8000)
    length = np.array([100, 100, 100, 100])
    assert [r[3] for r in SpanRuns.of(group, payload, at, step, length).runs] == [3, 1]
    length = np.array([100, 100, 60, 100])
    at = np.array([0, 1000, 2000, 3000])
    assert [r[3] for r in SpanRuns.of(group, payload, at, step, length).runs] == [2, 1, 1]


@settings(max_examples=200, deadline=None)
@given(
    layout=st.sampled_from(["layer-major", "block-major", "token-major"]),
    blocks=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=6),
    spaced=st.booleans(),
    gap=st.integers(0, 3),
)
def test_the_grids_are_exactly_the_spans_rows_for_any_blocks(layout, blocks, spaced, gap):
    group, payload, at, step, length = spans_of(layout)
    runs = SpanRuns.of(group, payload, at, step, length)
    size = int(length.sum())
    payload_at = (
        [j * (size + gap * PAGE) for j in range(len(blocks))]
        if spaced
        else [((j * 7) % len(blocks)) * size for j in range(len(blocks))]
    )
    found = runs.grids([list(b) for b in blocks], payload_at)
    want = Counter(
        (pa + int(p), int(a) + b[int(g)] * int(s), int(n))
        for pa, b in zip(payload_at, blocks, strict=True)
        for g, p, a, s, n in zip(group, payload, at, step, length, strict=True)
    )
    assert expand(found) == want
    for grid in found:
        assert min(grid) >= 0  # no view steps backward
    if spaced and all(
        len({b[g] - a[g] for a, b in itertools.pairwise(blocks)}) <= 1
        and all(b[g] >= a[g] for a, b in itertools.pairwise(blocks))
        for g in range(2)
    ):
        assert len(found) <= len(runs.runs)  # evenly spaced: a grid a run at most


def test_grids_are_taken_where_they_move_a_megabyte_a_call():
    big = (0, 0, 2, PAGE, PAGE, PAGE, 1, 0, 0)
    assert worth_grids([big], 2 * PAGE)
    assert not worth_grids([big, big, big], 2 * PAGE)
    assert not worth_grids([], 0)
