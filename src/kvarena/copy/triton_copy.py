"""One-launch batched copy as a Triton kernel (CUDA; CPU under TRITON_INTERPRET=1).

Every span is cut into blocks of at most ``BLOCK`` words, one program per
block. The host ships one row per SPAN, not per block: ``(src, dst, words)``
and the index of each span's first block (an exclusive prefix sum), and each
program finds its span by a binary search over those firsts. So the host's
work and the table it ships follow the number of spans: 64 states of 37 MB
are 64 rows, where a row per block would be 295,000 rows built and shipped
for every launch, more host time than the copy of 2.4 GB itself takes on a
current GPU. Words are the widest of 8/4/2/1 bytes that divide every offset
and length, so 256-aligned layouts move 8 bytes per lane.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .words import as_words, word_bytes_for

BLOCK = 1024


@triton.jit
def _copy_spans(
    src_ptr,
    dst_ptr,
    table_ptr,
    first_ptr,
    num_spans,
    search_steps,
    src_words,
    dst_words,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    # The span holding block ``pid``: the last whose first block is <= pid.
    # Invariant first[lo] <= pid < first[hi] (first[num_spans] is the block
    # count); every span has a block, so the firsts strictly increase.
    lo = pid * 0
    hi = pid * 0 + num_spans
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        below = tl.load(first_ptr + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    k = pid - tl.load(first_ptr + lo)  # block index within its span
    s = tl.load(table_ptr + lo) + k * BLOCK
    d = tl.load(table_ptr + num_spans + lo) + k * BLOCK
    n = tl.load(table_ptr + 2 * num_spans + lo) - k * BLOCK
    offs = tl.arange(0, BLOCK)
    # The host validated every span; the buffer bounds are masked here as well,
    # so no table entry can ever address memory outside the two buffers.
    mask = (offs < n) & (s + offs < src_words) & (d + offs < dst_words)
    values = tl.load(src_ptr + s + offs, mask=mask)
    tl.store(dst_ptr + d + offs, values, mask=mask)


def span_table(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, word: int
) -> tuple[np.ndarray, np.ndarray]:
    """``[3, spans]`` int64 word offsets and word counts, and ``[spans + 1]``
    int64 first block of each span (the last entry: the block count)."""
    words = length // word
    first = np.zeros(words.size + 1, dtype=np.int64)
    np.cumsum(-(-words // BLOCK), out=first[1:])
    table = np.stack([src // word, dst // word, words]).astype(np.int64)
    return table, first


def triton_copy(
    src_buf: torch.Tensor,
    dst_buf: torch.Tensor,
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
) -> int:
    """Copy the (validated, non-empty) spans in one kernel launch; returns 1."""
    word = word_bytes_for(src_buf, dst_buf, src, dst, length)
    sw, dw = as_words(src_buf, word), as_words(dst_buf, word)
    table, first = span_table(src, dst, length, word)
    spans, blocks = table.shape[1], int(first[-1])
    both = torch.from_numpy(np.concatenate([table.reshape(-1), first]))
    device_both = both.to(src_buf.device, non_blocking=True)
    device_table, device_first = device_both[: 3 * spans], device_both[3 * spans :]
    steps = max(1, int(spans).bit_length())
    _copy_spans[(blocks,)](
        sw, dw, device_table, device_first, spans, steps, sw.numel(), dw.numel(), BLOCK=BLOCK
    )
    return 1
