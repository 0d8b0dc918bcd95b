"""Segmented copies planned from sizes alone.

A checkpoint image is a stream of byte ranges of a state slot; its storage is a
stream of PAGE units. Copying one into the other is the intersection of two
ordered byte streams: a list of spans, each inside one source segment and one
destination segment. That list depends only on the sizes, so it is computed
once per geometry, as numpy arrays; addresses enter only when a batch of
copies is described (:func:`describe_batch`), and the same plan serves both
directions (:meth:`SegmentedCopyPlan.reversed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..checks import MAX_BYTES, check_bytes, integer_array
from ..errors import InvalidValueError


def _sizes_array(sizes: Sequence[int], what: str) -> np.ndarray:
    values = [
        check_bytes(s, f"plan_segmented_copy: {what}[{i}]", lo=1) for i, s in enumerate(sizes)
    ]
    return np.asarray(values, dtype=np.int64)


@dataclass(frozen=True, kw_only=True, eq=False)
class SegmentedCopyPlan:
    """Spans ``(src segment, src offset, dst segment, dst offset, length)`` in order.

    The spans cover bytes ``[0, total_bytes)`` of both streams exactly once,
    in stream order, and never cross a segment boundary on either side.
    """

    src_sizes: tuple[int, ...]
    dst_sizes: tuple[int, ...]
    total_bytes: int
    src_segment: np.ndarray
    src_offset: np.ndarray
    dst_segment: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    @property
    def num_spans(self) -> int:
        return int(self.length.shape[0])

    def reversed(self) -> SegmentedCopyPlan:
        """The same spans with source and destination swapped (restore <-> store)."""
        return SegmentedCopyPlan(
            src_sizes=self.dst_sizes,
            dst_sizes=self.src_sizes,
            total_bytes=self.total_bytes,
            src_segment=self.dst_segment,
            src_offset=self.dst_offset,
            dst_segment=self.src_segment,
            dst_offset=self.src_offset,
            length=self.length,
        )


def _locate(
    cum: np.ndarray, sizes: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    segment = np.searchsorted(cum, starts, side="right")
    return segment, starts - (cum[segment] - sizes[segment])


def plan_segmented_copy(
    src_sizes: Sequence[int], dst_sizes: Sequence[int], total_bytes: int
) -> SegmentedCopyPlan:
    """Intersect two ordered byte streams over their first ``total_bytes`` bytes.

    Refuses a negative total, an empty (zero-byte) segment, and a stream
    shorter than the total; a total of 0 is an empty plan.
    """
    total_bytes = check_bytes(total_bytes, "plan_segmented_copy: total_bytes")
    src = _sizes_array(src_sizes, "src_sizes")
    dst = _sizes_array(dst_sizes, "dst_sizes")
    for name, sizes in (("source", src), ("destination", dst)):
        if int(sizes.sum()) < total_bytes:
            raise InvalidValueError(
                f"plan_segmented_copy: the {name} stream holds {int(sizes.sum())} bytes "
                f"but {total_bytes} are to be copied"
            )
    src_cum, dst_cum = np.cumsum(src), np.cumsum(dst)
    cuts = np.union1d(src_cum[src_cum < total_bytes], dst_cum[dst_cum < total_bytes])
    if total_bytes == 0:
        starts = np.zeros(0, dtype=np.int64)
        ends = starts
    else:
        starts = np.concatenate(([0], cuts)).astype(np.int64)
        ends = np.concatenate((cuts, [total_bytes])).astype(np.int64)
    src_seg, src_off = _locate(src_cum, src, starts)
    dst_seg, dst_off = _locate(dst_cum, dst, starts)
    return SegmentedCopyPlan(
        src_sizes=tuple(int(s) for s in src),
        dst_sizes=tuple(int(s) for s in dst),
        total_bytes=int(total_bytes),
        src_segment=src_seg.astype(np.int64),
        src_offset=src_off.astype(np.int64),
        dst_segment=dst_seg.astype(np.int64),
        dst_offset=dst_off.astype(np.int64),
        length=(ends - starts).astype(np.int64),
    )


@dataclass(frozen=True, eq=False)
class CopyBatch:
    """Rows ``(src, dst, length)``: byte offsets into a source and a destination buffer."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __post_init__(self) -> None:
        for name in ("src", "dst", "length"):
            arr = integer_array(getattr(self, name), f"CopyBatch {name}")
            if arr.ndim != 1:
                raise InvalidValueError(
                    f"CopyBatch {name} must be a 1-D array of integers, got shape {list(arr.shape)}"
                )
            object.__setattr__(self, name, arr)

    @property
    def num_spans(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


def _bases(bases: object, segments: int, what: str) -> np.ndarray:
    arr = integer_array(bases, f"describe_batch: {what} (byte offsets)")
    if arr.ndim != 2 or arr.shape[1] != segments:
        raise InvalidValueError(
            f"describe_batch: {what} must have shape [copies, {segments}] (one base per "
            f"segment of the plan), got {list(arr.shape)}"
        )
    if arr.size and arr.min() < 0:
        raise InvalidValueError(f"describe_batch: {what} holds a negative offset {int(arr.min())}")
    if arr.size and arr.max() > MAX_BYTES:
        raise InvalidValueError(
            f"describe_batch: {what} holds an offset {int(arr.max())} above {MAX_BYTES}"
        )
    return arr


def describe_batch(plan: SegmentedCopyPlan, src_bases: object, dst_bases: object) -> CopyBatch:
    """Expand a plan over many copies in one vectorized pass.

    ``src_bases[c, s]`` is where copy ``c``'s source segment ``s`` starts (a byte
    offset into the source buffer); likewise ``dst_bases``. Both sides must
    describe the same number of copies: a mismatch is refused, never
    broadcast onto the wrong request.
    """
    src = _bases(src_bases, len(plan.src_sizes), "src_bases")
    dst = _bases(dst_bases, len(plan.dst_sizes), "dst_bases")
    if src.shape[0] != dst.shape[0]:
        raise InvalidValueError(
            f"describe_batch: {src.shape[0]} source copies but {dst.shape[0]} destination "
            "copies; each copy needs both sides"
        )
    copies = src.shape[0]
    return CopyBatch(
        (src[:, plan.src_segment] + plan.src_offset).reshape(-1),
        (dst[:, plan.dst_segment] + plan.dst_offset).reshape(-1),
        np.tile(plan.length, copies),
    )
