"""Byte regions packed back to back, and carving a buffer at those offsets.

Every offset kvarena hands out is a multiple of :data:`ALIGNMENT` (256 bytes):
the torch caching allocator's granularity, and a multiple of every element
size, so any region can be re-viewed as any dtype without a misaligned start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

ALIGNMENT: int = 256
"""The alignment, in bytes, of every region and field start kvarena plans."""


def _check_count(value: Any, what: str) -> int:
    """Return ``value`` as an int if it is a non-negative integer, else refuse."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


def align_up(n: int, to: int = ALIGNMENT) -> int:
    """Round ``n`` up to the next multiple of ``to``.

    ``n`` must be a non-negative int and ``to`` a positive int.
    """
    _check_count(n, "align_up: n")
    if isinstance(to, bool) or not isinstance(to, int) or to <= 0:
        raise ValueError(f"align_up: 'to' must be a positive int, got {to!r}")
    return -(-n // to) * to


def plan_regions(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Place regions of ``sizes`` bytes back to back.

    Each offset is the running end rounded up to :data:`ALIGNMENT`; the total
    is the last end rounded up too. Because the total is aligned, planning two
    lists separately and shifting the second by the first's total equals
    planning their concatenation, so pools can be planned piecewise.
    """
    offsets: list[int] = []
    end = 0
    for i, size in enumerate(sizes):
        _check_count(size, f"plan_regions: sizes[{i}]")
        start = align_up(end)
        offsets.append(start)
        end = start + size
    return offsets, align_up(end)


def carve(buf: torch.Tensor | None, sizes: Sequence[int]) -> list[torch.Tensor | None]:
    """Slice ``buf`` into one region per size, at :func:`plan_regions` offsets.

    ``buf=None`` yields ``None`` for every region: whoever receives it owns
    (allocates) its own memory. A buffer shorter than the planned total is
    refused, so the last region is never silently short.
    """
    offsets, total = plan_regions(sizes)
    if buf is None:
        return [None] * len(offsets)
    check_byte_buffer(buf, "carve: buf")
    if buf.numel() < total:
        raise ValueError(
            f"carve: buffer holds {buf.numel()} bytes but the regions {list(sizes)} "
            f"need {total} bytes (offsets {offsets}); pass a buffer of at least {total} bytes"
        )
    return [buf[off : off + size] for off, size in zip(offsets, sizes, strict=False)]


def check_byte_buffer(buf: Any, what: str) -> torch.Tensor:
    """Refuse anything but a 1-D contiguous uint8 tensor."""
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor of dtype uint8, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise ValueError(f"{what} must have dtype torch.uint8, got {buf.dtype}")
    if buf.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(buf.shape)}")
    if not buf.is_contiguous():
        raise ValueError(f"{what} must be contiguous, got stride {buf.stride()}")
    return buf
