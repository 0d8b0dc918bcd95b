"""Byte spans as numpy arrays: the one pure helper both copy paths share.

Lives below every package that moves bytes (pools relocating entries, the
copy executor), so both coalesce the same way without one importing the other.
"""

from __future__ import annotations

import numpy as np

TIMSORT_MIN_RUN = 32
"""Timsort (numpy's ``stable`` sort) merges runs already in order and sorts
stretches shorter than this one item at a time; where the runs a batch arrives
in are at least this long on average, it beats quicksort by an order of
magnitude (19,328 offsets in 64 ascending runs: 0.06 ms against 0.66 ms;
41,984 in 64 descending runs: 0.04 ms against 1.6 ms), and
where they are not, quicksort wins (random: 0.78 ms against 1.0 ms)."""


def ascending(keys: np.ndarray) -> np.ndarray:
    """Indices that order ``keys`` ascending (equal keys in any order).

    Batches arrive in few long runs (an image's units one after another, every
    image after the last, slots taken top-down so images descend): such orders
    are found in one pass and sorted by merging runs, not by a sort from
    scratch.
    """
    order = _reordering(keys)
    return np.arange(keys.size) if order is None else order


def _reordering(keys: np.ndarray) -> np.ndarray | None:
    """:func:`ascending`, or None where ``keys`` already ascend (nothing to move)."""
    n = keys.size
    if n < 2:
        return None
    step = np.sign(np.diff(keys))
    falls = np.count_nonzero(step < 0)
    if falls == 0:
        return None
    if falls == n - 1:  # descending all the way
        return np.arange(n - 1, -1, -1)
    # Timsort takes each run up or down as it is: count where the direction turns.
    turns = np.count_nonzero(step[1:] != step[:-1])
    if turns * TIMSORT_MIN_RUN < n:
        return np.argsort(keys, kind="stable")
    on_grid = _grid_order(keys)
    return on_grid if on_grid is not None else np.argsort(keys)


GRID_CELLS_PER_KEY = 8
""":func:`_grid_order` places keys in a table of at most this many cells per
key; sparser keys are sorted by comparison."""


def _grid_order(keys: np.ndarray) -> np.ndarray | None:
    """The ascending order of DISTINCT keys that lie on one evenly spaced grid
    not much larger than their count, else None.

    Block and unit offsets in random order (a free list after churn) are such
    keys: each is put in its grid cell and the occupied cells are read off in
    order, with no comparisons (41,984 unit offsets in a grid of 160,000
    blocks: 0.33 ms against 1.8 ms for quicksort).
    """
    lo = keys.min()
    rel = keys - lo
    step = int(np.gcd.reduce(rel))
    if step == 0:
        return None  # one key, repeated
    cell = rel // step
    cells = int(cell.max()) + 1
    if cells > GRID_CELLS_PER_KEY * keys.size:
        return None
    table = np.full(cells, -1, dtype=np.int64)
    table[cell] = np.arange(keys.size)
    order = table[np.flatnonzero(table >= 0)]  # an index, not a mask: 4x faster here
    return order if order.size == keys.size else None  # a key repeated: compare


def by_source(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Indices that order spans by source, then (one source read into several
    places) by destination."""
    order = ascending(src)
    s = src[order]
    if s.size < 2 or not (s[1:] == s[:-1]).any():
        return order
    return np.lexsort((dst, src))


def distinct(values: np.ndarray) -> list[int]:
    """The distinct values of an integer array, ascending.

    A batch holds one span length or a few (whole units and each image's
    shorter last unit), so each is found by a pass over what is left; after
    a handful, the rest are hashed (``np.unique``: 0.55 ms for 40,000 spans,
    where two passes take a tenth of that).
    """
    found: list[int] = []
    rest = values
    while rest.size:
        if len(found) == 4:
            found.extend(np.unique(rest).tolist())
            break
        v = rest.min()
        found.append(int(v))
        rest = rest[rest != v]
    return sorted(found)


def coalesce(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge spans that continue each other on BOTH sides into one span.

    Spans come back ordered by destination offset; span i+1 joins span i when
    it starts where span i ends in the source and in the destination. Image
    units handed out consecutively by an allocator collapse into one copy
    this way.

    Why by destination: the destinations of a batch never overlap, so every
    two spans that continue each other are neighbours in that order (in
    source order a span read twice can sit between them), and a batch sorted
    by destination is what its checks and gathers need next, so they do not
    sort it again. A batch whose destinations do overlap is refused after
    coalescing: a merged span covers exactly the bytes it joins.
    """
    if src.size < 2:
        return src, dst, length
    order = _reordering(dst)
    s, d, n = (src, dst, length) if order is None else (src[order], dst[order], length[order])
    joins = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
    if not joins.any():
        return s, d, n
    heads = np.flatnonzero(np.concatenate(([True], ~joins)))
    return s[heads], d[heads], np.add.reduceat(n, heads)


def progressions(
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
    min_bytes: int,
    *,
    min_spans: int = 2,
    skip: np.ndarray | None = None,
) -> tuple[list[tuple[int, int, int, int, int, int]], np.ndarray]:
    """Families of equal-length spans whose starts advance by one constant step
    on each side, as ``(src0, dst0, count, length, src_step, dst_step)``, and a
    mask of the spans they cover.

    Such a family is ONE strided view per side (``count`` rows of ``length``
    bytes, ``step`` apart), so it moves with one copy call however many spans
    it holds: blocks relocated from every other slot, an image's units
    scattered over consecutive blocks, one field of every layer. Only families
    of at least ``min_spans`` (two or more) spans and ``min_bytes`` bytes are
    returned: any two spans advance by "one step", so a caller with a better
    road for scattered spans (a gather) asks for more; within each
    length, spans are taken in source order (then destination order), so the
    source step is never negative; rows never overlap on the destination
    side, and a span joins at most one family (the earlier one, where two
    share it); the destination step is never negative either (no torch view
    has a negative stride: rows written downward are a gather, see
    :func:`gathers`). Spans marked in ``skip`` (moved another way) take no
    part.
    """
    min_spans = max(2, min_spans)
    covered = np.zeros(src.size, dtype=bool)
    found: list[tuple[int, int, int, int, int, int]] = []
    if src.size < min_spans:
        return found, covered
    # Batches arrive sorted by source (coalesce sorts them) and mostly of one
    # length: then neither the sort nor the split by length is needed, which
    # keeps this cheap for 100,000 short spans that form no family at all.
    if skip is not None and not skip.any():
        skip = None
    if skip is not None and skip.all():
        return found, covered
    one_length = skip is None and bool(length.min() == length.max())
    lengths = length if skip is None else length[~skip]
    for value in [int(length[0])] if one_length else distinct(lengths):
        if one_length:
            idx = np.arange(src.size)
        elif skip is None:
            idx = np.flatnonzero(length == value)
        else:
            idx = np.flatnonzero((length == value) & ~skip)
        if idx.size < min_spans or idx.size * value < min_bytes or value <= 0:
            continue
        # By source, then destination: one source read into several places
        # (a step of 0) still advances evenly on the destination side.
        order = idx[by_source(src[idx], dst[idx])]
        s, d = src[order], dst[order]
        ds, dd = np.diff(s), np.diff(d)
        change = (ds[1:] != ds[:-1]) | (dd[1:] != dd[:-1])
        apart = dd >= value  # destination rows disjoint, written upward
        for p, q in _families(change, apart, value, min_spans, min_bytes):
            found.append((int(s[p]), int(d[p]), q - p + 1, value, int(ds[p]), int(dd[p])))
            covered[order[p : q + 1]] = True
    return found, covered


def _families(
    change: np.ndarray, apart: np.ndarray, value: int, min_spans: int, min_bytes: int
) -> list[tuple[int, int]]:
    """Spans ``p..q`` of each family in a sorted run of spans of ``value`` bytes.

    Pair ``i`` links span ``i`` to span ``i + 1``; ``change[i]`` says pair
    ``i + 1`` steps differently from pair ``i``, so a run of equal pairs
    ``[p, q)`` is the family of spans ``p..q``, kept when its step keeps the
    destination rows ``apart``, it holds ``min_spans`` spans and ``min_bytes``
    bytes. A span shared by two families stays with the earlier one.
    """
    breaks = np.flatnonzero(change) + 1
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks, [apart.size]))
    spans = last - first + 1
    wanted = (spans >= min_spans) & (spans * value >= min_bytes) & apart[first]
    found: list[tuple[int, int]] = []
    taken = -1
    for p, q in zip(first[wanted].tolist(), last[wanted].tolist(), strict=True):
        p = max(p, taken + 1)
        if q - p + 1 < min_spans or (q - p + 1) * value < min_bytes:
            continue
        found.append((p, q))
        taken = q
    return found


def gathers(
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
    min_bytes: int,
    skip: np.ndarray,
    *,
    min_spans: int = 2,
) -> tuple[list[tuple[int, int, int, int, np.ndarray]], np.ndarray]:
    """Families of equal-length spans whose DESTINATION starts, in order, advance
    by one constant step (at least the length), wherever they read from, as
    ``(dst0, count, length, dst_step, sources)``, and a mask of the spans they
    cover; spans marked in ``skip`` take no part.

    Such a family is one gather: its destination rows are ONE strided view, and
    each row's source start is looked up in ``sources`` (lowest destination
    first). Image units handed out in any order from evenly spaced blocks, or
    a state restored from units wherever they lie, are one family. Only
    families of at least ``min_spans`` (two or more) spans and ``min_bytes``
    bytes are returned; a span joins at most one family. Spans that arrive
    sorted by destination (as :func:`coalesce` leaves them) are not sorted
    again.
    """
    min_spans = max(2, min_spans)
    covered = np.zeros(src.size, dtype=bool)
    found: list[tuple[int, int, int, int, np.ndarray]] = []
    free = ~skip
    if int(free.sum()) < min_spans:
        return found, covered
    by_dst = _reordering(dst)
    for value in distinct(length[free]):
        wanted = free & (length == value)
        order = np.flatnonzero(wanted) if by_dst is None else by_dst[wanted[by_dst]]
        if order.size < min_spans or order.size * value < min_bytes or value <= 0:
            continue
        d = dst[order]
        dd = np.diff(d)
        for p, q in _families(dd[1:] != dd[:-1], dd >= value, value, min_spans, min_bytes):
            rows = order[p : q + 1]
            found.append((int(d[p]), q - p + 1, value, int(dd[p]), src[rows]))
            covered[rows] = True
    return found, covered


Grid = tuple[int, int, int, int, int, int, int, int, int]
"""``(src0, dst0, count, length, src_step, dst_step, outer, outer_src, outer_dst)``:
``outer`` families of ``count`` spans, family ``k`` starting ``k * outer_src``
and ``k * outer_dst`` bytes after the first."""


def grids(families: list[tuple[int, int, int, int, int, int]]) -> list[Grid]:
    """Families of one shape (count, length, steps) whose starts themselves
    advance by one constant step on each side, merged into one grid each: ONE
    three-dimensional view per side. A request's blocks in a layer-major cache
    are such a grid: each object's layers one family (sources back to back,
    destinations a layer's region apart), the objects' families a block
    apart. A family that joins no other is a grid of one. Outer steps are never
    negative (no torch view has a negative stride); the spans' destinations
    were disjoint and stay so."""
    out: list[Grid] = []
    by_shape: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}
    for s0, d0, count, length, ss, ds in families:
        by_shape.setdefault((count, length, ss, ds), []).append((s0, d0))
    for (count, length, ss, ds), starts in by_shape.items():
        starts.sort()
        k = 0
        while k < len(starts):
            end = k + 1
            if end < len(starts):
                step_s = starts[end][0] - starts[k][0]
                step_d = starts[end][1] - starts[k][1]
                while (
                    step_d >= 0
                    and end < len(starts)
                    and starts[end][0] - starts[end - 1][0] == step_s
                    and starts[end][1] - starts[end - 1][1] == step_d
                ):
                    end += 1
            if end - k < 2:
                out.append((*starts[k], count, length, ss, ds, 1, 0, 0))
                k += 1
                continue
            out.append((*starts[k], count, length, ss, ds, end - k, step_s, step_d))
            k = end
    return out
