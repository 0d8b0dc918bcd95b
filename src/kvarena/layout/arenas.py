"""Arenas: a field list materialized over one byte buffer.

Entry-major arenas keep entry ``i`` as one contiguous slice, so saving, moving
or shipping one request's state is one copy of one range; every field still
gets a ``[layers, entries, *shape]`` view with ordinary strides, so kernels
take the same tensors they take today. Layer-major arenas keep each layer of
each field contiguous, the shape paged attention kernels assume.

Every byte position here comes from :func:`~kvarena.layout.fields.field_extents`.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch

from ..checks import MAX_ENTRIES, check_bytes, check_count
from ..errors import IndexOutOfRangeError, InvalidValueError, UnknownNameError
from .fields import (
    EntryField,
    check_fields,
    entry_bytes_for,
    field_extents,
    layout_fingerprint,
    min_slot_stride,
    strictest_alignment,
)
from .regions import aligned_zeros, carve, check_byte_buffer


def _device_matches(buf: torch.Tensor, device: torch.device) -> bool:
    if buf.device.type != device.type:
        return False
    return device.index is None or buf.device.index == device.index


def _check_caller_buffer(
    buf: Any, need: int, alignment: int, device: torch.device, what: str
) -> torch.Tensor:
    """A caller's buffer: uint8, 1-D, contiguous, on ``device``, long enough, aligned."""
    check_byte_buffer(buf, what)
    if not _device_matches(buf, device):
        raise InvalidValueError(f"{what} lives on {buf.device} but the arena's device is {device}")
    if buf.numel() < need:
        raise InvalidValueError(
            f"{what} holds {buf.numel()} bytes; this arena needs at least {need}"
        )
    # Relative to the allocation, as the design brief states: a buffer kvarena
    # allocates (aligned_zeros) also starts on an aligned address, so there
    # the offset and the address agree.
    if buf.storage_offset() % alignment:
        raise InvalidValueError(
            f"{what} starts at storage offset {buf.storage_offset()}, which is not a "
            f"multiple of the strictest alignment {alignment}"
        )
    return buf


def _typed_view(
    buf: torch.Tensor,
    field: EntryField,
    field_offset: int,
    layer_stride_bytes: int,
    entry_stride_bytes: int,
    entries: int,
) -> torch.Tensor:
    """``[layers, entries, *shape]`` of ``field.dtype`` over ``buf``.

    The storage offset is absolute: it includes ``buf``'s own storage offset,
    so a view over a carved slice addresses that slice, never the front of the
    allocation it was carved from.
    """
    item = field.itemsize
    shape = field.shape
    inner: list[int] = []
    step = 1
    for dim in reversed(shape):
        inner.append(step)
        step *= dim
    inner.reverse()
    base = buf.storage_offset() + field_offset
    # Every byte offset and stride here is a multiple of 256, hence of itemsize.
    # An empty slice re-typed: as_strided addresses its storage absolutely.
    return torch.as_strided(
        buf[:0].view(field.dtype),
        size=(field.layers, entries, *shape),
        stride=(layer_stride_bytes // item, entry_stride_bytes // item, *inner),
        storage_offset=base // item,
    )


def _unknown(name: str, fields: Sequence[EntryField]) -> KeyError:
    return UnknownNameError(f"no field {name!r}; fields are {[f.name for f in fields]}")


class _Arena(ABC):
    """What every arena shares: a field list over one buffer on one device.

    Subclasses set the attributes in their constructor and define ``view``;
    the accessors, the name lookup and the fills live here once.
    """

    _fields: tuple[EntryField, ...]
    _index: dict[str, int]
    _offsets: tuple[int, ...]
    _entries: int
    _entry_bytes: int
    _total: int
    _buf: torch.Tensor
    _device: torch.device

    def _declare(
        self,
        fields: Sequence[EntryField],
        entries: int,
        device: torch.device | str,
        offsets: Sequence[int],
    ) -> None:
        self._device = torch.device(device)
        self._fields = tuple(fields)
        self._index = {f.name: i for i, f in enumerate(self._fields)}
        self._offsets = tuple(offsets)
        self._entries = entries
        self._entry_bytes = entry_bytes_for(self._fields)

    @property
    def fields(self) -> tuple[EntryField, ...]:
        return self._fields

    @property
    def entries(self) -> int:
        return self._entries

    @property
    def entry_bytes(self) -> int:
        return self._entry_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes the arena spans in its buffer."""
        return self._total

    @property
    def buf(self) -> torch.Tensor:
        return self._buf

    @property
    def device(self) -> torch.device:
        return self._device

    @cached_property
    def fingerprint(self) -> str:
        """:func:`layout_fingerprint` of the fields, computed once (checked on every copy)."""
        return layout_fingerprint(self._fields)

    def _field(self, name: str) -> tuple[EntryField, int]:
        try:
            i = self._index[name]
        except (KeyError, TypeError):  # TypeError: an unhashable "name"
            raise _unknown(name, self._fields) from None
        return self._fields[i], self._offsets[i]

    def field_offset(self, name: str) -> int:
        """Byte offset of field ``name`` (inside an entry, or in the buffer for layer-major)."""
        return self._field(name)[1]

    @abstractmethod
    def view(self, name: str) -> torch.Tensor:
        """``[layers, entries, *shape]`` of the field's dtype; each layout sets the strides."""

    def fill_entries(self, index: int | slice) -> None:
        """Write each field's fill into entries ``index``, for the fields whose fill
        is not the zero bits a zeroed buffer already holds."""
        for field in self._fields:
            if not field.fill_is_zero_bits:
                self.view(field.name)[:, index].fill_(field.fill)


class EntryMajorArena(_Arena):
    """A field list over one buffer, entry ``i`` one contiguous slice.

    Entries are ``slot_stride`` bytes apart; when the arena sits at the front
    of larger slots in a shared buffer, the bytes between belong to someone
    else and are never written. ``live_entries`` counts from the END of the
    index range (a pool that grows takes the next index down): indices
    ``[entries - live_entries, entries)`` are this arena's to fill.
    """

    def __init__(
        self,
        fields: Sequence[EntryField],
        entries: int,
        device: torch.device | str,
        buf: torch.Tensor | None = None,
        slot_stride: int | None = None,
        live_entries: int | None = None,
    ) -> None:
        fields = check_fields(fields, "EntryMajorArena")
        entries = check_count(entries, "EntryMajorArena: entries", hi=MAX_ENTRIES)
        self._declare(fields, entries, device, [e.start for e in field_extents(fields)])
        self._alignment = strictest_alignment(fields)
        stride = self._entry_bytes if slot_stride is None else slot_stride
        stride = check_bytes(stride, "EntryMajorArena: slot_stride")
        if stride < self._entry_bytes:
            raise InvalidValueError(
                f"EntryMajorArena: slot_stride {stride} is below the entry size "
                f"{self._entry_bytes}; it must be >= {self._entry_bytes}"
            )
        if stride % self._alignment:
            raise InvalidValueError(
                f"EntryMajorArena: slot_stride {stride} is not a multiple of the strictest "
                f"alignment {self._alignment} (the smallest legal stride here is "
                f"{min_slot_stride(fields)})"
            )
        self._stride = stride
        live = entries if live_entries is None else live_entries
        live = check_count(live, "EntryMajorArena: live_entries", hi=entries)
        self._live = live
        total = (entries - 1) * stride + self._entry_bytes if entries else 0
        self._total = check_bytes(total, "EntryMajorArena: total bytes (entries x slot_stride)")
        if buf is None:
            # Zeroed, so that padding copied along with a whole entry never
            # carries stale bytes from a previous tenant; its first byte lies on an
            # address aligned to the strictest field alignment.
            self._buf = aligned_zeros(self._total, self._alignment, self._device)
        else:
            self._buf = _check_caller_buffer(
                buf, self._total, self._alignment, self._device, "EntryMajorArena: buf"
            )
        self.fill_entries(slice(entries - live, entries))

    @property
    def slot_stride(self) -> int:
        return self._stride

    @property
    def live_entries(self) -> int:
        return self._live

    def view(self, name: str) -> torch.Tensor:
        """``[layers, entries, *shape]``: layer stride ``per_layer_numel``,
        entry stride ``slot_stride / itemsize``, inner dims contiguous."""
        field, offset = self._field(name)
        return _typed_view(
            self._buf, field, offset, field.bytes_per_layer, self._stride, self._entries
        )

    def entry(self, i: int) -> torch.Tensor:
        """Entry ``i``'s bytes as one 1-D uint8 slice of ``entry_bytes``."""
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise IndexOutOfRangeError(f"entry index must be an int, got {i!r}")
        i = int(i)
        if not 0 <= i < self._entries:
            raise IndexOutOfRangeError(
                f"entry index {i} out of range; legal: 0..{self._entries - 1}"
            )
        start = i * self._stride
        return self._buf[start : start + self._entry_bytes]

    def __repr__(self) -> str:
        return (
            f"EntryMajorArena(fields={[f.name for f in self._fields]}, entries={self._entries}, "
            f"entry_bytes={self._entry_bytes}, slot_stride={self._stride}, "
            f"live_entries={self._live}, device={self._device})"
        )


class LayerMajorArena(_Arena):
    """A field list laid out ``[layers, entries, *shape]`` per field, each
    layer contiguous: the shape paged attention kernels assume.

    Field ``f``'s region starts at its walk offset times ``entries``. Over a
    caller's buffer the arena never writes, so a non-zero fill is refused
    there: the buffer may already hold a peer's KV, and a ``-inf`` score plane
    silently left at 0.0 would turn "never selected" into "always".
    """

    def __init__(
        self,
        fields: Sequence[EntryField],
        entries: int,
        device: torch.device | str,
        buf: torch.Tensor | None = None,
    ) -> None:
        fields = check_fields(fields, "LayerMajorArena")
        if not fields:
            raise InvalidValueError(
                "LayerMajorArena: no fields given; pass at least one EntryField"
            )
        entries = check_count(entries, "LayerMajorArena: entries", hi=MAX_ENTRIES)
        self._declare(fields, entries, device, [e.start * entries for e in field_extents(fields)])
        self._total = check_bytes(
            self._entry_bytes * entries, "LayerMajorArena: total bytes (entries x entry bytes)"
        )
        if buf is None:
            self._buf = aligned_zeros(self._total, strictest_alignment(fields), self._device)
            self.fill_entries(slice(None))
        else:
            filled = [f.name for f in self._fields if not f.fill_is_zero_bits]
            if filled:
                raise InvalidValueError(
                    f"LayerMajorArena: fields {filled} declare a non-zero fill, which a "
                    "caller's buffer is never written with; allocate the arena (buf=None) "
                    "or declare fill=0.0"
                )
            self._buf = _check_caller_buffer(
                buf, self._total, strictest_alignment(fields), self._device, "LayerMajorArena: buf"
            )

    def view(self, name: str) -> torch.Tensor:
        """``[layers, entries, *shape]``: layer stride ``entries * per_layer_numel``,
        entry stride ``per_layer_numel``."""
        field, offset = self._field(name)
        return _typed_view(
            self._buf,
            field,
            offset,
            field.bytes_per_layer * self._entries,
            field.bytes_per_layer,
            self._entries,
        )

    def __repr__(self) -> str:
        return (
            f"LayerMajorArena(fields={[f.name for f in self._fields]}, entries={self._entries}, "
            f"total_bytes={self._total}, device={self._device})"
        )


def carve_layer_major(
    groups: Sequence[Sequence[EntryField]],
    entries: int,
    device: torch.device | str,
    buf: torch.Tensor | None = None,
) -> list[LayerMajorArena | None]:
    """One layer-major arena per field group, regions placed by ``plan_regions``.

    An empty group gets ``None``. With ``buf=None`` each arena owns its memory.
    """
    entries = check_count(entries, "carve_layer_major: entries", hi=MAX_ENTRIES)
    groups = [list(g) for g in groups]
    sizes = [entry_bytes_for(g) * entries for g in groups]
    slices = carve(buf, sizes)
    return [
        LayerMajorArena(g, entries, device, buf=s) if g else None
        for g, s in zip(groups, slices, strict=False)
    ]
