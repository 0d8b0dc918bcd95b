"""Byte buffers seen as wider words: the one helper the torch and Triton copy paths share.

Copying 8-byte words instead of bytes is what makes index-based copies fast;
the widest usable word is the largest of 8/4/2/1 (16 where a caller allows
it) that divides every offset, every length and both buffers' starts.
"""

from __future__ import annotations

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
