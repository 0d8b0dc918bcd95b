"""A readable account of an entry's layout, for people and for the CLI.

:func:`layout_rows` is the structured form (the CLI renders it as a table or
JSON); :func:`describe` is the plain-text form. Both read the one walk in
:func:`~kvarena.layout.fields.field_extents`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .fields import EntryField, dtype_name, entry_bytes_for, field_extents


@dataclass(frozen=True, kw_only=True)
class LayoutRow:
    """One field as placed: its ``[start, end)`` and the padding before it."""

    name: str
    dtype: str
    layers: int
    shape: tuple[int, ...]
    start: int
    end: int
    pad_before: int
    in_checkpoint: bool
    fill: float

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def layout_rows(fields: Sequence[EntryField]) -> tuple[list[LayoutRow], int, int]:
    """``(rows, tail_padding, entry_bytes)`` for a field list."""
    rows: list[LayoutRow] = []
    previous_end = 0
    for ext in field_extents(fields):
        f = ext.field
        rows.append(
            LayoutRow(
                name=f.name,
                dtype=dtype_name(f.dtype),
                layers=f.layers,
                shape=f.shape,
                start=ext.start,
                end=ext.end,
                pad_before=ext.start - previous_end,
                in_checkpoint=f.in_checkpoint,
                fill=f.fill,
            )
        )
        previous_end = ext.end
    entry_bytes = entry_bytes_for(fields)
    return rows, entry_bytes - previous_end, entry_bytes


def describe(fields: Sequence[EntryField]) -> str:
    """A fixed-width table: each field's offset, bytes, padding, checkpoint flag."""
    rows, tail, entry_bytes = layout_rows(fields)
    header = ("field", "dtype", "layers x shape", "offset", "bytes", "pad before", "ckpt", "fill")
    table = [header]
    for r in rows:
        table.append(
            (
                r.name,
                r.dtype,
                f"{r.layers} x {list(r.shape)}",
                str(r.start),
                str(r.nbytes),
                str(r.pad_before),
                "yes" if r.in_checkpoint else "no",
                repr(r.fill),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip()
        for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    payload = sum(r.nbytes for r in rows)
    lines.append(
        f"entry: {entry_bytes} bytes ({payload} field bytes, "
        f"{entry_bytes - payload} padding, {tail} of it at the tail)"
    )
    return "\n".join(lines)
