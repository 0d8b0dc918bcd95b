"""One record per request (``kvarena.pools.holdings``): shared, remapped in place."""

from __future__ import annotations

import pytest
import torch
from conftest import plan_for

from kvarena import EntryField, UnifiedCache
from kvarena.errors import InvalidValueError
from kvarena.pools import BlockTable

PAGE = [EntryField("k", 2, (16, 8), torch.float32)]
STATE = [EntryField("s", 2, (64,), torch.float32)]


def crowded_cache():
    """A cache whose request sits at the top of PAGE and the bottom of STATE."""
    c = UnifiedCache.from_plan(plan_for(PAGE, STATE, 256 * 1024, 4), "cpu")
    filler = c.blocks.allocate(c.blocks.num_free - 3)
    crowd = [("crowd", i) for i in range(c.slots.num_free - 1)]
    for r in crowd:
        c.allocate_slots(r)
    c.allocate_slots("r")
    holding = c.hold("r", c.blocks.allocate(3))
    return c, holding, filler, crowd


def test_every_holder_of_one_record_sees_a_move():
    c, holding, filler, crowd = crowded_cache()
    table = BlockTable(c, holding, tokens=40)  # shares the record, does not copy it
    assert table.blocks is holding.blocks
    blocks = list(holding.blocks)
    for b, word in zip(blocks, (11, 22, 33), strict=True):
        c.block_bytes_of(b).fill_(word)
    for b in filler:
        c.blocks.release(b)
    k = 1
    while c.geometry.blocks_below(c.slots.first - k) > min(blocks):
        k += 1
    move = c.grow_state(k)
    assert set(blocks) <= set(move.block_remap)
    assert (
        holding.blocks == [move.block_remap[b] for b in blocks] and table.blocks is holding.blocks
    )
    assert [int(c.block_bytes_of(b)[0]) for b in holding.blocks] == [11, 22, 33]
    table.reserve(4 * 16)  # appends to the one record
    assert len(holding.blocks) == 4
    for r in crowd:
        c.release_slots(r)
    slot = holding.slots[0]
    move = c.shrink_state(slot - c.slots.first + 1)
    assert holding.slots == (move.slot_remap[slot],)
    table.release()  # a shared record stays its owner's to let go
    assert len(c.holdings) == 1 and holding.blocks == []
    c.release_slots("r")
    c.let_go(holding)
    assert len(c.holdings) == 0 and c.blocks.num_live == 0


def test_a_table_of_its_own_lets_its_record_go():
    c = UnifiedCache.from_plan(plan_for(PAGE, STATE, 256 * 1024, 4), "cpu")
    table = BlockTable(c)
    table.reserve(20)
    fork = table.fork()
    assert len(c.holdings) == 2 and fork.holding is not table.holding
    table.release()
    fork.release()
    assert len(c.holdings) == 0 and c.blocks.num_live == 0


def test_refusals():
    c = UnifiedCache.from_plan(plan_for(PAGE, STATE, 256 * 1024, 4), "cpu")
    with pytest.raises(InvalidValueError, match="must be a list"):
        c.hold("r", (1, 2))
    h = c.hold("r")
    c.let_go(h)
    with pytest.raises(InvalidValueError, match="not held"):
        c.let_go(h)
    with pytest.raises(InvalidValueError, match="must be a Holding"):
        BlockTable(c, [1, 2])
    with pytest.raises(InvalidValueError, match=r"hold: blocks.*free"):
        c.hold("r", [0])  # a holder holds references: a free block is refused
    with pytest.raises(
        InvalidValueError, match=r"hold: blocks: id \d+ is out of range; legal: 0\.\."
    ):
        c.hold("r", [c.num_blocks + 5])
    with pytest.raises(InvalidValueError):
        c.hold(["unhashable"])
    with pytest.raises(InvalidValueError, match="fixed must be a bool"):
        c.hold("r", fixed=1)
    assert len(c.holdings) == 0  # nothing refused was registered
    assert h.slots == ()  # no slots taken: the allocator's book says so


def test_a_fixed_holding_refuses_every_move_that_would_relocate_it():
    """Ids a peer writes by address (a transfer in flight) never move under it."""
    from kvarena.pools import BoundaryMoveError

    c, holding, filler, crowd = crowded_cache()
    holding.fixed = True
    for b in filler:
        c.blocks.release(b)
    for r in crowd:
        c.release_slots(r)
    k = 1
    while c.geometry.blocks_below(c.slots.first - k) > min(holding.blocks):
        k += 1
    before = (c.buf.clone(), list(holding.blocks), holding.slots, c.blocks.capacity, c.moves)
    with pytest.raises(BoundaryMoveError, match="read or written by a peer"):
        c.grow_state(k)
    slot = holding.slots[0]
    with pytest.raises(BoundaryMoveError, match="read or written by a peer"):
        c.shrink_state(slot - c.slots.first + 1)
    assert torch.equal(c.buf, before[0])
    assert (list(holding.blocks), holding.slots, c.blocks.capacity, c.moves) == before[1:]
    assert c.rebalance(waiting_requests=0, blocks_needed=0) is None
    holding.fixed = False  # landed: now it moves like any other
    move = c.grow_state(k)
    assert set(before[1]) <= set(move.block_remap)
