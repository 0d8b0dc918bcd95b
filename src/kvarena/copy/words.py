"""Byte buffers seen as wider words: the one helper the torch and Triton copy paths share.

Copying 8-byte words instead of bytes is what makes index-based copies fast;
the widest usable word is the largest of 8/4/2/1 that divides every offset,
every length and both buffers' starts.
"""

from __future__ import annotations

import numpy as np
import torch

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_bytes(*arrays: np.ndarray, offsets: tuple[int, ...] = ()) -> int:
    """The widest of 8/4/2/1 bytes that divides every offset and length given."""
    for w in (8, 4, 2):
        if all(int(np.bitwise_or.reduce(a, initial=0)) % w == 0 for a in arrays) and all(
            o % w == 0 for o in offsets
        ):
            return w
    return 1


def word_bytes_for(src_buf: torch.Tensor, dst_buf: torch.Tensor, *arrays: np.ndarray) -> int:
    """The widest word dividing every offset, length and both buffers' starts."""
    return word_bytes(
        *arrays, offsets=(int(src_buf.storage_offset()), int(dst_buf.storage_offset()))
    )


def as_words(buf: torch.Tensor, word: int) -> torch.Tensor:
    """A 1-D byte buffer re-viewed as ``word``-byte integers (a trailing partial word dropped)."""
    return buf[: buf.numel() - buf.numel() % word].view(_WORD_DTYPES[word])
