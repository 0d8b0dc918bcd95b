"""One-launch batched copy as a Triton kernel (CUDA; CPU under TRITON_INTERPRET=1).

Every span is cut into blocks of at most ``BLOCK`` words; the host lays out,
in one vectorized numpy pass, one ``(src, dst, words)`` row per block and
ships the table in one transfer; one program per block copies its words.
Words are the widest of 8/4/2/1 bytes that divide every offset and length, so
256-aligned layouts move 8 bytes per lane.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .words import as_words, word_bytes_for

BLOCK = 1024


@triton.jit
def _copy_blocks(
    src_ptr, dst_ptr, table_ptr, num_blocks, src_words, dst_words, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    s = tl.load(table_ptr + pid)
    d = tl.load(table_ptr + num_blocks + pid)
    n = tl.load(table_ptr + 2 * num_blocks + pid)
    offs = tl.arange(0, BLOCK)
    # The host validated every span; the buffer bounds are masked here as well,
    # so no table entry can ever address memory outside the two buffers.
    mask = (offs < n) & (s + offs < src_words) & (d + offs < dst_words)
    values = tl.load(src_ptr + s + offs, mask=mask)
    tl.store(dst_ptr + d + offs, values, mask=mask)


def block_table(src: np.ndarray, dst: np.ndarray, length: np.ndarray, word: int) -> np.ndarray:
    """``[3, blocks]`` int64: word offsets and word counts of each block."""
    words = length // word
    per_span = -(-words // BLOCK)
    span_of = np.repeat(np.arange(words.size), per_span)
    first = np.cumsum(per_span) - per_span
    k = np.arange(span_of.size) - first[span_of]  # block index within its span
    start = k * BLOCK
    return np.stack(
        [
            src[span_of] // word + start,
            dst[span_of] // word + start,
            np.minimum(BLOCK, words[span_of] - start),
        ]
    ).astype(np.int64)


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
    table = block_table(src, dst, length, word)
    blocks = table.shape[1]
    device_table = torch.from_numpy(table.reshape(-1)).to(src_buf.device, non_blocking=True)
    _copy_blocks[(blocks,)](sw, dw, device_table, blocks, sw.numel(), dw.numel(), BLOCK=BLOCK)
    return 1
