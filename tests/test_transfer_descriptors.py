import math

import numpy as np
import pytest
import torch
from conftest import plan_for

from kvarena import EntryField, LayoutMismatchError, UnifiedCache
from kvarena.transfer import (
    CacheGeometry,
    DescriptorBoundsError,
    per_layer_descriptor_count,
    plan_request,
)

PAGE = (
    EntryField("k", 2, (16, 2, 64), torch.bfloat16),
    EntryField("v", 2, (16, 2, 64), torch.bfloat16),
)
STATE = (
    EntryField("ssm", 3, (4, 32, 32), torch.float32),
    EntryField("score", 1, (64,), torch.float32, fill=-math.inf, in_checkpoint=False),
)


def cache_of(page, state, total: int = 4 << 20, slots: int = 4) -> UnifiedCache:
    return UnifiedCache.from_plan(plan_for(page, state, total, slots), "cpu")


def geometry(total: int = 4 << 20):
    cache = cache_of(PAGE, STATE, total)
    return cache, CacheGeometry.of(cache)


def test_one_descriptor_per_run_and_per_slot():
    _, src = geometry()
    _, dst = geometry(total=6 << 20)
    plan = plan_request(
        src, dst, [3, 4, 5, 9], [10, 11, 12, 20], [src.total_slots - 1], [dst.total_slots - 1]
    )
    # Blocks 3,4,5 -> 10,11,12 are one run on both sides; 9 -> 20 another; one slot.
    assert plan.count == 3
    rows_l, rows_r = plan.local, plan.remote
    assert rows_l[0].tolist() == [src.base + 3 * src.block_stride, 3 * src.block_bytes]
    assert rows_r[0].tolist() == [dst.base + 10 * dst.block_stride, 3 * dst.block_bytes]
    assert rows_r[2].tolist() == [
        dst.base + dst.slot_base + (dst.total_slots - 1) * dst.slot_stride,
        dst.slot_bytes,
    ]
    assert plan.nbytes == 4 * src.block_bytes + src.slot_bytes
    assert plan.nixl_rows("remote").shape == (3, 3)
    # Non-adjacent on the destination side: no merge.
    assert plan_request(src, dst, [3, 4], [10, 12], [], []).count == 2


def test_refusals_name_what_is_wrong():
    _, src = geometry()
    _, dst = geometry()
    top = dst.total_slots - 1
    with pytest.raises(DescriptorBoundsError, match="outside its PAGE pool"):
        plan_request(src, dst, [0], [dst.num_blocks], [], [])
    with pytest.raises(DescriptorBoundsError, match="slot 0 is outside its STATE pool"):
        plan_request(src, dst, [], [], [top], [0])
    with pytest.raises(DescriptorBoundsError, match="same counts"):
        plan_request(src, dst, [0, 1], [0], [], [])
    with pytest.raises(DescriptorBoundsError, match="names an id twice"):
        plan_request(src, dst, [0, 0], [1, 2], [], [])
    other_state = (EntryField("ssm", 3, (4, 32, 32), torch.bfloat16),)
    cache = cache_of(PAGE, other_state)
    with pytest.raises(LayoutMismatchError, match="state_fingerprint"):
        plan_request(src, CacheGeometry.of(cache), [0], [0], [], [])


def test_geometry_mismatch_lists_every_field():
    _, a = geometry()
    cache = cache_of(PAGE[:1], STATE[:1])
    problems = a.mismatches(CacheGeometry.of(cache))
    assert {p.split(":")[0] for p in problems} == {
        "page_fingerprint",
        "state_fingerprint",
        "block_bytes",
        "slot_bytes",
    }
    assert CacheGeometry.from_dict(a.to_dict()) == a


def test_per_layer_baseline_count():
    # 2 page fields x 2 layers per block run, 2 state fields over 3 + 1 layers per slot.
    assert per_layer_descriptor_count(4, 4, block_runs=3, slots=1) == 16
    assert np.asarray([per_layer_descriptor_count(4, 4, 1, 1)]).item() == 8


def test_a_peer_geometry_is_checked_before_use():
    _, g = geometry()
    good = g.to_dict()
    for change, words in (
        ({"block_stride": g.block_bytes - 256}, "blocks would overlap"),
        ({"slot_stride": 1}, "slots would overlap"),
        ({"num_blocks": 10**9}, "exceeds max_blocks"),
        ({"max_blocks": 10**9, "num_blocks": 10**9}, "blocks do not fit"),
        ({"first_slot": g.total_slots + 1}, "first_slot"),
        ({"size": -1}, "geometry size"),
        ({"block_bytes": "1024"}, "geometry block_bytes"),
        ({"page_fingerprint": "abc"}, "not a SHA-256"),
    ):
        with pytest.raises(LayoutMismatchError, match=words):
            CacheGeometry.from_dict(good | change)
    with pytest.raises(LayoutMismatchError, match="expected the fields"):
        CacheGeometry.from_dict({k: v for k, v in good.items() if k != "size"})
    with pytest.raises(LayoutMismatchError, match="expected the fields"):
        CacheGeometry.from_dict([1, 2])
    assert CacheGeometry.from_dict(good) == g


def test_the_geometry_carries_the_plans_max_blocks():
    """One max_blocks: the plan's PoolGeometry, whether the budget is a multiple of
    the STATE alignment or not (the peer never recomputes it from the size)."""
    for extra in (0, 1, 4095, 4097):
        plan = plan_for(PAGE, STATE, (4 << 20) + extra, 4)
        cache = UnifiedCache.from_plan(plan, "cpu")
        g = CacheGeometry.of(cache)
        assert g.max_blocks == plan.geometry.max_blocks == cache.max_blocks
        assert CacheGeometry.from_dict(g.to_dict()).max_blocks == g.max_blocks


def test_descriptor_ids_are_integers():
    _, src = geometry()
    _, dst = geometry()
    for bad in ([2.9], ["3"], [True], np.array([1.0])):
        with pytest.raises(ValueError, match="source blocks"):
            plan_request(src, dst, bad, [0], [], [])
    plan = plan_request(src, dst, np.array([3], dtype=np.int32), [np.int64(4)], [], [])
    assert plan.count == 1
