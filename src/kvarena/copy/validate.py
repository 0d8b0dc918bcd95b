"""Checking a described batch before any byte moves.

Every span inside its buffer, no two destination spans overlapping, and no
source span overlapping a destination span when both live in one storage
(reading one byte twice is fine; reading a byte the batch writes is a race).
A refused batch writes nothing.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidValueError
from ..layout.regions import check_byte_buffer
from ..spans import Grid, coalesce
from .plan import CopyBatch


class CopyBoundsError(InvalidValueError):
    """A batch addresses bytes outside its buffers, or overlaps itself."""


@dataclass(frozen=True, kw_only=True)
class CopyStats:
    """What an execution issued: spans, bytes, copy calls and the path taken."""

    spans: int
    nbytes: int
    ops: int
    path: str


def _check_disjoint(s: np.ndarray, lengths: np.ndarray, what: str) -> None:
    """Refuse two spans (non-empty, sorted by start ``s``) that overlap."""
    e = s + lengths
    bad = np.nonzero(s[1:] < e[:-1])[0]
    if bad.size:
        i = int(bad[0])
        raise CopyBoundsError(
            f"{what}: spans [{int(s[i])}, {int(e[i])}) and [{int(s[i + 1])}, {int(e[i + 1])}) overlap"
        )


def _check_reads_miss_writes(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
    """Refuse a source span that overlaps any destination span (one storage;
    spans non-empty, sorted by destination).

    Destinations are disjoint (checked first), so sorted by start their ends
    ascend too: the only destination that can overlap ``[a, b)`` is the last
    one starting before ``b``.
    """
    if src.size == 0:
        return
    src_end, dst_end = src + length, dst + length
    if int(src_end.max()) <= int(dst[0]) or int(dst_end[-1]) <= int(src.min()):
        return  # all reads on one side of all writes (units below, slots above)
    last = np.searchsorted(dst, src_end, side="left") - 1
    hit = (last >= 0) & (dst_end[np.maximum(last, 0)] > src)
    if hit.any():
        i = int(np.nonzero(hit)[0][0])
        j = int(last[i])
        raise CopyBoundsError(
            f"copy batch reads [{int(src[i])}, {int(src_end[i])}) where it also writes "
            f"[{int(dst[j])}, {int(dst_end[j])}) (source and destination share one storage)"
        )


def validate_batch(batch: CopyBatch, src_buf: torch.Tensor, dst_buf: torch.Tensor) -> None:
    """Refuse a batch that would read or write outside its buffers, or race itself."""
    _checked_spans(batch, src_buf, dst_buf)


def _checked_spans(
    batch: CopyBatch, src_buf: torch.Tensor, dst_buf: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch's non-empty spans, coalesced and so sorted by destination,
    once every check has passed.

    Overlaps are looked for among the COALESCED spans: a merged span covers
    exactly the bytes of the spans it joins on each side, and spans it joins
    tile its range without overlapping, so two spans overlap (or a span reads
    what one writes) in the batch exactly when they do after merging; the
    sorts behind the checks then run over a few long spans, not thousands.
    """
    check_byte_buffer(src_buf, "copy source buffer")
    check_byte_buffer(dst_buf, "copy destination buffer")
    if src_buf.device != dst_buf.device:
        raise InvalidValueError(
            f"copy buffers live on {src_buf.device} and {dst_buf.device}; one device"
        )
    n = batch.num_spans
    if not (batch.src.shape == batch.dst.shape == batch.length.shape == (n,)):
        raise InvalidValueError("copy batch arrays must be 1-D of one length")
    if n == 0:
        return batch.src, batch.dst, batch.length
    if batch.length.min() < 0:
        raise CopyBoundsError(f"copy batch holds a negative length {int(batch.length.min())}")
    for name, starts, buf in (("source", batch.src, src_buf), ("destination", batch.dst, dst_buf)):
        size = buf.numel()
        # Each term is bounded before the sum, so start + length cannot wrap int64.
        if int(starts.min()) < 0 or int(starts.max()) > size or int(batch.length.max()) > size:
            raise CopyBoundsError(
                f"copy batch {name} spans start in [{int(starts.min())}, {int(starts.max())}] "
                f"with lengths up to {int(batch.length.max())}, but the {name} buffer holds "
                f"[0, {size})"
            )
        hi = int((starts.astype(np.int64) + batch.length.astype(np.int64)).max())
        if hi > size:
            raise CopyBoundsError(
                f"copy batch {name} spans reach byte {hi} but the {name} buffer holds [0, {size})"
            )
    keep = batch.length > 0
    if keep.all():
        src, dst, length = coalesce(batch.src, batch.dst, batch.length)
    else:
        src, dst, length = coalesce(batch.src[keep], batch.dst[keep], batch.length[keep])
    _check_disjoint(dst, length, "copy batch destination")
    if src_buf.untyped_storage().data_ptr() == dst_buf.untyped_storage().data_ptr():
        # Reading one byte twice is fine (one state into two images); reading
        # a byte another span of the batch writes is a race.
        shift = src_buf.storage_offset() - dst_buf.storage_offset()
        _check_reads_miss_writes(src + shift, dst, length)
    return src, dst, length


def checked_grids(grids: Sequence[Grid], src_buf: torch.Tensor, dst_buf: torch.Tensor) -> int:
    """The bytes ``grids`` move, once the rule every batch passes holds for their
    rows: every row inside its buffer, no two destination rows overlapping, no
    row read that one writes where both buffers share a storage.

    The same rule as :func:`_checked_spans`, for a caller that knows its grids:
    a grid's lowest and highest row are found from its numbers (no
    expansion); for the overlap checks the destination rows (the sources too
    where one storage holds both) are joined where they abut (:func:`_ranges`)
    and sorted, on Python ints where they are a few ranges, else with numpy."""
    check_byte_buffer(src_buf, "copy source buffer")
    check_byte_buffer(dst_buf, "copy destination buffer")
    if src_buf.device != dst_buf.device:
        raise InvalidValueError(
            f"copy buffers live on {src_buf.device} and {dst_buf.device}; one device"
        )
    sizes = (src_buf.numel(), dst_buf.numel())
    live, nbytes = [], 0
    for grid in grids:
        s0, d0, count, n, ss, ds, outer, os_, od = grid
        try:
            negative = min(map(operator.index, grid)) < 0  # C-level: a float or a str raises
        except TypeError:
            negative = True
        if negative:
            raise CopyBoundsError(
                f"copy grid {grid}: offsets, counts, lengths and steps are non-negative "
                "integers (no strided view steps backward)"
            )
        if not (count and outer):
            continue  # no rows (empty rows are checked in bounds, as a batch's are)
        for name, first, step, ostep, size in (
            ("source", s0, ss, os_, sizes[0]),
            ("destination", d0, ds, od, sizes[1]),
        ):
            end = first + (outer - 1) * ostep + (count - 1) * step + n
            if end > size:
                raise CopyBoundsError(
                    f"copy grid {grid}: its {name} rows reach byte {end} but the {name} "
                    f"buffer holds [0, {size})"
                )
        if n:
            live.append(grid)
            nbytes += count * n * outer
    if not live:
        return 0
    same = src_buf.untyped_storage().data_ptr() == dst_buf.untyped_storage().data_ptr()
    shift = int(src_buf.storage_offset()) - int(dst_buf.storage_offset())
    if sum(r[1] * r[4] for r in (_ranges(g, 1) for g in live)) <= RANGES_IN_PYTHON:
        dst_ranges = sorted(_expand(live, 1))
        _check_ranges_disjoint(dst_ranges)
        if same:
            _check_ranges_miss(((s + shift, n) for s, n in _expand(live, 0)), dst_ranges)
        return nbytes
    dst, src, length = _rows(live, 1), _rows(live, 0) if same else None, _row_lengths(live)
    order = np.argsort(dst, kind="stable")
    dst, length = dst[order], length[order]
    _check_disjoint(dst, length, "copy grid destination")
    if src is not None:
        _check_reads_miss_writes(src[order] + shift, dst, length)
    return nbytes


RANGES_IN_PYTHON = 128
"""Byte ranges up to which a grid set's overlap checks run on Python ints.
A load's grids are a few dozen ranges once the rows that abut are joined
(28 blocks x 12 layers of ``LBHNC`` are 12 ranges, its state 36 more);
checked with numpy they cost ~200 µs right after the 54 MB copy before them
left the caches cold, on Python ints ~50 µs. Warm, numpy's fixed cost
(~16 µs) wins past ~64 ranges, and at 1,024 it is 23 µs against 209: the
bound sits where a cold check still gains (2-core development machine)."""


Ranges = tuple[int, int, int, int, int, int]
"""``(first, count, length, step, outer, outer_step)``: ``outer`` families of
``count`` ranges of ``length`` bytes, a family's ranges ``step`` apart, the
families ``outer_step`` apart."""


def _ranges(grid: Grid, side: int) -> Ranges:
    """One side of a grid's rows as ranges covering exactly their bytes, rows
    that abut joined: a family whose rows follow each other is one range; where
    the families follow each other by a row, each row's place across them is."""
    first, count, n = grid[side], grid[2], grid[3]
    step, outer, ostep = grid[4 + side], grid[6], grid[7 + side]
    if count == 1:
        step = n
    if outer == 1:
        ostep = count * step
    if step == n:  # each family one range
        if ostep == count * n:
            return (first, 1, count * n * outer, 0, 1, 0)
        return (first, 1, count * n, 0, outer, ostep)
    if ostep == n:  # each row's place across the families one range
        return (first, count, outer * n, step, 1, 0)
    return (first, count, n, step, outer, ostep)


def _expand(grids: Sequence[Grid], side: int) -> list[tuple[int, int]]:
    """Every range of one side of ``grids`` as ``(start, length)``."""
    out = []
    for grid in grids:
        first, count, n, step, outer, ostep = _ranges(grid, side)
        out += [(first + k * ostep + i * step, n) for k in range(outer) for i in range(count)]
    return out


def _check_ranges_disjoint(ranges: list[tuple[int, int]]) -> None:
    """:func:`_check_disjoint` for sorted ranges on Python ints."""
    end, last = -1, (0, 0)
    for start, n in ranges:
        if start < end:
            raise CopyBoundsError(
                f"copy grid destination: spans [{last[0]}, {end}) and "
                f"[{start}, {start + n}) overlap"
            )
        end, last = start + n, (start, n)


def _check_ranges_miss(reads: Iterable[tuple[int, int]], writes: list[tuple[int, int]]) -> None:
    """:func:`_check_reads_miss_writes` for ranges on Python ints (``writes``
    sorted and disjoint, so their ends ascend too)."""
    starts = [s for s, _ in writes]
    for start, n in reads:
        j = bisect.bisect_left(starts, start + n) - 1
        if j >= 0 and writes[j][0] + writes[j][1] > start:
            raise CopyBoundsError(
                f"copy batch reads [{start}, {start + n}) where it also writes "
                f"[{writes[j][0]}, {writes[j][0] + writes[j][1]}) (source and destination "
                "share one storage)"
            )


def _rows(grids: Sequence[Grid], side: int) -> np.ndarray:
    """Every row's start on one side (0: source, 1: destination), grid by grid."""
    out = []
    for grid in grids:
        first, count, step = grid[side], grid[2], grid[4 + side]
        outer, ostep = grid[6], grid[7 + side]
        inner = (
            np.arange(first, first + count * step, step, dtype=np.int64)
            if step
            else np.full(count, first, dtype=np.int64)
        )
        if outer > 1:
            starts = np.arange(0, outer * ostep, ostep) if ostep else np.zeros(outer, np.int64)
            inner = np.add.outer(starts, inner).ravel()
        out.append(inner)
    return out[0] if len(out) == 1 else np.concatenate(out)


def _row_lengths(grids: Sequence[Grid]) -> np.ndarray:
    return np.repeat(
        np.array([g[3] for g in grids], dtype=np.int64),
        [g[2] * g[6] for g in grids],
    )
