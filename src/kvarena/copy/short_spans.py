"""Short spans, grouped by length and moved without a Python loop per span.

Runs of spans adjacent at the source scatter from that contiguous block
(numpy elements of a ``void`` dtype as wide as the span, one memcpy each),
runs adjacent at the destination gather into it, and the rest goes through a
cache-sized staging chunk; on a device, torch gathers and scatters over
``as_strided`` row views (:func:`_short_spans_torch`).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from ..spans import ascending
from .thresholds import MIN_RUN, STAGING_BYTES
from .words import as_words, word_bytes_for

NUMPY_GIL_ITEMS = 500
"""numpy's fancy indexing releases the GIL only for more items than this
(``NPY_BEGIN_THREADS_THRESHOLDED``). Measured here: 16 KiB items scattered by
two threads, 499 per call 10.7 GB/s (no faster than one thread), 501 per
call 14.5 GB/s. Calls with fewer spans cut them into pieces (:func:`_pieces`)."""

MIN_PIECE_BYTES = 1024
"""Pieces never get shorter than this: each item costs numpy a call of its own."""


def _pieces(starts: np.ndarray, length: int) -> tuple[np.ndarray, int]:
    """``starts`` (spans of ``length`` bytes) as more, shorter pieces so one numpy
    call moves more than :data:`NUMPY_GIL_ITEMS` items (and releases the GIL);
    piece ``k`` of a span follows piece ``k - 1``, so a contiguous block of
    spans is the same contiguous block of pieces."""
    f = 1
    while (
        starts.size * f <= NUMPY_GIL_ITEMS
        and length % (2 * f) == 0
        and length // (2 * f) >= MIN_PIECE_BYTES
    ):
        f *= 2
    if f == 1:
        return starts, length
    piece = length // f
    return (starts[:, None] + np.arange(f) * piece).ravel(), piece


def _void_rows(buf: np.ndarray, length: int) -> np.ndarray:
    """Every byte offset of ``buf`` as the start of one ``length``-byte element.

    The elements overlap; indexing picks the ones a batch names, and numpy
    moves each picked element with one memcpy.
    """
    return np.ndarray(
        shape=(buf.size - length + 1,), dtype=np.dtype((np.void, length)), buffer=buf, strides=(1,)
    )


def _runs(starts: np.ndarray, length: int) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges of a sorted array where each start follows the
    previous by exactly ``length``: spans adjacent on that side, at least MIN_RUN long."""
    breaks = np.flatnonzero(np.diff(starts) != length) + 1
    bounds = np.concatenate(([0], breaks, [starts.size])).tolist()
    return [(a, b) for a, b in itertools.pairwise(bounds) if b - a >= MIN_RUN]


def _short_spans_cpu(
    src: torch.Tensor, dst: torch.Tensor, s: np.ndarray, d: np.ndarray, length: int
) -> int:
    """Move equal-length short spans in as few passes over the bytes as possible.

    1. Spans adjacent in the SOURCE (a checkpoint store: an image's ranges cut
       into units) scatter straight from that contiguous block: one pass.
    2. Spans adjacent in the DESTINATION (a restore) gather straight into it
       with ``index_select(out=)``: one pass.
    3. The rest is gathered into a cache-sized staging chunk and scattered.
    """
    # Work on the smallest windows of both buffers that hold the spans: when
    # source and destination share one storage (a cache storing its own
    # state into its own blocks), numpy copies a source whose memory range
    # overlaps the destination's before assigning. Validation already proved
    # no span reads what another writes; disjoint windows let numpy see it too.
    slo, shi = int(s.min()), int(s.max()) + length
    dlo, dhi = int(d.min()), int(d.max()) + length
    src, dst = src[slo:shi], dst[dlo:dhi]
    s, d = s - slo, d - dlo
    src_np, dst_np = src.numpy(), dst.numpy()
    ops = 0

    order = ascending(s)
    s, d = s[order], d[order]
    keep = np.ones(s.size, dtype=bool)
    for a, b in _runs(s, length):
        base = int(s[a])
        targets, piece = _pieces(d[a:b], length)
        _void_rows(dst_np, piece)[targets] = src_np[base : base + (b - a) * length].view(
            np.dtype((np.void, piece))
        )
        keep[a:b] = False
        ops += 1
    s, d = s[keep], d[keep]

    order = ascending(d)
    s, d = s[order], d[order]
    keep = np.ones(s.size, dtype=bool)
    if s.size:
        src_rows_t = src.as_strided((src.numel() - length + 1, length), (1, 1))
        for a, b in _runs(d, length):
            base = int(d[a])
            out = dst[base : base + (b - a) * length].view(b - a, length)
            torch.index_select(src_rows_t, 0, torch.from_numpy(s[a:b]), out=out)
            keep[a:b] = False
            ops += 1
    s, d = s[keep], d[keep]

    step = max(1, STAGING_BYTES // length)
    for i in range(0, s.size, step):
        # Pieces of equal count on both sides, in the same order.
        reads, piece = _pieces(s[i : i + step], length)
        writes, _ = _pieces(d[i : i + step], length)
        _void_rows(dst_np, piece)[writes] = _void_rows(src_np, piece)[reads]
        ops += 1
    return ops


def _short_spans_torch(
    src: torch.Tensor, dst: torch.Tensor, s: np.ndarray, d: np.ndarray, length: int
) -> int:
    w = word_bytes_for(src, dst, s, d, np.array([length]))
    sw, dw = as_words(src, w), as_words(dst, w)
    k = length // w
    src_rows = sw.as_strided((sw.numel() - k + 1, k), (1, 1))
    dst_rows = dw.as_strided((dw.numel() - k + 1, k), (1, 1))
    s_idx = torch.from_numpy(s // w).to(src.device, non_blocking=True)
    d_idx = torch.from_numpy(d // w).to(src.device, non_blocking=True)
    dst_rows.index_copy_(0, d_idx, src_rows.index_select(0, s_idx))
    return 2
