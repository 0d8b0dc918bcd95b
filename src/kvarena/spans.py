"""Byte spans as numpy arrays: the one pure helper both copy paths share.

Lives below every package that moves bytes (pools relocating entries, the
copy executor), so both coalesce the same way without one importing the other.
"""

from __future__ import annotations

import numpy as np


def coalesce(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge spans that continue each other on BOTH sides into one span.

    Spans are ordered by source offset; span i+1 joins span i when it starts
    where span i ends in the source and in the destination. Image units
    handed out consecutively by an allocator collapse into one copy this way.
    """
    if src.size < 2:
        return src, dst, length
    order = np.argsort(src, kind="stable")
    s, d, n = src[order], dst[order], length[order]
    joins = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
    if not joins.any():
        return s, d, n
    head = np.concatenate(([True], ~joins))
    run = np.cumsum(head) - 1
    return s[head], d[head], np.bincount(run, weights=n).astype(np.int64)
