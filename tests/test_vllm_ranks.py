"""Tensor-parallel ranks: each rank's keys, names and tiers, and a lookup that
counts an object only where every rank's shard of it is."""

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kvarena import InvalidValueError
from kvarena.integrations.vllm.catalogue import Catalogue
from kvarena.integrations.vllm.ranks import (
    AllRanks,
    rank_key,
    rank_names,
    rank_tier_specs,
)
from kvarena.integrations.vllm.settings import ConnectorSettings
from kvarena.tiers import TierSpec, TierStack
from kvarena.tiers.names import ImageKind, object_name, parse_object_name

keys = st.binary(min_size=16, max_size=16)


@given(key=keys, kind=st.sampled_from(list(ImageKind)))
def test_object_names_parse_back(key, kind):
    assert parse_object_name(object_name(kind, key)) == (kind, key)


@pytest.mark.parametrize("name", ["kv", "xx-00", "kv-zz", "", "st-0"])
def test_a_name_no_object_has_is_refused(name):
    with pytest.raises(InvalidValueError, match="no object name"):
        parse_object_name(name)


@given(key=keys, ranks=st.sampled_from([2, 3, 5, 8, 64, 65, 80]))
def test_each_rank_has_a_key_of_its_own_and_rank_0_keeps_the_prefix_key(key, ranks):
    """Every rank, those whose keyed hash is made once (below 64) and those past
    them, keyed by one rule: BLAKE2b of the prefix key under the rank's person."""
    assert rank_key(key, 0, 1) == key
    for r in (1, ranks - 1):
        person = b"kvarena-tp" + r.to_bytes(2, "big")
        assert (
            rank_key(key, r, ranks) == hashlib.blake2b(key, digest_size=16, person=person).digest()
        )
    derived = [rank_key(key, r, ranks) for r in range(ranks)]
    assert derived[0] == key
    assert len(set(derived)) == ranks and all(len(k) == len(key) for k in derived)
    name = object_name(ImageKind.STATE, key)
    assert rank_names(name, ranks) == [object_name(ImageKind.STATE, k) for k in derived]
    assert rank_names(name, 1) == [name]


def test_each_rank_opens_its_share_of_the_tiers_in_a_directory_of_its_own(tmp_path):
    specs = [
        TierSpec.parse(s) for s in ("host:4GiB", f"disk:{tmp_path}/kv:200GiB", "redis://store:6379")
    ]
    assert rank_tier_specs(specs, 0, 1) == tuple(specs)
    got = rank_tier_specs(specs, 1, 4)
    assert tuple(map(str, got)) == (
        f"host:{1 << 30}",
        f"disk:{tmp_path}/kv/tp1:{50 << 30}",
        "redis://store:6379",
    )
    stack = TierStack.from_specs(got[:2], frame_bytes=64 << 10)  # what a worker opens
    try:
        assert stack.labels == ["host", "disk"]
    finally:
        stack.close()


def test_a_lookup_counts_an_object_where_every_rank_holds_it(tmp_path):
    disk = tmp_path / "kv"
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", f"disk:{disk}:1GiB"]})
    catalogue = Catalogue(settings, ranks=2)
    full, split, half, bad = (object_name(ImageKind.KV_BLOCK, bytes([i]) * 16) for i in range(4))
    # full: both ranks in host; split: rank 0 in host, rank 1 on disk;
    # half: only rank 0 anywhere; bad: both in host (a failed load is the
    # scheduler's to skip, by the prefix object's name: not the catalogue's).
    catalogue.hosted([*rank_names(full, 2), rank_names(split, 2)[0], rank_names(half, 2)[0]], [])
    catalogue.hosted(rank_names(bad, 2), [])
    catalogue.reported("disk", [rank_names(split, 2)[1]], [])  # rank 1's worker wrote it
    view = AllRanks(catalogue, 2)
    assert view.locate([full, split, half, bad]) == [0, 1, None, 0]


def test_a_lookup_remembers_whole_objects_until_a_rank_leaves_a_book(tmp_path):
    """Every rank's names are asked once per object; an object found whole is
    answered from memory until one of its rank names is dropped (then asked
    again, and missing), and an object only a deeper tier still holds is found
    there."""
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", f"disk:{tmp_path}:1GiB"]})
    catalogue = Catalogue(settings, ranks=4)
    a, b = (object_name(ImageKind.KV_BLOCK, bytes([i]) * 16) for i in range(2))
    catalogue.hosted([*rank_names(a, 4), *rank_names(b, 4)], [])
    catalogue.reported("disk", rank_names(b, 4), [])
    asked: list[str] = []
    real = catalogue.locate
    catalogue.locate = lambda names: (asked.extend(names), real(names))[1]  # type: ignore[method-assign]
    view = AllRanks(catalogue, 4)
    assert view.locate([a, b]) == [0, 0]
    assert len(asked) == 8  # both objects, every rank
    asked.clear()
    assert view.locate([a, b]) == [0, 0] and asked == []  # from memory
    catalogue.hosted([], [rank_names(a, 4)[2]])  # rank 2's host tier evicts a
    catalogue.hosted([], [rank_names(b, 4)[3]])  # and rank 3's evicts b (still on disk)
    assert view.locate([a, b]) == [None, 1]
    assert set(asked) == {*rank_names(a, 4), *rank_names(b, 4)}


def test_a_lookup_that_fell_behind_the_removals_forgets_everything(tmp_path, monkeypatch):
    from kvarena.integrations.vllm import catalogue as module

    monkeypatch.setattr(module, "GONE_KEPT", 2)
    catalogue = Catalogue(ConnectorSettings.parse({"tiers": ["host:1GiB"]}), ranks=2)
    names = [object_name(ImageKind.KV_BLOCK, bytes([i]) * 16) for i in range(4)]
    catalogue.hosted([n for name in names for n in rank_names(name, 2)], [])
    view = AllRanks(catalogue, 2)
    assert view.locate(names) == [0, 0, 0, 0]
    catalogue.hosted([], [rank_names(names[0], 2)[1], "kv-" + "ee" * 16, *rank_names(names[3], 2)])
    assert catalogue.gone(0) == (None, 3)  # three removals, two kept: the first is lost
    assert view.locate(names) == [None, 0, 0, None]  # asked again, all of them
