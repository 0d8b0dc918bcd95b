"""Byte regions packed back to back, and carving a buffer at those offsets.

Every offset kvarena hands out is a multiple of :data:`ALIGNMENT` (256 bytes):
the torch caching allocator's granularity, and a multiple of every element
size, so any region can be re-viewed as any dtype without a misaligned start.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

import torch

from ..checks import check_bytes
from ..errors import InvalidValueError, OutOfMemoryError

ALIGNMENT: int = 256
"""The alignment, in bytes, of every region and field start kvarena plans."""


def align_up(n: int, to: int = ALIGNMENT) -> int:
    """Round ``n`` up to the next multiple of ``to``.

    ``n`` must be a non-negative int and ``to`` a positive int.
    """
    check_bytes(n, "align_up: n")
    check_bytes(to, "align_up: 'to'", lo=1)
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
        check_bytes(size, f"plan_regions: sizes[{i}]")
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
        raise InvalidValueError(
            f"carve: buffer holds {buf.numel()} bytes but the regions {list(sizes)} "
            f"need {total} bytes (offsets {offsets}); pass a buffer of at least {total} bytes"
        )
    return [buf[off : off + size] for off, size in zip(offsets, sizes, strict=False)]


def check_byte_buffer(buf: Any, what: str) -> torch.Tensor:
    """Refuse anything but a 1-D contiguous uint8 tensor."""
    if not isinstance(buf, torch.Tensor):
        raise InvalidValueError(
            f"{what} must be a torch.Tensor of dtype uint8, got {type(buf).__name__}"
        )
    if buf.dtype != torch.uint8:
        raise InvalidValueError(f"{what} must have dtype torch.uint8, got {buf.dtype}")
    if buf.dim() != 1:
        raise InvalidValueError(f"{what} must be 1-D, got shape {tuple(buf.shape)}")
    if not buf.is_contiguous():
        raise InvalidValueError(f"{what} must be contiguous, got stride {buf.stride()}")
    return buf


def aligned_zeros(nbytes: int, alignment: int, device: torch.device) -> torch.Tensor:
    """A zeroed 1-D uint8 buffer of ``nbytes`` whose storage starts on an ADDRESS
    that is a multiple of ``alignment`` (storage offset 0).

    Kernels and DMA engines see absolute addresses, so a field declared
    ``align=1024`` must start on a 1024-byte address, not merely at an offset
    that is a multiple of 1024 in memory the allocator placed anywhere. On
    CPU the bytes come from a private anonymous mapping (page-aligned, zeroed
    by the kernel) entered at the first aligned byte, advised to use huge
    pages (:func:`_advise_huge_pages`); CUDA's caching allocator already
    aligns its blocks to 512 bytes, and a stricter alignment it did not give
    is refused rather than faked.
    """
    check_bytes(nbytes, "aligned_zeros: nbytes")
    check_bytes(alignment, "aligned_zeros: alignment", lo=1)
    try:
        return _aligned_zeros(nbytes, alignment, device)
    except (RuntimeError, MemoryError, OSError, OverflowError) as exc:
        raise OutOfMemoryError(
            f"could not allocate {nbytes:,} bytes on {device}: {type(exc).__name__}: {exc}"
        ) from None


def _aligned_zeros(nbytes: int, alignment: int, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        if buf.data_ptr() % alignment:
            raise InvalidValueError(
                f"aligned_zeros: {device} gave an address aligned to less than {alignment} bytes; "
                "fields aligned beyond the allocator's granularity need a CPU buffer"
            )
        return buf
    if nbytes == 0:
        return torch.zeros(0, dtype=torch.uint8)
    private = getattr(mmap, "MAP_PRIVATE", None)
    if private is None:  # no POSIX flags (Windows): the platform's anonymous mapping
        mapping = mmap.mmap(-1, nbytes + alignment)
    else:
        mapping = mmap.mmap(-1, nbytes + alignment, flags=private | mmap.MAP_ANONYMOUS)
        _advise_huge_pages(mapping)
    base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    # The tensor keeps the mapping alive (it holds the buffer it was made from).
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=-base % alignment)


def _advise_huge_pages(mapping: mmap.mmap) -> None:
    """Ask the kernel to back ``mapping`` with transparent huge pages.

    A cache buffer is gigabytes read and written in blocks and slots spread
    over all of it; with 4 KiB pages every 16 KiB unit touched at random costs
    four TLB entries. Measured on the 2-core CI machine class (THP in
    ``madvise`` mode, as Debian ships it; a 64-image checkpoint store, paired
    rounds in one process): 1.07-1.14x the same store on 4 KiB pages in four
    of five runs, even in the fifth. The mapping is private: a shared
    anonymous mapping is shmem, which ``madvise`` mode never backs with huge
    pages. Only advice: where THP is off or the call is refused, the same
    bytes sit on small pages.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        mapping.madvise(advice)
    except OSError:
        return
