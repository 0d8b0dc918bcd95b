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
    c = make()
    c.blocks.set_write_down(lambda victims: evicted.extend(b for v in victims for b in v.blocks))
    blocks = c.blocks.allocate(c.num_blocks)
    for b in blocks:
        c.block_bytes_of(b).fill_(b % 251)
    for b in blocks[:40]:
        c.blocks.release(b)  # free low
    high = blocks[-6:]
    c.blocks.cache(("k", high[0]), [high[0]])
    c.blocks.release(high[0])  # evictable at the top
    k_before = c.page_view("k")
    move = c.grow_state(2)
    assert move.slots_after == 6 and move.blocks_after < move.blocks_before
    assert high[0] in move.evicted_blocks and evicted == [high[0]]
    assert set(move.block_remap) == {b for b in blocks[move.blocks_after :] if b != high[0]}
    assert len(move.block_remap) == move.blocks_before - move.blocks_after - 1 > 0
    for old, new in move.block_remap.items():
        assert new < move.blocks_after
        assert (c.block_bytes_of(new) == old % 251).all()
        assert c.blocks.refcount(new) == 1 and c.blocks.refcount(old) == 0
    assert move.copies <= len(move.block_remap)  # one copy per block at most (runs coalesce)
    assert c.page_view("k").data_ptr() == k_before.data_ptr()  # views stay valid
    # A request on a slot won from PAGE starts from the fills, padding zero.
    slot = c.allocate_slots("new")[0]
    assert c.slots.first <= slot and c.slots.is_free(slot) is False
    c.release_slots("new")
    c.slot_bytes_of(c.slots.first).fill_(0xEE)  # stale bytes in a free slot
    while c.slots.num_free:
        last = c.allocate_slots(("r", c.slots.num_free))[0]
    assert last == c.slots.first
    assert (c.state_view("score")[0, last] == -math.inf).all()
    raw = c.slot_bytes_of(last)
    assert not raw[: c.state.field_offset("score")].any()


def test_evenly_spaced_relocations_are_one_copy():
    """Live blocks interleaved with free ones (every other block released) all
    relocate with ONE strided copy, each block's bytes intact; a shrink over
    evenly spaced live states moves them in ascending order, also one copy."""
    c = make(state_slots=8)
    blocks = c.blocks.allocate(c.num_blocks)
    for b in blocks:
        c.block_bytes_of(b).fill_(b % 251)
    for b in blocks[::2]:
        c.blocks.release(b)
    move = c.grow_state(2)
    assert len(move.block_remap) > 4 and move.copies == 1
    for old, new in move.block_remap.items():
        assert (c.block_bytes_of(new) == old % 251).all() and c.blocks.refcount(new) == 1
    news = [move.block_remap[o] for o in sorted(move.block_remap)]
    assert news == sorted(news)  # the blocks keep their order
    reqs = [c.allocate_slots(r)[0] for r in range(c.slots.num_free)]
    for r, slot in enumerate(reqs):
        c.slot_bytes_of(slot).fill_(r + 1)
    first = c.slots.first
    for r, slot in enumerate(reqs):
        if slot >= first + 4 or (slot - first) % 2:  # live: first, first + 2
            c.release_slots(r)
    move = c.shrink_state(4)
    assert sorted(move.slot_remap) == [first, first + 2] and move.copies == 1
    olds = sorted(move.slot_remap)
    assert [move.slot_remap[o] for o in olds] == sorted(move.slot_remap.values())
    for old, new in move.slot_remap.items():
        r = reqs.index(old)
        assert c.slots.slots_of(r) == (new,) and (c.slot_bytes_of(new) == r + 1).all()


def test_shrink_relocates_live_states_upward_and_keeps_bytes():
    c = make(state_slots=6)
    reqs = [c.allocate_slots(r)[0] for r in range(6)]  # fills top-down
    for r, s in enumerate(reqs):
        c.slot_bytes_of(s).fill_(r + 1)
    c.release_slots(0)
    c.release_slots(1)  # the two topmost are free now
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
    c.allocate_slots("a")
    before = c.buf.clone()
    with pytest.raises(BoundaryMoveError, match="live blocks sit above") as info:
        c.grow_state(1)
    assert info.value.needed > info.value.available == 0
    with pytest.raises(BoundaryMoveError, match="only 4 slots are in the STATE pool"):
        c.shrink_state(5)
    for r in "bcd":
        c.allocate_slots(r)
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


@pytest.mark.parametrize("which", ["layer_major", "no_state", "no_page"])
def test_rebalance_of_a_boundary_that_cannot_move_is_no_move(which):
    """rebalance answers "which move helps?": where none can exist, None, books untouched
    (a KV-only replay short of blocks asked it, and got an exception)."""
    if which == "layer_major":
        c = make(page_layout="layer_major")
    else:
        plan = plan_for(
            PAGE if which == "no_state" else [], STATE if which == "no_page" else [], 64 * 1024, 2
        )
        c = UnifiedCache.from_plan(plan, "cpu")
    before = (c.num_blocks, c.num_slots, c.blocks.num_free, c.slots.num_free)
    for waiting, needed in ((0, 0), (3, 0), (0, c.num_blocks + 5), (3, c.num_blocks + 5)):
        assert c.rebalance(waiting_requests=waiting, blocks_needed=needed) is None
    assert (c.num_blocks, c.num_slots, c.blocks.num_free, c.slots.num_free) == before


def test_rebalance_follows_demand():
    c = make()
    blocks = c.blocks.allocate(20)
    for r in range(4):
        c.allocate_slots(r)  # every slot busy
    move = c.rebalance(waiting_requests=3, blocks_needed=10)
    assert move is not None and move.slots_after == 4 + 3 and not move.block_remap
    assert c.blocks.num_free >= 10
    assert c.rebalance(waiting_requests=0, blocks_needed=0) is None
    # Demand that would leave fewer than blocks_needed obtainable is not granted.
    assert c.rebalance(waiting_requests=3 + c.slots.first, blocks_needed=c.num_blocks) is None
    for b in blocks:
        c.blocks.release(b)
    for r in range(4):
        c.release_slots(r)
    move = c.rebalance(waiting_requests=0, blocks_needed=c.num_blocks + 5)
    assert move is not None and move.blocks_after >= move.blocks_before + 5


def test_block_allocator_rules():
    evicted = []
    a = BlockAllocator(4)
    a.set_write_down(lambda victims: evicted.extend(b for v in victims for b in v.blocks))
    assert a.allocate(2) == [0, 1]
    a.retain(0)
    a.release(0)
    assert a.refcount(0) == 1
    a.cache(("k", 1), [1])
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
    # Top-most first; a request's own slots ascend (its live state lowest).
    assert s.allocate("a") == (8, 9) and s.allocate("b") == (6, 7)
    s.release("a")
    assert s.allocate("c") == (8, 9)
    with pytest.raises(ValueError, match="already holds"):
        s.allocate("c")
    s.allocate("d")
    from kvarena.pools import StateAllocationError

    with pytest.raises(StateAllocationError, match="needs 2 state slots but only 0"):
        s.allocate("e")


def test_refresh_reorders_lru_without_a_reference():
    evicted = []
    a = BlockAllocator(3)
    a.set_write_down(lambda victims: evicted.extend(b for v in victims for b in v.blocks))
    blocks = a.allocate(3)
    for b in blocks:
        a.cache(("k", b), [b])
        a.release(b)
    assert a.evictable_blocks() == [0, 1, 2]
    a.refresh(0)  # a prefix lookup hit block 0 without taking it
    assert a.evictable_blocks() == [1, 2, 0] and a.refcount(0) == 0
    assert a.allocate(2) == [1, 2] and evicted == [1, 2]


def test_checkpoint_liveness_follows_the_allocators_across_moves():
    c = make(state_slots=4)
    spec = c.checkpoint_spec()
    units = [c.blocks.allocate(spec.units_per_image)]
    for r in range(4):
        c.allocate_slots(r)
    src = c.slots.slots_of(0)[0]
    c.slot_bytes_of(src).fill_(7)
    c.store(spec, [src], units)
    # Finish two requests; shrink gives their (lowest) slots back to PAGE.
    low = sorted(c.slots.slots_of(r)[0] for r in range(4))[:2]
    for r in range(4):
        if c.slots.slots_of(r)[0] in low:
            c.release_slots(r)
    c.shrink_state(2)
    before = c.buf.clone()
    with pytest.raises(ValueError, match=r"out of range; legal"):
        c.restore(spec, [low[0]], units)  # a slot the STATE pool no longer owns
    freed = c.release_slots(c.slots.requests[0])[0]  # in the pool, held by no one
    with pytest.raises(ValueError, match="is free; only slots a request holds"):
        c.restore(spec, [freed], units)
    assert torch.equal(c.buf, before)
    # Grow again: a request on a slot won from PAGE can be stored from and restored into.
    c.grow_state(3)
    while c.slots.num_free:
        gained = c.allocate_slots(("new", c.slots.num_free))[0]
    assert gained == c.slots.first  # the lowest slot, won from PAGE by the grow
    c.restore(spec, [gained], units)
    o, n = spec.ranges[0]
    assert (c.slot_bytes_of(gained)[o : o + n] == 7).all()
    c.store(spec, [gained], units)
    # Units must be held: a released block is refused for a store, a free one for a restore.
    c.blocks.release(units[0][0])
    with pytest.raises(ValueError, match="is free; it must be live"):
        c.store(spec, [gained], units)
    with pytest.raises(ValueError, match="is free; it must be live or evictable"):
        c.restore(spec, [gained], units)


def test_relocation_keeps_every_byte_of_an_image_in_a_block_tail():
    # A PAGE field aligned to 1024 makes the block stride exceed the block's bytes;
    # units of a whole stride put image bytes in that tail, and a move must keep them.
    page = [
        EntryField("k", 1, (1024,), torch.uint8),
        EntryField("s", 1, (8,), torch.uint8, align=1024),
    ]
    state = [EntryField("ssm", 2, (3000,), torch.uint8)]
    cache = UnifiedCache.from_plan(plan_for(page, state, 256 * 1024, 2), "cpu")
    assert cache.block_stride == 2048 and cache.block_bytes == 1280
    spec = cache.checkpoint_spec()
    assert spec.unit_bytes == 2048
    slot = cache.allocate_slots("a")[0]
    cache.state_view("ssm")[:, slot].copy_(
        torch.arange(6000, dtype=torch.int64).view(2, 3000) % 253
    )
    # Put the image's units at the top of the PAGE pool, below them nothing live.
    top = cache.blocks.allocate(cache.num_blocks)
    units = top[-spec.units_per_image :]
    for b in top[: -spec.units_per_image]:
        cache.blocks.release(b)
    cache.store(spec, [slot], [units])
    move = cache.grow_state(2)
    moved = [move.block_remap.get(u, u) for u in units]
    assert moved != units  # they had to move
    cache.state_view("ssm")[:, slot].zero_()
    cache.restore(spec, [slot], [moved])
    expect = torch.arange(6000, dtype=torch.int64).view(2, 3000) % 253
    assert torch.equal(cache.state_view("ssm")[:, slot].to(torch.int64), expect)
    assert move.copied_bytes == len(move.block_remap) * cache.block_stride


def test_request_ids_that_read_as_free_are_refused():
    c = make()
    before = (c.slots.num_free, c.buf.clone())
    with pytest.raises(ValueError, match="request id None"):
        c.allocate_slots(None)
    with pytest.raises(ValueError, match="not hashable"):
        c.allocate_slots(["r"])
    assert c.slots.num_free == before[0] and torch.equal(c.buf, before[1])


def test_a_refusing_write_down_sink_refuses_the_whole_operation():
    """The sink sees the victims before anything changes; if it raises, the
    allocation or the boundary move is refused whole: every id, key and byte
    as it was."""
    seen = []

    def angry(victims):
        seen.append([v.key for v in victims])
        raise RuntimeError("the tier is full")

    a = BlockAllocator(4)
    a.set_write_down(angry)
    blocks = a.allocate(4)
    for b in blocks[:3]:
        a.cache(("k", b), [b])
        a.release(b)
    with pytest.raises(RuntimeError, match="the tier is full"):
        a.allocate(2)
    assert seen == [[("k", 0), ("k", 1)]]
    assert a.evictable_blocks() == [0, 1, 2] and a.num_free == 0 and a.num_live == 1
    assert [a.blocks_of(("k", b)) for b in range(3)] == [(0,), (1,), (2,)]
    a.check_books()

    c = make()
    blocks = c.blocks.allocate(c.num_blocks)
    for b in blocks:
        c.block_bytes_of(b).fill_(b % 251)
    for b in blocks[:-4]:
        c.blocks.cache(("k", b), [b])
        c.blocks.release(b)  # all evictable but the top four, which are live
    c.blocks.set_write_down(angry)
    before = (c.buf.clone(), c.blocks.capacity, c.slots.capacity, c.blocks.evictable_blocks())
    with pytest.raises(RuntimeError, match="the tier is full"):
        c.grow_state(1)
    assert torch.equal(c.buf, before[0]) and c.moves == 0
    assert (c.blocks.capacity, c.slots.capacity, c.blocks.evictable_blocks()) == before[1:]
    c.blocks.check_books()
    # Without the refusal the same move completes: the victims' keys are gone.
    c.blocks.set_write_down(None)
    move = c.grow_state(1)
    assert move.slots_after == 5 and len(move.block_remap) == 4 and c.moves == 1
    assert all(c.blocks.blocks_of(("k", b)) is None for b in move.evicted_blocks)
    for old, new in move.block_remap.items():
        assert (c.block_bytes_of(new) == old % 251).all() and c.blocks.refcount(new) == 1
    c.blocks.check_books()


def test_a_raw_store_over_the_cache_state_is_refused():
    from kvarena import restore, store

    c = make()
    spec = c.checkpoint_spec()
    slot = c.allocate_slots("a")[0]
    units = c.blocks.allocate(spec.units_per_image)
    before = c.buf.clone()
    with pytest.raises(ValueError, match=r"use cache\.store"):
        store(spec, c.state, [slot], c.page_units(), [units])
    with pytest.raises(ValueError, match=r"use cache\.store"):
        restore(spec, c.state, [slot], c.page_units(), [units])
    assert torch.equal(c.buf, before)
    # The fills were written on the plan's slots all the same.
    assert (c.state_view("score")[0, c.slots.first :] == -math.inf).all()
    assert not c.state_view("score")[0, : c.slots.first].any()


def test_move_many_checks_every_move_before_changing_the_books():
    a = BlockAllocator(8)
    live = a.allocate(4)  # 0..3
    a.release(3)  # 3 free again
    books = (a.num_free, a.live_blocks())
    for moves, words in (
        ([(0, 5), (3, 6)], "block 3 is not live"),
        ([(0, 5), (1, 5)], "distinct free blocks"),
        ([(0, 5), (0, 6)], "moves once"),
        ([(0, 1)], "distinct free blocks"),
        ([(0, 9)], "out of range"),
        ([(0, 5.0)], "must be an int"),
    ):
        with pytest.raises(ValueError, match=words):
            a.move_many(moves)
        assert (a.num_free, a.live_blocks()) == books
    a.move_many([(0, 6), (2, 7)])
    assert a.live_blocks() == [1, 6, 7] and a.is_free(0) and a.is_free(2)
    assert live == [0, 1, 2, 3]
