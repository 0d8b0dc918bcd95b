"""Byte buffers seen as wider words: the one helper the torch and Triton copy paths share.

Copying 8-byte words instead of bytes is what makes index-based copies fast;
the widest usable word is the largest of 8/4/2/1 (16 where a caller allows
it) that divides every offset, every length and both buffers' starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# A 16-byte word is complex128, torch's only 16-byte element: copies move it
# as bits (no arithmetic, no conjugate bit on a fresh view), so it is as exact
# as an integer word. The Triton kernel loads at most 8 bytes a lane.
_WORD_DTYPES = {
    16: torch.complex128,
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}


def word_bytes(*arrays: np.ndarray, offsets: tuple[int, ...] = (), widest: int = 8) -> int:
    """The widest of 16/8/4/2/1 bytes, ``widest`` at most, that divides every
    offset and length given: the lowest set bit of all of them OR-ed together,
    found with one pass over each array."""
    bits = 0
    for a in arrays:
        bits |= int(np.bitwise_or.reduce(a, initial=0))
    for o in offsets:
        bits |= o
    w = widest
    while w > 1 and bits % w:
        w //= 2
    return w


def word_bytes_for(
    src_buf: torch.Tensor, dst_buf: torch.Tensor, *arrays: np.ndarray, widest: int = 8
) -> int:
    """The widest word (``widest`` bytes at most) dividing every offset, length
    and both buffers' starts."""
    return word_bytes(
        *arrays,
        offsets=(int(src_buf.storage_offset()), int(dst_buf.storage_offset())),
        widest=widest,
    )


def as_words(buf: torch.Tensor, word: int) -> torch.Tensor:
    """A 1-D byte buffer re-viewed as ``word``-byte integers (a trailing partial word dropped)."""
    return buf[: buf.numel() - buf.numel() % word].view(_WORD_DTYPES[word])


@dataclass(frozen=True)
class _Words:
    """Both buffers of a batch seen as ``size``-byte integers: the widest of
    8/4/2/1 that divides every offset and length of the batch and both
    buffers' starts (so every step between them too).

    torch moves wider elements faster on CPU (measured on the 2-core CI machine
    class, torch 2.13: a 256 MiB ``copy_`` 1.03-1.2x faster as 8-byte words
    than as bytes, a strided family 1.1-1.25x); the bytes moved are the same.
    ``size`` is 8 bytes at most; 16-byte words are for the gathers that need
    them to keep rows under torch's grain (:func:`_gather_word`).
    Found once per batch: searched again for each call, it cost a store of
    16 KiB units (65 gathers) 4-6% of its time."""

    size: int
    src: torch.Tensor
    dst: torch.Tensor
    src_bytes: torch.Tensor
    dst_bytes: torch.Tensor
    wide: bool = False
    """16-byte words divide the batch too (taken only by gathers that need them)."""

    @classmethod
    def of(
        cls, src_buf: torch.Tensor, dst_buf: torch.Tensor, *offsets: np.ndarray, widest: int = 8
    ) -> _Words:
        w = word_bytes_for(src_buf, dst_buf, *offsets, widest=widest)
        size = min(w, 8)
        return cls(
            size, as_words(src_buf, size), as_words(dst_buf, size), src_buf, dst_buf, w == 16
        )

    def narrowed(self, size: int) -> _Words:
        """The same buffers as ``size``-byte words (a divisor of this size, or 16)."""
        return _Words(
            size,
            as_words(self.src_bytes, size),
            as_words(self.dst_bytes, size),
            self.src_bytes,
            self.dst_bytes,
            self.wide,
        )


TORCH_GRAIN_ELEMENTS = 32768
"""torch's ``at::internal::GRAIN_SIZE``: the fewest elements its CPU kernels hand
to one thread. A row gather (``index_select``) of rows shorter than this runs
rows on every thread at once; longer rows go one after another, each split
into ``elements // GRAIN`` tasks, so a row of 1x-2x the grain runs on ONE
thread (32 KiB byte rows: 0.58x memcpy; the same rows as 8-byte words, rows
on both threads: 1.00x; 2-core CI machine class, torch 2.13)."""


def _gather_word(length: int, size: int, wide: bool) -> int:
    """The word a gather of ``length``-byte rows moves: the widest (``size`` at
    most) whose rows hold fewer elements than torch's grain, so rows run on
    every thread at once; else 16 bytes where the batch allows it and that
    gets under the grain (rows of 256-512 KiB); else the widest whose rows
    hold two grains or more, so each row splits over threads. Wider words
    than needed are not taken: a gather of 4.7 MB rows ran 3-25% slower as
    16-byte words than as 8-byte ones (paired A/B)."""
    words = [w for w in (8, 4, 2, 1) if w <= size]
    for w in words:
        if length // w < TORCH_GRAIN_ELEMENTS:
            return w
    if wide and length // 16 < TORCH_GRAIN_ELEMENTS:
        return 16
    return next(w for w in words if length // w >= 2 * TORCH_GRAIN_ELEMENTS or w == 1)
