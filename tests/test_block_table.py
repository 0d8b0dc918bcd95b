"""Batched state slots, whole-entry state copies and block tables, by bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvarena
from kvarena import EntryField, ModelCache, UnifiedCache, plan_cache
from kvarena.pools import BlockTable, StateAllocator, block_table_tensor


def _cache(slots=6, blocks_budget=64 << 10):
    model = ModelCache.from_fields(
        [EntryField("k", 2, (4, 3), torch.float32)],
        [EntryField("conv", 2, (5, 3), torch.float16), EntryField("rec", 3, (2, 2), torch.float32)],
        block_size=4,
    )
    plan = plan_cache(model, budget_bytes=blocks_budget, max_seqs=slots)
    cache = UnifiedCache.from_plan(plan, "cpu")
    g = torch.Generator().manual_seed(0)
    cache.buf.copy_(torch.randint(0, 256, cache.buf.shape, dtype=torch.uint8, generator=g))
    return cache


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(1, 24),
    per_req=st.integers(1, 3),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=12),
)
def test_allocate_batch_takes_one_ascending_run_when_one_exists(total, per_req, ops):
    s = StateAllocator(total, total, per_req)
    held: list[str] = []
    for i, (alloc, n) in enumerate(ops):
        if alloc:
            want = n * per_req
            free = sorted(x for x in range(total) if s.is_free(x))
            runs = [a for a in free if all(a + j in free for j in range(want))]
            names = [f"r{i}.{j}" for j in range(n)]
            if len(free) < want:
                with pytest.raises(kvarena.StateAllocationError):
                    s.allocate_batch(names)
                continue
            groups = s.allocate_batch(names)
            flat = [x for g in groups for x in g]
            assert all(list(g) == sorted(g) for g in groups)
            assert len(set(flat)) == want
            if runs:  # the highest run, entry by entry: each entry consecutive over the batch
                top = max(runs)
                assert sorted(flat) == list(range(top, top + want))
                for e in range(per_req):
                    assert [g[e] for g in groups] == list(range(top + e * n, top + (e + 1) * n))
            held.extend(names)
        elif held:
            s.release(held.pop(0))
    owned = [x for x in range(total) if not s.is_free(x)]
    assert len(owned) == len(held) * per_req


def test_state_rows_are_views_and_gather_scatter_round_trip():
    c = _cache()
    a, b, d = c.allocate_slots_batch(["a", "b", "d"])
    rows = c.state_rows("conv", [a[0], b[0], d[0]])
    assert rows is not None and rows.shape == (2, 3, 5, 3)
    rows.fill_(1.5)  # writes through to the slots' bytes
    assert torch.equal(
        c.state_view("conv")[:, a[0]], torch.full((2, 5, 3), 1.5, dtype=torch.float16)
    )
    assert c.state_rows("conv", [d[0], a[0]]) is None  # not ascending: no strided view
    got = c.gather_states("rec", [d[0], a[0]])
    assert torch.equal(got[:, 0], c.state_view("rec")[:, d[0]])
    new = torch.randn_like(got)
    c.scatter_states("rec", [d[0], a[0]], new)
    assert torch.equal(c.state_view("rec")[:, a[0]], new[:, 1])
    with pytest.raises(kvarena.InvalidValueError, match="shape"):
        c.scatter_states("rec", [a[0]], new)
    c.release_slots("d")
    with pytest.raises(kvarena.InvalidValueError, match="free"):
        c.gather_states("rec", [d[0]])


def test_copy_slots_moves_whole_entries_even_as_a_permutation():
    c = _cache()
    groups = c.allocate_slots_batch(["a", "b", "c"])
    slots = [g[0] for g in groups]
    for s in slots:
        c.state.entry(s).copy_(torch.randint(0, 256, (c.slot_bytes,), dtype=torch.uint8))
    before = {s: c.state.entry(s).clone() for s in slots}
    order = [slots[2], slots[2], slots[0]]  # a beam reorder: row 0 and 1 from old row 2
    c.copy_slots(order, slots)
    for dst, src in zip(slots, order, strict=True):
        assert torch.equal(c.state.entry(dst), before[src])
    f = c.fork_slots("a", "a2")
    assert torch.equal(c.state.entry(f[0]), c.state.entry(slots[0]))
    with pytest.raises(kvarena.InvalidValueError, match="pair one to one"):
        c.copy_slots(slots, slots[:1])
    with pytest.raises(kvarena.InvalidValueError, match="repeat"):
        c.copy_slots(slots[:2], [slots[0], slots[0]])


def test_block_table_copies_on_write_and_truncates():
    c = _cache()
    t = BlockTable(c)
    t.prepare_write(0, 6)  # two blocks of 4 tokens
    t.tokens = 6
    assert len(t.blocks) == 2 and c.blocks.num_live == 2
    u = t.fork()
    assert all(c.blocks.refcount(b) == 2 for b in t.blocks)
    shared_first, shared_last = t.blocks
    last = c.block_bytes_of(shared_last).clone()
    copies = u.prepare_write(6, 9)  # into the shared last block, then a new one
    assert [old for old, _ in copies] == [shared_last]
    assert u.blocks[0] == shared_first and u.blocks[1] != shared_last and len(u.blocks) == 3
    assert torch.equal(c.block_bytes_of(u.blocks[1]), last)  # copied whole
    c.page_view("k")[:, u.blocks[1]].fill_(7.0)
    assert torch.equal(c.block_bytes_of(shared_last), last)  # t's bytes untouched
    assert c.blocks.refcount(shared_last) == 1
    idx = u.token_index(2, 6)
    assert idx.tolist() == [
        shared_first * 4 + 2,
        shared_first * 4 + 3,
        u.blocks[1] * 4,
        u.blocks[1] * 4 + 1,
    ]
    tab = block_table_tensor([t, u], "cpu")
    assert tab.dtype == torch.int32 and tab.tolist() == [[*t.blocks, -1], u.blocks]
    u.tokens = 9
    gone = u.truncate(4)
    assert len(gone) == 2 and u.blocks == [shared_first]
    u.release()
    t.release()
    assert c.blocks.num_live == 0
    with pytest.raises(kvarena.InvalidValueError, match="tokens"):
        t.truncate(3)


def test_a_refused_prepare_write_leaves_table_and_pool_as_they_were():
    """Copy-on-write blocks plus new ones counted together before either is taken:
    a write that cannot get both takes neither."""
    c = _cache()
    t = BlockTable(c)
    t.prepare_write(0, 8)
    t.tokens = 8
    u = t.fork()  # both blocks shared now
    others = c.blocks.allocate(c.blocks.num_free - 1)  # room for 1 block, the write needs 2
    books = (list(u.blocks), c.blocks.num_free, [c.blocks.refcount(b) for b in t.blocks])
    with pytest.raises(kvarena.BlockAllocationError, match="wanted 2"):
        u.prepare_write(4, 12)  # copy the shared second block + one new block
    assert (list(u.blocks), c.blocks.num_free, [c.blocks.refcount(b) for b in t.blocks]) == books
    assert u.prepare_write(4, 8) == [(t.blocks[1], u.blocks[1])]  # 1 copy fits
    for b in others:
        c.blocks.release(b)


def test_kv_blocks_store_and_restore_by_bytes():
    """KV blocks (not only states) round-trip through image units, any unit size."""
    c = _cache()
    src = c.blocks.allocate(3)
    before = [c.page_view("k")[:, b].clone() for b in src]
    for unit in (None, 64, 96):
        spec = c.block_checkpoint_spec(unit)
        units = [c.blocks.allocate(spec.units_per_image) for _ in src]
        c.store_blocks(spec, src, units)
        dst = c.blocks.allocate(3)
        c.restore_blocks(spec, dst, units)
        for b, want in zip(dst, before, strict=True):  # every field byte (pads aside)
            assert torch.equal(c.page_view("k")[:, b], want)
        for b in [*dst, *(u for us in units for u in us)]:
            c.blocks.release(b)
    spec = c.block_checkpoint_spec()
    units = [c.blocks.allocate(spec.units_per_image)]
    c.blocks.release(src[0])  # a free block is neither read nor written
    with pytest.raises(kvarena.InvalidValueError, match="free"):
        c.store_blocks(spec, [src[0]], units)
    with pytest.raises(kvarena.InvalidValueError, match="free"):
        c.restore_blocks(spec, [src[0]], units)
