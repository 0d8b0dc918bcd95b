import math

import pytest
import torch
from conftest import plan_for

from kvarena import EntryField
from kvarena.pools import (
    BlockAllocationError,
    BlockAllocator,
    BoundaryMoveError,
    StateAllocator,
    UnifiedCache,
)

PAGE = [EntryField("k", 2, (4, 8), torch.bfloat16), EntryField("v", 2, (4, 8), torch.bfloat16)]
STATE = [
    EntryField("ssm", 2, (2, 16, 8), torch.float32),
    EntryField("score", 1, (8,), torch.float32, fill=-math.inf, in_checkpoint=False),
]


def make(state_slots: int = 4, entries_per_req: int = 1, **kw):
    plan = plan_for(
        PAGE, STATE, 64 * 1024, state_slots // entries_per_req, entries_per_req=entries_per_req
    )
    return UnifiedCache.from_plan(plan, "cpu", **kw)


def test_geometry_and_views():
    c = make()
    assert c.block_stride == 512 and c.slot_stride == 2304
    assert c.total_slots == 64 * 1024 // 2304
    # PAGE blocks end below the first STATE slot; views address the one buffer.
    assert c.num_blocks * c.block_stride <= c.slot_base + c.slots.first * c.slot_stride
    k = c.page_view("k")
    assert k.shape == (2, c.max_blocks, 4, 8) and k.stride()[1] == 512 // 2
    assert k[0, 3].data_ptr() == c.buf.data_ptr() + 3 * 512
    ssm = c.state_view("ssm")
    top = c.total_slots - 1
    assert ssm[1, top].data_ptr() == c.buf.data_ptr() + c.slot_base + top * 2304 + 1024
    # Only the pool's slots carry the fill; the rest of the buffer is zero.
    assert (c.state_view("score")[0, c.slots.first :] == -math.inf).all()
    assert not c.buf[: c.num_blocks * 512].any()


def test_grow_relocates_live_blocks_one_copy_each_and_keeps_bytes():
    evicted = []
    c = make(on_evict=evicted.append)
    blocks = c.blocks.allocate(c.num_blocks)
    for b in blocks:
        c.block_bytes_of(b).fill_(b % 251)
    for b in blocks[:40]:
        c.blocks.release(b)  # free low
    high = blocks[-6:]
    c.blocks.set_cached(high[0])
    c.blocks.release(high[0])  # evictable at the top
    k_before = c.page_view("k")
    move = c.grow_state(2)
    assert move.slots_after == 6 and move.blocks_after < move.blocks_before
    assert high[0] in move.evicted_blocks and evicted == [high[0]]
    assert set(move.block_remap) == {b for b in blocks[move.blocks_after :] if b != high[0]}
    for old, new in move.block_remap.items():
        assert new < move.blocks_after
        assert (c.block_bytes_of(new) == old % 251).all()
        assert c.blocks.refcount(new) == 1 and c.blocks.refcount(old) == 0
    assert move.copies <= len(move.block_remap)  # one copy per block at most (runs coalesce)
    assert c.page_view("k").data_ptr() == k_before.data_ptr()  # views stay valid
    # A request on a slot won from PAGE starts from the fills, padding zero.
    slot = c.allocate_state("new")[0]
    assert c.slots.first <= slot and c.slots.is_free(slot) is False
    c.free_state("new")
    c.slot_bytes_of(c.slots.first).fill_(0xEE)  # stale bytes in a free slot
    while c.slots.num_free:
        last = c.allocate_state(("r", c.slots.num_free))[0]
    assert last == c.slots.first
    assert (c.state_view("score")[0, last] == -math.inf).all()
    raw = c.slot_bytes_of(last)
    assert not raw[: c.state.field_offset("score")].any()


def test_shrink_relocates_live_states_upward_and_keeps_bytes():
    c = make(state_slots=6)
    reqs = [c.allocate_state(r)[0] for r in range(6)]  # fills top-down
    for r, s in enumerate(reqs):
        c.slot_bytes_of(s).fill_(r + 1)
    c.free_state(0)
    c.free_state(1)  # the two topmost are free now
    first = c.slots.first
    move = c.shrink_state(2)
    assert set(move.slot_remap) == {first, first + 1}
    for old, new in move.slot_remap.items():
        r = reqs.index(old)
        assert c.slots.slots_of(r) == (new,) and (c.slot_bytes_of(new) == r + 1).all()
    assert move.blocks_after > move.blocks_before and c.blocks.num_free == move.blocks_after
    # The blocks won are addressable through the same page view.
    assert (
        c.page_view("k")[:, move.blocks_after - 1].data_ptr()
        == c.buf.data_ptr() + (move.blocks_after - 1) * 512
    )


def test_refused_moves_change_nothing():
    c = make()
    c.blocks.allocate(c.num_blocks)
    c.allocate_state("a")
    before = c.buf.clone()
    with pytest.raises(BoundaryMoveError, match="live blocks sit above") as info:
        c.grow_state(1)
    assert info.value.needed > info.value.available == 0
    with pytest.raises(BoundaryMoveError, match="only 4 slots are in the STATE pool"):
        c.shrink_state(5)
    for r in "bcd":
        c.allocate_state(r)
    with pytest.raises(
        BoundaryMoveError, match="4 live states sit in the released slots but only 0"
    ):
        c.shrink_state(4)
    assert torch.equal(c.buf, before) and c.num_blocks == c.blocks.num_live
    with pytest.raises(BoundaryMoveError, match="slots remain below"):
        c.grow_state(c.slots.first + 1)


def test_layer_major_pages_have_a_fixed_boundary():
    c = make(page_layout="layer_major")
    k = c.page_view("k")
    assert k.shape == (2, c.num_blocks, 4, 8) and k[0].is_contiguous()
    assert c.num_blocks * c.block_bytes <= c.slot_base + c.slots.first * c.slot_stride
    with pytest.raises(BoundaryMoveError, match="boundary is fixed"):
        c.grow_state(1)
    with pytest.raises(ValueError, match="no contiguous block"):
        c.block_bytes_of(0)


def test_rebalance_follows_demand():
    c = make()
    blocks = c.blocks.allocate(20)
    for r in range(4):
        c.allocate_state(r)  # every slot busy
    move = c.rebalance(waiting_requests=3, blocks_needed=10)
    assert move is not None and move.slots_after == 4 + 3 and not move.block_remap
    assert c.blocks.num_free >= 10
    assert c.rebalance(waiting_requests=0, blocks_needed=0) is None
    # Demand that would leave fewer than blocks_needed obtainable is not granted.
    assert c.rebalance(waiting_requests=3 + c.slots.first, blocks_needed=c.num_blocks) is None
    for b in blocks:
        c.blocks.release(b)
    for r in range(4):
        c.free_state(r)
    move = c.rebalance(waiting_requests=0, blocks_needed=c.num_blocks + 5)
    assert move is not None and move.blocks_after >= move.blocks_before + 5


def test_block_allocator_rules():
    evicted = []
    a = BlockAllocator(4, on_evict=evicted.append)
    assert a.allocate(2) == [0, 1]
    a.retain(0)
    a.release(0)
    assert a.refcount(0) == 1
    a.set_cached(1)
    a.release(1)
    assert a.is_evictable(1) and a.num_free == 2
    a.retain(1)  # a prefix hit revives it
    assert a.refcount(1) == 1 and not a.is_evictable(1)
    a.release(1)
    assert a.allocate(3) == [1, 2, 3] and evicted == [1]  # LRU eviction, then lowest ids
    with pytest.raises(
        BlockAllocationError, match="wanted 1 blocks but only 0 are free and 0 evictable"
    ):
        a.allocate(1)
    with pytest.raises(ValueError, match=r"block id must be an int in 0\.\.3, got 7"):
        a.release(7)
    a.release(3)
    with pytest.raises(ValueError, match="not live"):
        a.release(3)
    with pytest.raises(ValueError, match="blocks \\[2\\] are not free"):
        a.shrink(2)


def test_state_allocator_groups_topmost_first():
    s = StateAllocator(total=10, live=6, entries_per_req=2)
    assert s.allocate("a") == (9, 8) and s.allocate("b") == (7, 6)
    s.free("a")
    assert s.allocate("c") == (9, 8)
    with pytest.raises(ValueError, match="already holds"):
        s.allocate("c")
    s.allocate("d")
    from kvarena.pools import StateAllocationError

    with pytest.raises(StateAllocationError, match="needs 2 state slots but only 0"):
        s.allocate("e")


def test_refresh_reorders_lru_without_a_reference():
    evicted = []
    a = BlockAllocator(3, on_evict=evicted.append)
    blocks = a.allocate(3)
    for b in blocks:
        a.set_cached(b)
        a.release(b)
    assert a.evictable_blocks() == [0, 1, 2]
    a.refresh(0)  # a prefix lookup hit block 0 without taking it
    assert a.evictable_blocks() == [1, 2, 0] and a.refcount(0) == 0
    assert a.allocate(2) == [1, 2] and evicted == [1, 2]
