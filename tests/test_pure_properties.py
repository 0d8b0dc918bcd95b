"""Property tests for the pure planning functions added with the one road and the prefix cache."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvarena.copy.words import word_bytes
from kvarena.pools import PoolGeometry
from kvarena.prefix import CheckpointPolicy
from kvarena.prefix.keys import block_keys
from kvarena.tiers.stack import first_holders, first_members

ALIGNS = st.sampled_from([256, 512, 1024])


@given(
    total=st.integers(0, 1 << 22),
    block_units=st.integers(0, 64),
    slot_units=st.integers(0, 64),
    align=ALIGNS,
    data=st.data(),
)
def test_pool_geometry_keeps_both_pools_inside_and_apart(
    total, block_units, slot_units, align, data
):
    g = PoolGeometry(
        total_bytes=total,
        block_stride=block_units * 256,
        slot_stride=slot_units * align,
        state_alignment=align,
    )
    assert 0 <= g.slot_base and g.top <= total and g.top % align == 0
    assert g.slot_base + g.total_slots * g.slot_stride == g.top
    first = data.draw(st.integers(0, g.total_slots))
    boundary = g.boundary(first)
    assert boundary % align == 0 or g.slot_stride == 0
    blocks = g.blocks_below(first)
    if g.block_stride:
        # Every block lies below the STATE pool, and one more would not fit.
        assert blocks * g.block_stride <= boundary < (blocks + 1) * g.block_stride
    else:
        assert blocks == 0
    # Giving STATE one more slot never adds blocks.
    if first:
        assert g.blocks_below(first - 1) <= blocks
    assert g.max_blocks == g.blocks_below(g.total_slots) >= blocks


@given(
    prompt=st.integers(1, 20_000),
    hit=st.integers(0, 1300),
    end=st.booleans(),
    align=st.sampled_from([0, 16, 512]),
    interval=st.sampled_from([0, 64, 4096]),
)
def test_policy_boundaries_lie_past_the_hit_inside_the_prompt(prompt, hit, end, align, interval):
    bs = 16
    hit = min(hit, prompt // bs)
    if not (end or align or interval):
        end = True
    p = CheckpointPolicy(end=end, end_align_tokens=align, interval_tokens=interval, branch=False)
    bounds = p.boundaries(prompt, bs, hit)
    assert bounds == sorted(set(bounds))
    assert all(hit < b <= prompt // bs for b in bounds)
    # The spec, token by token: the prompt's last block boundary, its last multiple
    # of `align` tokens, every multiple of `interval` tokens; only past the hit.
    want = set()
    for tok in range(bs, prompt + 1, bs):
        if (
            (end and tok == prompt // bs * bs)
            or (align and tok == prompt // align * align)
            or (interval and tok % interval == 0)
        ):
            want.add(tok // bs)
    assert set(bounds) == {b for b in want if b > hit}


@given(
    tokens=st.lists(st.integers(0, 1000), min_size=0, max_size=80),
    bs=st.sampled_from([1, 4, 16]),
    at=st.integers(0, 79),
)
def test_block_keys_chain_over_prefixes(tokens, bs, at):
    root = b"r" * 16
    arr = np.asarray(tokens, dtype=np.int64)
    keys = block_keys(root, arr, bs)
    assert len(keys) == len(tokens) // bs
    for k in range(len(keys) + 1):  # a prefix's keys are the prefix of the keys
        assert block_keys(root, arr[: k * bs], bs) == keys[:k]
    if at < len(tokens):
        changed = arr.copy()
        changed[at] += 1
        other = block_keys(root, changed, bs)
        i = at // bs  # blocks before the change keep their keys, the rest all differ
        assert other[:i] == keys[:i]
        assert all(a != b for a, b in zip(other[i:], keys[i:], strict=True))
    if keys:  # another namespace root: no key in common
        assert not set(block_keys(b"s" * 16, arr, bs)) & set(keys)


@given(
    spans=st.lists(
        st.tuples(st.integers(0, 60), st.integers(0, 60), st.sampled_from([1, 4, 16])),
        max_size=40,
    ),
    min_bytes=st.integers(0, 80),
    min_spans=st.integers(0, 5),
    skip_seed=st.one_of(st.none(), st.integers(0, 2**16)),
)
def test_progressions_are_strided_views_of_exactly_the_spans_they_cover(
    spans, min_bytes, min_spans, skip_seed
):
    """Each family's rows are spans of the batch, covered once; the source step
    is never negative, nor the destination step, destination
    rows never overlap, and every family is worth its call."""
    from kvarena.spans import progressions

    src = np.array([s for s, _, _ in spans], dtype=np.int64)
    dst = np.array([d for _, d, _ in spans], dtype=np.int64)
    length = np.array([n for _, _, n in spans], dtype=np.int64)
    skip = None
    if skip_seed is not None:
        skip = np.random.default_rng(skip_seed).random(len(spans)) < 0.3
    families, covered = progressions(src, dst, length, min_bytes, min_spans=min_spans, skip=skip)
    if skip is not None:
        assert not (covered & skip).any()
    rows = []
    for s0, d0, count, n, ss, ds in families:
        assert count >= max(2, min_spans) and count * n >= min_bytes and ss >= 0
        assert ds >= n
        rows += [(s0 + i * ss, d0 + i * ds, n) for i in range(count)]
    covered_spans = [spans[i] for i in np.flatnonzero(covered).tolist()]
    assert sorted(rows) == sorted(covered_spans)
    assert covered.sum() == len(rows)


@given(
    highest_first=st.booleans(),
    ops=st.lists(
        st.tuples(
            st.sampled_from(
                ["push_many", "pop", "take_many", "take_range", "in_range", "lowest_below"]
            ),
            st.lists(st.integers(0, 200), max_size=60),
        ),
        max_size=40,
    ),
)
def test_free_ids_agree_with_a_plain_set(highest_first, ops):
    """Whatever mix of single and bulk operations, FreeIds holds exactly the ids
    a plain set would and pops the lowest (highest) of them, however many stale
    heap entries the bulk takes left behind."""
    from kvarena.pools.free_ids import FreeIds

    model = set(range(0, 100, 3))
    ids = FreeIds(model, highest_first=highest_first)
    for op, values in ops:
        if op == "push_many":
            new = sorted(set(values) - model)
            ids.push_many(new)
            model |= set(new)
        elif op == "pop" and model:
            want = max(model) if highest_first else min(model)
            assert ids.pop() == want
            model.discard(want)
        elif op == "take_many":
            gone = [v for v in values if v in model]
            ids.take_many(gone)
            model -= set(gone)
        elif op == "take_range" and values:
            lo, hi = min(values), max(values) + 1
            held = [v for v in range(lo, hi) if v in model]
            if len(held) == hi - lo:  # take_range needs every id of the range free
                ids.take_range(lo, hi)
                model -= set(held)
        elif op == "in_range" and values:
            lo, hi = min(values), max(values)
            assert ids.in_range(lo, hi) == sorted(v for v in model if lo <= v < hi)
        elif op == "lowest_below" and values:
            limit, k = values[0], len(values)
            assert ids.lowest_below(limit, k) == sorted(v for v in model if v < limit)[:k]
        assert len(ids) == len(model) and all(v in ids for v in model)
    assert ids.descending() == sorted(model, reverse=True)
    assert ids.in_range(0, 150) == sorted(v for v in model if v < 150)


@given(
    size=st.integers(100, 3000),
    taken=st.lists(st.integers(0, 3000), max_size=400),
    pushed=st.lists(st.integers(0, 3000), max_size=100),
    limit=st.integers(0, 3100),
    k=st.integers(1, 12),
)
def test_lowest_below_walks_the_heap_to_the_same_answer(size, taken, pushed, limit, k):
    """A few of many free ids (the heap walk, not the sort), with stale heap
    entries from taken ids and ids pushed back: the k lowest below the limit."""
    from kvarena.pools.free_ids import FreeIds

    ids = FreeIds(range(size))
    model = set(range(size))
    gone = sorted(set(taken) & model)
    ids.take_many(gone)
    model -= set(gone)
    back = sorted(set(pushed) - model)
    ids.push_many(back)
    model |= set(back)
    assert 8 * k < len(model) or len(model) < 100  # mostly the walk
    assert ids.lowest_below(limit, k) == sorted(v for v in model if v < limit)[:k]


@given(
    capacity=st.integers(1, 300),
    held=st.lists(st.integers(0, 299), max_size=300),
    limit=st.integers(-5, 320),
    k=st.one_of(st.none(), st.integers(0, 320)),
)
def test_free_blocks_below_names_the_lowest_free_blocks(capacity, held, limit, k):
    """Whichever way the allocator answers (a walk of the heap for a few of
    many, a scan of its kind array otherwise), the answer is the lowest free
    blocks under the limit."""
    from kvarena.pools.blocks import BlockAllocator

    blocks = BlockAllocator(capacity)
    live = blocks.allocate(capacity)
    keep = {h for h in held if h < capacity}
    for b in live:
        if b not in keep:
            blocks.release(b)
    free = sorted(b for b in range(capacity) if b not in keep and b < limit)
    assert blocks.free_blocks_below(limit, k) == (free if k is None else free[:k])


@given(
    spans=st.lists(
        st.tuples(st.integers(0, 60), st.integers(0, 60), st.sampled_from([1, 4, 16])),
        max_size=40,
    ),
    min_bytes=st.integers(0, 80),
    min_spans=st.integers(0, 5),
    skip_seed=st.integers(0, 2**16),
)
def test_gathers_are_strided_destinations_of_exactly_the_spans_they_cover(
    spans, min_bytes, min_spans, skip_seed
):
    """Each gather's rows are spans of the batch (destination rows one strided
    view, each row's source named), covered once, never a skipped one; every
    gather is worth its call."""
    from kvarena.spans import gathers

    src = np.array([s for s, _, _ in spans], dtype=np.int64)
    dst = np.array([d for _, d, _ in spans], dtype=np.int64)
    length = np.array([n for _, _, n in spans], dtype=np.int64)
    skip = np.random.default_rng(skip_seed).random(len(spans)) < 0.2
    found, covered = gathers(src, dst, length, min_bytes, skip, min_spans=min_spans)
    rows = []
    for d0, count, n, step, sources in found:
        assert (
            count >= max(2, min_spans)
            and count * n >= min_bytes
            and step >= n
            and sources.size == count
        )
        rows += [(int(s), d0 + i * step, n) for i, s in enumerate(sources.tolist())]
    assert not (covered & skip).any()
    covered_spans = [spans[i] for i in np.flatnonzero(covered).tolist()]
    assert sorted(rows) == sorted(covered_spans)
    assert covered.sum() == len(rows)


# Key orders as batches arrive: runs up and down, a few equal keys, or none at all.
_KEYS = st.one_of(
    st.lists(st.integers(-50, 50), max_size=200),
    st.lists(
        st.tuples(st.integers(-1000, 1000), st.integers(1, 80), st.sampled_from([1, -1])),
        max_size=8,
    ).map(lambda runs: [s + k * d for s, n, d in runs for k in range(n)]),
    # Distinct offsets on one grid in any order (blocks from a free list), some far apart.
    st.tuples(
        st.integers(1, 64),
        st.integers(-(10**6), 10**6),
        st.lists(st.integers(0, 400), unique=True, max_size=120),
        st.lists(st.integers(0, 1 << 40), max_size=2),
    ).map(lambda t: [t[1] + t[0] * k for k in t[2]] + t[3]),
)


@given(keys=_KEYS)
def test_ascending_orders_every_key(keys):
    from kvarena.spans import ascending

    arr = np.asarray(keys, dtype=np.int64)
    order = ascending(arr)
    np.testing.assert_array_equal(np.sort(order), np.arange(arr.size))
    np.testing.assert_array_equal(arr[order], np.sort(arr))


@given(src=_KEYS, data=st.data())
def test_by_source_orders_by_source_then_destination(src, data):
    from kvarena.spans import by_source

    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(data.draw(st.lists(st.integers(0, 9), min_size=s.size, max_size=s.size)))
    order = by_source(s, d.astype(np.int64))
    # Ties (equal source, equal destination) may go either way; the keys may not.
    expected = np.lexsort((d, s))
    np.testing.assert_array_equal(s[order], s[expected])
    np.testing.assert_array_equal(d[order], d[expected])


@given(values=_KEYS)
def test_distinct_names_every_value_once(values):
    from kvarena.spans import distinct

    arr = np.asarray(values, dtype=np.int64)
    assert distinct(arr) == sorted(set(values))


@given(
    step=st.integers(1, 1 << 20),
    base=st.integers(0, 1 << 40),
    cells=st.lists(st.integers(0, 600), min_size=2, max_size=150),
    seed=st.integers(0, 2**32 - 1),
)
def test_grid_order_sorts_keys_on_a_grid_or_declines(step, base, cells, seed):
    from kvarena.spans import GRID_CELLS_PER_KEY, _grid_order

    keys = np.asarray([base + step * c for c in cells], dtype=np.int64)
    keys = keys[np.random.default_rng(seed).permutation(keys.size)]
    order = _grid_order(keys)
    distinct = np.unique(keys).size == keys.size
    span = (int(keys.max()) - int(keys.min())) // step + 1  # cells at most (the gcd may be larger)
    if distinct and span <= GRID_CELLS_PER_KEY * keys.size:
        assert order is not None
    if order is not None:
        assert distinct
        np.testing.assert_array_equal(keys[order], np.sort(keys))


_ITEMS = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 3),
    st.booleans(),
    st.floats(allow_nan=False),
    st.sampled_from(["3", 2**63, -(2**63) - 1, np.int64(7), np.int32(-2), np.bool_(True)]),
)


@given(lists=st.lists(st.lists(_ITEMS, max_size=12), max_size=5), as_tuples=st.booleans())
def test_int_lists_takes_plain_ints_only(lists, as_tuples):
    from kvarena.checks import int_lists

    given_lists = [tuple(v) for v in lists] if as_tuples else lists
    flat = [v for values in lists for v in values]
    plain = all(
        isinstance(v, (int, np.integer))
        and not isinstance(v, (bool, np.bool_))
        and -(2**63) <= int(v) < 2**63
        for v in flat
    )
    got = int_lists(given_lists)
    if plain:
        assert got is not None and got.dtype == np.int64
        assert got.tolist() == [int(v) for v in flat]
    else:
        assert got is None


@given(
    spans=st.lists(
        st.tuples(st.integers(0, 60), st.integers(0, 60), st.integers(1, 6)), max_size=30
    )
)
def test_coalesce_keeps_every_byte_pair_and_sorts_by_destination(spans):
    from kvarena.spans import coalesce

    src = np.array([s for s, _, _ in spans], dtype=np.int64)
    dst = np.array([d for _, d, _ in spans], dtype=np.int64)
    length = np.array([n for _, _, n in spans], dtype=np.int64)
    s, d, n = coalesce(src, dst, length)
    assert (np.diff(d) >= 0).all() and n.sum() == length.sum() and s.size <= src.size

    def pairs(a, b, k):
        return sorted((x + i, y + i) for x, y, m in zip(a, b, k, strict=True) for i in range(m))

    assert pairs(s, d, n) == pairs(src, dst, length)


@given(
    arrays=st.lists(st.lists(st.integers(0, 1 << 40), max_size=20), max_size=4),
    offsets=st.lists(st.integers(0, 1 << 40), max_size=3),
    widest=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_word_bytes_is_the_widest_word_dividing_everything(arrays, offsets, widest):
    """The word is a power of two up to ``widest`` dividing every value, and
    twice it (up to ``widest``) does not divide them all."""
    w = word_bytes(
        *(np.array(a, dtype=np.int64) for a in arrays), offsets=tuple(offsets), widest=widest
    )
    values = [v for a in arrays for v in a] + list(offsets)
    assert w in (1, 2, 4, 8, 16) and w <= widest
    assert all(v % w == 0 for v in values)
    if w < widest:
        assert any(v % (2 * w) for v in values)


@given(
    names=st.lists(st.sampled_from("abcdefgh"), max_size=12),
    books=st.lists(st.sets(st.sampled_from("abcdefgh")), max_size=4),
)
def test_books_in_memory_answer_as_the_tier_walk_does(names, books):
    """The first book holding each name, asked name by name, is the tier walk's
    answer over probes of the same books."""
    probes = [lambda asked, b=b: [n in b for n in asked] for b in books]
    assert first_members(names, books) == first_holders(names, probes)
