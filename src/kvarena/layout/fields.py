"""Field declarations and the one walk that places them inside an entry.

An entry is the unit of an index space: one block of paged KV, or one request's
state. Its bytes are the declared fields in order, each field layer-major
(layer 0's shape, then layer 1's ...), each field starting on
``max(ALIGNMENT, field.align)``. That placement is computed in exactly one
place, :func:`field_extents`; the entry size, every arena offset, every
checkpoint range and the layout fingerprint are derived from it, so two numbers
that must agree can never drift apart.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from ..checks import check_bytes, check_count
from ..errors import InvalidValueError
from .regions import ALIGNMENT, align_up

_PLAIN_INT_DTYPES = frozenset(
    {
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    }
)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the stable name used in encodings."""
    return str(dtype).removeprefix("torch.")


@cache
def _dtype_is_storable(dtype: torch.dtype) -> bool:
    """True if a byte buffer can be re-viewed as ``dtype`` (whole-byte elements).

    Sub-byte, bit and quantized dtypes cannot: an arena could not hand out a
    typed view of them, so declaring a field of one is refused up front.
    """
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        pass
    elif dtype not in _PLAIN_INT_DTYPES:
        return False
    try:
        torch.zeros(dtype.itemsize * 2, dtype=torch.uint8).view(dtype)
    except (RuntimeError, TypeError):
        return False
    return True


def _fill_problem(fill: float, dtype: torch.dtype) -> str | None:
    """Why ``fill`` cannot be stored exactly-enough in ``dtype``, or None if it can.

    Integers must be integral and in range (no NaN/inf); floats must be in the
    finite range, and NaN/inf only where the format has them (float8_e4m3fn has
    no inf and would saturate a ``-inf`` score fill to -448).
    """
    if dtype == torch.bool:
        if fill in (0, 1):
            return None
        return "torch.bool holds only 0/1 (False/True)"
    if dtype in _PLAIN_INT_DTYPES:
        if not math.isfinite(float(fill)):
            return f"{dtype} is an integer dtype and has no {fill}"
        if fill != int(fill):
            return f"{dtype} is an integer dtype; the fill must be integral"
        info = torch.iinfo(dtype)
        if not info.min <= int(fill) <= info.max:
            return f"{dtype} holds integers in [{info.min}, {info.max}]"
        return None
    # Floating point (and complex, filled on the real part).
    try:
        back = torch.tensor([float(fill)], dtype=torch.float64).to(dtype)
        back = back.real if back.is_complex() else back
        back_value = back.to(torch.float64).item()
    except (RuntimeError, TypeError):
        # Packed formats (e.g. float4_e2m1fn_x2) cannot be converted; only the
        # all-zero bit pattern, which the zeroed buffer already holds, is safe.
        if float(fill) == 0.0 and math.copysign(1.0, float(fill)) > 0:
            return None
        return f"{dtype} is a packed format; only a fill of 0.0 can be stored"
    value = float(fill)
    if math.isnan(value):
        return None if math.isnan(back_value) else f"{dtype} has no NaN"
    if math.isinf(value):
        return (
            None
            if back_value == value
            else f"{dtype} has no {value} (it would become {back_value})"
        )
    finfo = torch.finfo(dtype)
    if abs(value) > finfo.max:
        return f"{dtype} holds finite values in [{-finfo.max}, {finfo.max}]"
    # One-byte floats round coarsely, and float8_e8m0fnu has neither zero nor a
    # sign (0.0 becomes 2**-127, -1.0 becomes 1.0): a fill there must be exact.
    if dtype.itemsize == 1 and back_value != value:
        return f"{dtype} stores {value} as {back_value}; declare a fill it holds exactly"
    return None


@dataclass(frozen=True)
class EntryField:
    """One tensor family inside an entry (k, v, conv_state, score_state ...).

    ``shape`` is what ONE (layer, entry) pair holds; the field's bytes in an
    entry are ``layers * prod(shape) * itemsize``, layer-major. ``fill`` is the
    value a fresh entry starts from (score states start at ``-inf``), ``align``
    an extra start alignment (0, or a multiple of 256) and ``in_checkpoint``
    whether a checkpoint image carries the field.
    """

    name: str
    layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float = 0.0
    align: int = 0
    in_checkpoint: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidValueError(f"EntryField name must be a non-empty str, got {self.name!r}")
        where = f"EntryField {self.name!r}"
        object.__setattr__(self, "layers", check_count(self.layers, f"{where}: layers"))
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise InvalidValueError(
                f"{where}: shape must be a sequence of ints >= 0, got {self.shape!r}"
            ) from None
        shape = tuple(
            check_count(dim, f"{where}: shape {shape} dim {d}") for d, dim in enumerate(shape)
        )
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidValueError(
                f"{where}: dtype must be a torch.dtype (e.g. torch.bfloat16), got {self.dtype!r}"
            )
        if not _dtype_is_storable(self.dtype):
            raise InvalidValueError(
                f"{where}: dtype {self.dtype} has no whole-byte elements; legal: floating, "
                "complex, bool and the 8/16/32/64-bit integer dtypes"
            )
        if isinstance(self.fill, complex) or not isinstance(self.fill, numbers.Real):
            raise InvalidValueError(f"{where}: fill must be a real number, got {self.fill!r}")
        try:
            float(self.fill)
        except OverflowError:
            raise InvalidValueError(
                f"{where}: fill {self.fill} is beyond any float; no dtype holds it"
            ) from None
        problem = _fill_problem(self.fill, self.dtype)
        if problem is not None:
            raise InvalidValueError(f"{where}: fill {self.fill!r} is not representable: {problem}")
        # Normalise so that equal declarations compare (and fingerprint) equal.
        is_integral = self.dtype == torch.bool or self.dtype in _PLAIN_INT_DTYPES
        object.__setattr__(self, "fill", int(self.fill) if is_integral else float(self.fill))
        align = check_bytes(self.align, f"{where}: align")
        if align % ALIGNMENT:
            raise InvalidValueError(
                f"{where}: align must be 0 or a positive multiple of {ALIGNMENT}, got {align}"
            )
        object.__setattr__(self, "align", align)
        if not isinstance(self.in_checkpoint, bool):
            raise InvalidValueError(
                f"{where}: in_checkpoint must be a bool, got {self.in_checkpoint!r}"
            )
        # Absurd sizes are refused here, before any walk adds them up.
        check_bytes(self.bytes_per_entry, f"{where}: bytes per entry (layers x shape x itemsize)")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def per_layer_numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes_per_layer(self) -> int:
        return self.per_layer_numel * self.itemsize

    @property
    def bytes_per_entry(self) -> int:
        return self.layers * self.bytes_per_layer

    @property
    def start_alignment(self) -> int:
        """The alignment this field's start is rounded up to inside an entry."""
        return max(ALIGNMENT, self.align)

    @property
    def fill_is_zero_bits(self) -> bool:
        """True when the fill is all-zero bytes, which a zeroed buffer already holds.

        ``-0.0 == 0.0`` in Python but sets the sign bit, so it is not zero bits.
        """
        return self.fill == 0 and math.copysign(1.0, float(self.fill)) > 0


@dataclass(frozen=True)
class FieldExtent:
    """Where one field's bytes lie inside an entry: ``[start, end)``."""

    field: EntryField
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def check_fields(fields: Sequence[EntryField], what: str) -> list[EntryField]:
    """A field list: every item an :class:`EntryField`, no name twice.

    Names are unique everywhere a list is used (views, offsets, checkpoints and
    fingerprints look fields up by name, and two fields of one name would
    make a lookup ambiguous).
    """
    if isinstance(fields, (str, bytes, EntryField)) or not isinstance(fields, Sequence):
        raise InvalidValueError(f"{what}: fields must be a list of EntryField, got {fields!r}")
    fields = list(fields)
    seen: set[str] = set()
    for i, field in enumerate(fields):
        if not isinstance(field, EntryField):
            raise InvalidValueError(
                f"{what}: fields[{i}] must be an EntryField, got {type(field).__name__}"
            )
        if field.name in seen:
            names = [f.name for f in fields]
            raise InvalidValueError(f"{what}: duplicate field name {field.name!r} in {names}")
        seen.add(field.name)
    return fields


def field_extents(fields: Sequence[EntryField]) -> list[FieldExtent]:
    """The align-place-advance walk: each field's ``[start, end)`` in an entry.

    A field starts at the running offset rounded up to its
    :attr:`EntryField.start_alignment`; the running offset then advances to its
    end. This is the single source of every byte position in kvarena.
    """
    extents: list[FieldExtent] = []
    offset = 0
    for field in check_fields(fields, "field_extents"):
        start = align_up(offset, field.start_alignment)
        offset = start + field.bytes_per_entry
        extents.append(FieldExtent(field, start, offset))
    return extents


def entry_bytes_for(fields: Sequence[EntryField]) -> int:
    """An entry's size: the walk's last end rounded up to 256 (0 for no fields)."""
    extents = field_extents(fields)
    return align_up(extents[-1].end) if extents else 0


def strictest_alignment(fields: Sequence[EntryField]) -> int:
    """max(256, every field's align): what a slot stride and buffer start must honour."""
    return max([ALIGNMENT, *(f.align for f in check_fields(fields, "strictest_alignment"))])


def min_slot_stride(fields: Sequence[EntryField]) -> int:
    """The smallest legal slot stride: the entry size rounded up to the strictest
    alignment, so every field stays aligned in every slot (not only slot 0)."""
    return align_up(entry_bytes_for(fields), strictest_alignment(fields))


def checkpoint_ranges_for(fields: Sequence[EntryField]) -> list[tuple[int, int]]:
    """The ``(offset, nbytes)`` byte ranges of an entry that a checkpoint carries.

    Consecutive carried fields merge into one range (the padding between them
    rides along, so a range is one copy); a field with ``in_checkpoint=False``
    ends the run. Zero-length ranges are dropped.
    """
    ranges: list[tuple[int, int]] = []
    run: tuple[int, int] | None = None
    for ext in field_extents(fields):
        if ext.field.in_checkpoint:
            run = (ext.start, ext.end) if run is None else (run[0], ext.end)
            continue
        if run is not None and run[1] > run[0]:
            ranges.append((run[0], run[1] - run[0]))
        run = None
    if run is not None and run[1] > run[0]:
        ranges.append((run[0], run[1] - run[0]))
    return ranges


def _canonical_fill(field: EntryField) -> str:
    if field.dtype == torch.bool or field.dtype in _PLAIN_INT_DTYPES:
        return f"int:{int(field.fill)}"
    return f"float:{float(field.fill).hex()}"


def layout_encoding(fields: Sequence[EntryField]) -> bytes:
    """The canonical byte encoding that :func:`layout_fingerprint` hashes.

    UTF-8 of ``json.dumps(doc, sort_keys=True, separators=(",", ":"),
    ensure_ascii=True)`` where ``doc`` is::

        {"format": "kvarena-layout/1", "alignment": 256, "entry_bytes": E,
         "fields": [{"name", "layers", "shape": [...], "dtype": "bfloat16",
                     "fill": "int:<decimal>" | "float:<float.hex()>",
                     "align", "in_checkpoint": bool, "start", "end"}, ...]}

    Fills use ``float.hex`` (exact, and ``-0.0``/``-inf``/``nan`` spelled out)
    or a decimal integer, so no float formatting can differ across Pythons.
    """
    doc = {
        "format": "kvarena-layout/1",
        "alignment": ALIGNMENT,
        "entry_bytes": entry_bytes_for(fields),
        "fields": [
            {
                "name": e.field.name,
                "layers": e.field.layers,
                "shape": list(e.field.shape),
                "dtype": dtype_name(e.field.dtype),
                "fill": _canonical_fill(e.field),
                "align": e.field.align,
                "in_checkpoint": e.field.in_checkpoint,
                "start": e.start,
                "end": e.end,
            }
            for e in field_extents(fields)
        ],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def layout_fingerprint(fields: Sequence[EntryField]) -> str:
    """SHA-256 hex digest of :func:`layout_encoding`.

    Two processes that will exchange entries (a transfer, a tier image) compare
    fingerprints first: equal fingerprints mean equal declarations AND equal
    byte positions, so a mismatch is refused before a byte moves.
    """
    return hashlib.sha256(layout_encoding(fields)).hexdigest()
