"""A decode engine's READ descriptors, checked by addresses and bytes.

Two of vLLM's own allocations (the prefill's filled, the decode's zero) in
each of vLLM's layouts; the rows :func:`pair` gives for some objects are
carried out byte for byte (what NIXL's READ does: each remote range into its
local one), and every layer's page of every decode block must then equal the
prefill block it was read from, with no other byte of the decode allocation
changed. Runs in the ``.venv-vllm`` environment."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from kvarena.integrations.vllm.groups import classify
from kvarena.integrations.vllm.pd_table import SpanTable, pair
from kvarena.integrations.vllm.tensors import cache_pages
from kvarena.testing.vllm_tensors import allocation, fill, page

# (remote block, local block) per object, one per group of the kind; the
# hybrid's groups each own their block ids (block-major groups alias bytes)
KV = [((1,), (4,)), ((7,), (2,)), ((8,), (9,))]
STATE = [((2, 3), (5, 6))]


def storages(caches) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in caches.values():
        raw = t.view(torch.uint8)
        s = torch.empty(0, dtype=torch.uint8).set_(raw.untyped_storage())
        seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


@pytest.mark.parametrize(
    ("there_layout", "here_layout"),
    [("LBHNC", "LBHNC"), ("BLHNC", "BLHNC"), ("BLNHC", "BLNHC"), ("LBHNC", "BLHNC")],
)
def test_paired_descriptors_read_every_page_into_its_block_and_nothing_else(
    there_layout, here_layout
):
    kc, there = allocation(there_layout)
    _, here = allocation(here_layout)
    fill(there, seed=3)
    groups = classify(kc)
    remote = SpanTable.from_dict(
        SpanTable.of(cache_pages(there, groups, num_blocks=kc.num_blocks)).to_dict()
    )  # as it travels in the handshake
    local = SpanTable.of(cache_pages(here, groups, num_blocks=kc.num_blocks))
    assert not local.mismatches(remote)
    before = [s.clone() for s in storages(here)]
    rows = 0
    for kind, objects in (("kv", KV), ("state", STATE)):
        theirs = np.array([r for r, _ in objects])
        mine = np.array([m for _, m in objects])
        ours, peer = pair(local, remote, kind, mine, theirs)
        assert ours.shape == peer.shape and (ours[:, 1] == peer[:, 1]).all()
        for (dst, n, _), (src, m, _) in zip(ours.tolist(), peer.tolist(), strict=True):
            assert n == m
            ctypes.memmove(dst, src, n)
        rows += len(ours)
        spans = sum(len(t) for t in [local.kinds[kind]]) * len(objects)
        assert len(ours) <= spans  # merged, never split
    kinds = {g.index: g.kind for g in groups}
    written = set()
    for g in groups:
        objects = KV if kinds[g.index] == "kv" else STATE
        at = [x.index for x in groups if x.kind == g.kind].index(g.index)
        for theirs, mine in objects:
            for name in g.layers:
                assert page(here[name], mine[at]) == page(there[name], theirs[at])
            written.add(mine[at])
    # every other block of the decode allocation is as it was
    for name, t in here.items():
        for b in range(kc.num_blocks):
            if b not in written:
                assert not t[b].view(torch.uint8).any(), (name, b)
    assert rows > 0 and any(
        not torch.equal(a, b) for a, b in zip(before, storages(here), strict=True)
    )


def test_block_major_reads_one_descriptor_per_block():
    kc, there = allocation("BLHNC")
    _, here = allocation("BLHNC")
    groups = classify(kc)
    remote = SpanTable.of(cache_pages(there, groups, num_blocks=kc.num_blocks))
    local = SpanTable.of(cache_pages(here, groups, num_blocks=kc.num_blocks))
    ours, _ = pair(local, remote, "kv", np.array([[4], [2]]), np.array([[1], [7]]))
    assert len(ours) == 2  # a block of every layer of the group is one range on both sides
    lb = SpanTable.of(cache_pages(allocation("LBHNC")[1], groups, num_blocks=kc.num_blocks))
    mixed, _ = pair(lb, remote, "kv", np.array([[4], [2]]), np.array([[1], [7]]))
    assert len(mixed) == 2 * 3  # layer-major on one side: a range per layer per block


def test_tables_that_cut_objects_otherwise_do_not_pair():
    kc, there = allocation("BLHNC")
    groups = classify(kc)
    table = SpanTable.of(cache_pages(there, groups, num_blocks=kc.num_blocks))
    cut = table.to_dict()
    rows = cut["kinds"]["kv"]
    cut["kinds"]["kv"] = [[*rows[0][:5], rows[0][5] // 2], *rows[1:]]  # a shorter first span
    assert table.mismatches(SpanTable.from_dict(cut)) == [
        "kv objects: spans cut differently (payload offsets or lengths)"
    ]
    fewer = {**table.to_dict(), "kinds": {"kv": rows[:-1], "state": cut["kinds"]["state"]}}
    assert "spans here" in table.mismatches(SpanTable.from_dict(fewer))[0]


def test_a_block_outside_the_storages_is_refused():
    kc, there = allocation("LBHNC")
    groups = classify(kc)
    table = SpanTable.of(cache_pages(there, groups, num_blocks=kc.num_blocks))
    with pytest.raises(ValueError, match="outside the storages"):
        table.addresses("kv", np.array([[kc.num_blocks]]))
