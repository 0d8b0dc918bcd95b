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
from typing import Any, Protocol

import numpy as np
import torch

from .checks import check_bytes, check_count, check_ids, int_lists
from .copy import CopyStats, SegmentedCopyPlan, describe_batch, execute_batch, plan_segmented_copy
from .errors import InvalidValueError, LayoutMismatchError
from .layout import EntryField, EntryMajorArena, checkpoint_ranges_for, layout_fingerprint
from .layout.fields import check_fields
from .layout.regions import check_byte_buffer


class CheckpointMismatchError(InvalidValueError):
    """A checkpoint batch names bad units or slots, or pairs them wrongly."""


class UnitHolder(Protocol):
    """Who says which units hold bytes now (a cache's block allocator)."""

    def check_held(self, blocks: Any, what: str, *, writing: bool) -> np.ndarray: ...


class SlotHolder(Protocol):
    """Who says which slots a request holds now (a cache's state allocator)."""

    def check_held(self, slots: Any, what: str) -> np.ndarray: ...


@dataclass(frozen=True, kw_only=True, eq=False)
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
        unit_bytes = check_bytes(unit_bytes, "CheckpointSpec: unit_bytes", lo=1)
        fields = tuple(check_fields(fields, "CheckpointSpec"))
        ranges = tuple(checkpoint_ranges_for(fields))
        image = sum(n for _, n in ranges)
        units = -(-image // unit_bytes)
        return cls(
            fields=fields,
            unit_bytes=unit_bytes,
            ranges=ranges,
            image_bytes=image,
            units_per_image=units,
            fingerprint=layout_fingerprint(fields),
            plan=plan_segmented_copy([n for _, n in ranges], [unit_bytes] * units, image),
        )


@dataclass(frozen=True, kw_only=True)
class PageUnits:
    """A page pool seen as units: unit ``u`` is bytes ``[u*stride, u*stride + unit_bytes)``.

    ``holder`` (a cache's block allocator, from
    :meth:`~kvarena.pools.UnifiedCache.page_units`) says which units hold
    bytes at the moment of each copy: a store writes only units held live, a
    restore reads only units that are live or evictable. Without a holder
    every unit id below ``num_units`` is usable (a raw buffer the caller owns).
    """

    buf: torch.Tensor
    unit_bytes: int
    unit_stride: int
    num_units: int
    holder: UnitHolder | None = None

    def __post_init__(self) -> None:
        check_byte_buffer(self.buf, "PageUnits: buf")
        check_bytes(self.unit_bytes, "PageUnits: unit_bytes", lo=1)
        check_bytes(self.unit_stride, "PageUnits: unit_stride", lo=1)
        check_count(self.num_units, "PageUnits: num_units")
        if self.unit_stride < self.unit_bytes:
            raise InvalidValueError(
                f"PageUnits: unit_stride {self.unit_stride} is below unit_bytes {self.unit_bytes}"
            )
        need = (self.num_units - 1) * self.unit_stride + self.unit_bytes if self.num_units else 0
        if self.buf.numel() < need:
            raise InvalidValueError(
                f"PageUnits: buffer holds {self.buf.numel()} bytes; {need} needed"
            )

    def check_units(self, units: Any, what: str, *, writing: bool) -> np.ndarray:
        if self.holder is not None:
            ids = self.holder.check_held(units, what, writing=writing)
        else:
            ids = check_ids(units, what, lo=0, hi=self.num_units)
        bad = ids[ids >= self.num_units]
        if bad.size:
            raise CheckpointMismatchError(
                f"{what}: unit id {int(bad[0])} is out of range; legal: 0..{self.num_units - 1}"
            )
        return ids


def _check_slots(state: EntryMajorArena, slots: Any, holder: SlotHolder | None) -> np.ndarray:
    if holder is not None:
        return holder.check_held(slots, "slots")
    if state.live_entries == 0 and state.entries:
        raise CheckpointMismatchError(
            "the state arena has no live entries of its own (a UnifiedCache's state arena: "
            "use cache.store / cache.restore, whose liveness follows the allocators)"
        )
    first_live = state.entries - state.live_entries
    return check_ids(
        slots, "slots (live entries of the state arena)", lo=first_live, hi=state.entries
    )


def _check_batch(
    spec: CheckpointSpec,
    state: EntryMajorArena,
    slots: Sequence[int],
    pages: PageUnits,
    unit_lists: Sequence[Sequence[int]],
    *,
    writing_units: bool,
    slot_holder: SlotHolder | None,
) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(spec, CheckpointSpec):
        raise InvalidValueError(f"spec must be a CheckpointSpec, got {type(spec).__name__}")
    if not isinstance(state, EntryMajorArena):
        raise InvalidValueError(f"state must be an EntryMajorArena, got {type(state).__name__}")
    if not isinstance(pages, PageUnits):
        raise InvalidValueError(f"pages must be PageUnits, got {type(pages).__name__}")
    got = state.fingerprint
    if got != spec.fingerprint:
        raise LayoutMismatchError(
            f"layout fingerprint of the state {got[:16]}... differs from the image's "
            f"{spec.fingerprint[:16]}...; refusing to copy between different layouts"
        )
    if pages.unit_bytes != spec.unit_bytes:
        raise CheckpointMismatchError(
            f"page units hold {pages.unit_bytes} bytes but the spec was planned for {spec.unit_bytes}"
        )
    slot_arr = _check_slots(state, slots, slot_holder)
    if isinstance(unit_lists, (str, bytes)) or not isinstance(unit_lists, Sequence):
        raise CheckpointMismatchError(
            f"unit_lists must be a list of unit lists, got {unit_lists!r}"
        )
    if len(unit_lists) != slot_arr.size:
        raise CheckpointMismatchError(
            f"{slot_arr.size} slots but {len(unit_lists)} unit lists; one list per slot"
        )
    whole = _all_units(unit_lists, spec.units_per_image)
    if whole is not None:
        # One check of every unit at once; a refusal is checked again list by
        # list below, so the message names the list that holds the bad unit.
        try:
            ids = pages.check_units(whole, "unit_lists", writing=writing_units)
        except InvalidValueError:
            pass
        else:
            return slot_arr, ids.reshape(len(unit_lists), spec.units_per_image)
    rows = []
    for c, units in enumerate(unit_lists):
        ids = pages.check_units(units, f"unit_lists[{c}]", writing=writing_units)
        if ids.size != spec.units_per_image:
            raise CheckpointMismatchError(
                f"unit list {c} has {ids.size} units; an image takes {spec.units_per_image}"
            )
        rows.append(ids)
    unit_arr = np.stack(rows) if rows else np.zeros((0, spec.units_per_image), dtype=np.int64)
    return slot_arr, unit_arr


def _all_units(unit_lists: Sequence[Sequence[int]], per_image: int) -> np.ndarray | None:
    """Every unit of ``unit_lists`` in one flat array when each is a list or
    tuple of ``per_image`` plain ints (what allocators hand out), else None."""
    if not all(isinstance(u, (list, tuple)) and len(u) == per_image for u in unit_lists):
        return None
    return int_lists(unit_lists)


def _bases(
    spec: CheckpointSpec,
    state: EntryMajorArena,
    slots: np.ndarray,
    pages: PageUnits,
    units: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
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
    *,
    slot_holder: SlotHolder | None = None,
) -> CopyStats:
    """Copy the checkpoint image of each ``slots[c]`` into the units ``unit_lists[c]``.

    Checks the fingerprint, unit counts, unit ids and slot liveness before any
    byte moves (liveness from ``slot_holder`` and the units' holder when
    given); the whole batch is one described batch and one execution.
    """
    slot_arr, unit_arr = _check_batch(
        spec, state, slots, pages, unit_lists, writing_units=True, slot_holder=slot_holder
    )
    slot_bases, unit_bases = _bases(spec, state, slot_arr, pages, unit_arr)
    batch = describe_batch(spec.plan, slot_bases, unit_bases)
    return execute_batch(batch, state.buf, pages.buf)


def restore(
    spec: CheckpointSpec,
    state: EntryMajorArena,
    slots: Sequence[int],
    pages: PageUnits,
    unit_lists: Sequence[Sequence[int]],
    *,
    slot_holder: SlotHolder | None = None,
) -> CopyStats:
    """Copy each image in ``unit_lists[c]`` back into ``slots[c]`` (the arguments in
    :func:`store`'s order: the state side, then the units).

    Only the checkpoint ranges are written: fields with ``in_checkpoint=False``
    keep whatever the slot holds.
    """
    slot_arr, unit_arr = _check_batch(
        spec, state, slots, pages, unit_lists, writing_units=False, slot_holder=slot_holder
    )
    slot_bases, unit_bases = _bases(spec, state, slot_arr, pages, unit_arr)
    batch = describe_batch(spec.plan.reversed(), unit_bases, slot_bases)
    return execute_batch(batch, pages.buf, state.buf)
