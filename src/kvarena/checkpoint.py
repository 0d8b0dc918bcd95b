"""Checkpoint images of request states, stored in PAGE units.

A checkpoint image is the bytes of one request state that a resuming request
needs: the entry's :func:`~kvarena.layout.checkpoint_ranges_for` ranges, back
to back. It is stored in ``ceil(image_bytes / unit_bytes)`` whole PAGE units,
which may lie anywhere in the page pool, and restored later into another
request's slot. Both directions are one :class:`~kvarena.copy.SegmentedCopyPlan`
(ranges vs units), planned once per (layout, unit size) and expanded over a
whole batch of requests in one vectorized pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .copy import CopyStats, SegmentedCopyPlan, describe_batch, execute_batch, plan_segmented_copy
from .layout import EntryField, EntryMajorArena, checkpoint_ranges_for, layout_fingerprint
from .layout.regions import check_byte_buffer


class CheckpointMismatchError(ValueError):
    """An image and a state disagree on layout, or a batch names bad units or slots."""


@dataclass(frozen=True, eq=False)
class CheckpointSpec:
    """Everything about a layout's images that does not depend on addresses."""

    fields: tuple[EntryField, ...]
    unit_bytes: int
    ranges: tuple[tuple[int, int], ...]
    image_bytes: int
    units_per_image: int
    fingerprint: str
    plan: SegmentedCopyPlan

    @classmethod
    def build(cls, fields: Sequence[EntryField], unit_bytes: int) -> CheckpointSpec:
        if isinstance(unit_bytes, bool) or not isinstance(unit_bytes, int) or unit_bytes <= 0:
            raise ValueError(
                f"CheckpointSpec: unit_bytes must be a positive int, got {unit_bytes!r}"
            )
        fields = tuple(fields)
        ranges = tuple(checkpoint_ranges_for(fields))
        image = sum(n for _, n in ranges)
        units = -(-image // unit_bytes)
        plan = plan_segmented_copy([n for _, n in ranges], [unit_bytes] * units, image)
        return cls(fields, unit_bytes, ranges, image, units, layout_fingerprint(fields), plan)


@dataclass(frozen=True)
class PageUnits:
    """A page pool seen as units: unit ``u`` is bytes ``[u*stride, u*stride + unit_bytes)``."""

    buf: torch.Tensor
    unit_bytes: int
    unit_stride: int
    num_units: int

    def __post_init__(self) -> None:
        check_byte_buffer(self.buf, "PageUnits: buf")
        if self.unit_stride < self.unit_bytes:
            raise ValueError(
                f"PageUnits: unit_stride {self.unit_stride} is below unit_bytes {self.unit_bytes}"
            )
        need = (self.num_units - 1) * self.unit_stride + self.unit_bytes if self.num_units else 0
        if self.buf.numel() < need:
            raise ValueError(f"PageUnits: buffer holds {self.buf.numel()} bytes; {need} needed")


def _check_batch(
    spec: CheckpointSpec,
    state: EntryMajorArena,
    slots: Sequence[int],
    pages: PageUnits,
    unit_lists: Sequence[Sequence[int]],
) -> tuple[np.ndarray, np.ndarray]:
    got = state.fingerprint
    if got != spec.fingerprint:
        raise CheckpointMismatchError(
            f"layout fingerprint of the state {got[:16]}... differs from the image's "
            f"{spec.fingerprint[:16]}...; refusing to copy between different layouts"
        )
    if pages.unit_bytes != spec.unit_bytes:
        raise CheckpointMismatchError(
            f"page units hold {pages.unit_bytes} bytes but the spec was planned for {spec.unit_bytes}"
        )
    slot_arr = np.asarray(list(slots), dtype=np.int64).reshape(-1)
    if len(unit_lists) != slot_arr.size:
        raise CheckpointMismatchError(
            f"{slot_arr.size} slots but {len(unit_lists)} unit lists; one list per slot"
        )
    first_live = state.entries - state.live_entries
    bad = slot_arr[(slot_arr < first_live) | (slot_arr >= state.entries)]
    if bad.size:
        raise CheckpointMismatchError(
            f"slot {int(bad[0])} is not live; live slots are {first_live}..{state.entries - 1}"
        )
    for c, units in enumerate(unit_lists):
        if len(units) != spec.units_per_image:
            raise CheckpointMismatchError(
                f"unit list {c} has {len(units)} units; an image takes {spec.units_per_image}"
            )
    unit_arr = np.asarray([list(u) for u in unit_lists], dtype=np.int64).reshape(
        slot_arr.size, spec.units_per_image
    )
    out = unit_arr[(unit_arr < 0) | (unit_arr >= pages.num_units)]
    if out.size:
        raise CheckpointMismatchError(
            f"unit id {int(out[0])} is out of range; legal: 0..{pages.num_units - 1}"
        )
    return slot_arr, unit_arr


def _bases(
    spec: CheckpointSpec,
    state: EntryMajorArena,
    slots: np.ndarray,
    pages: PageUnits,
    units: np.ndarray,
):
    offsets = np.asarray([o for o, _ in spec.ranges], dtype=np.int64)
    slot_bases = slots[:, None] * state.slot_stride + offsets[None, :]
    unit_bases = units * pages.unit_stride
    return slot_bases, unit_bases


def store(
    spec: CheckpointSpec,
    state: EntryMajorArena,
    slots: Sequence[int],
    pages: PageUnits,
    unit_lists: Sequence[Sequence[int]],
) -> CopyStats:
    """Copy the checkpoint image of each ``slots[c]`` into the units ``unit_lists[c]``.

    Checks the fingerprint, unit counts, unit ids and slot liveness before any
    byte moves; the whole batch is one described batch and one execution.
    """
    slot_arr, unit_arr = _check_batch(spec, state, slots, pages, unit_lists)
    slot_bases, unit_bases = _bases(spec, state, slot_arr, pages, unit_arr)
    batch = describe_batch(spec.plan, slot_bases, unit_bases)
    return execute_batch(batch, state.buf, pages.buf)


def restore(
    spec: CheckpointSpec,
    pages: PageUnits,
    unit_lists: Sequence[Sequence[int]],
    state: EntryMajorArena,
    slots: Sequence[int],
) -> CopyStats:
    """Copy each image in ``unit_lists[c]`` back into ``slots[c]``.

    Only the checkpoint ranges are written: fields with ``in_checkpoint=False``
    keep whatever the slot holds.
    """
    slot_arr, unit_arr = _check_batch(spec, state, slots, pages, unit_lists)
    slot_bases, unit_bases = _bases(spec, state, slot_arr, pages, unit_arr)
    batch = describe_batch(spec.plan.reversed(), unit_bases, slot_bases)
    return execute_batch(batch, pages.buf, state.buf)
