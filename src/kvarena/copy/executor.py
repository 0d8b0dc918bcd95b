"""Carrying out a described batch of copies between two byte buffers.

The strategy is chosen by span size, from measurements on a 2-core CPU with
torch 2.13 (``benchmarks/bench_checkpoint.py``): a contiguous ``copy_`` per
span runs near memcpy speed for long spans but costs microseconds of host time
per call, so thousands of short spans drown in call overhead (0.06 GB/s for
256-byte spans). Short spans are therefore grouped by length and moved without
a Python loop per span: runs of spans adjacent at the source scatter from that
contiguous block (numpy elements of a ``void`` dtype as wide as the span, one
memcpy each), runs adjacent at the destination gather into it with
``index_select(out=)`` over an overlapping row view, and the rest goes through
a cache-sized staging chunk. Spans continuing each other on both sides are
coalesced first, and families of equal spans whose starts advance by one
constant step on each side (:func:`~kvarena.spans.progressions`: relocated
blocks from every other slot, image units over consecutive blocks) move as
one ``copy_`` between two strided views, which torch spreads over its own
threads, as are spans of :data:`TORCH_SPAN_BYTES` and more. On CPU, spans
whose destinations are evenly spaced, wherever they read from
(:func:`~kvarena.spans.gathers`: units handed out in any order, states from
slots handed out top-down written into blocks handed out bottom-up), are one
``index_select`` from the source viewed as a row at every word, for spans of
any length (above the short ones, in families of :data:`MIN_RUN` or more). Every torch call on CPU moves words, the widest of
8/4/2/1 bytes dividing the whole batch (:class:`_Words`): torch copies words
faster than bytes. What is left runs first, split over Python threads for
large batches, so those threads never start while torch's OpenMP workers
still spin after a parallel op.

On CUDA a batch runs as ONE Triton kernel launch when Triton is importable
(:mod:`kvarena.copy.triton_copy`), else as torch gathers and scatters over
``as_strided`` row views, two launches per distinct span length.

Before any byte moves the batch is checked: every span inside its buffer, no
two destination spans overlapping, and no source span overlapping a
destination span when both live in one storage. A refused batch writes nothing.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import torch

from ..checks import check_bytes
from ..errors import InvalidValueError
from ..spans import distinct, gathers, grids, progressions
from .grid_copy import copy_grid
from .plan import CopyBatch
from .short_spans import _short_spans_cpu, _short_spans_torch
from .thresholds import (
    LARGE_SPAN_BYTES,
    MIN_RUN,
    PARALLEL_MIN_BYTES,
    PROGRESSION_MIN_BYTES,
    THREADED_SPAN_BYTES,
    TORCH_SPAN_BYTES,
)
from .validate import CopyStats, _checked_spans
from .words import _gather_word, _Words

_PATHS = ("auto", "cpu", "torch", "triton")


def _copy_spans(
    src_buf: torch.Tensor,
    dst_buf: torch.Tensor,
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
    large_span_bytes: int,
    path: str,
    threaded: bool = False,
) -> int:
    """One share of a batch: long spans one copy each, short ones grouped by length.

    ``threaded``: this share runs beside others, so long spans are copied by
    numpy (one memcpy on this thread, GIL released) rather than by torch,
    whose own thread team would oversubscribe the cores the shares already use.
    """
    ops = 0
    large = length >= large_span_bytes
    spans = zip(src[large].tolist(), dst[large].tolist(), length[large].tolist(), strict=True)
    if threaded:
        src_np, dst_np = src_buf.numpy(), dst_buf.numpy()
        for s, d, n in spans:
            dst_np[d : d + n] = src_np[s : s + n]
            ops += 1
    elif large.any():
        words = _Words.of(src_buf, dst_buf, src[large], dst[large], length[large])
        for s, d, n in spans:
            _copy_one(words, s, d, n)
            ops += 1
    short = ~large
    mover = _short_spans_cpu if path == "cpu" else _short_spans_torch
    for value in distinct(length[short]):
        group = short & (length == value)
        ops += mover(src_buf, dst_buf, src[group], dst[group], value)
    return ops


def _copy_one(words: _Words, src: int, dst: int, n: int) -> None:
    """One span as one torch ``copy_`` of words."""
    w = words.size
    words.dst[dst // w : (dst + n) // w].copy_(words.src[src // w : (src + n) // w])


def _threads_for(path: str, nbytes: int, spans: int) -> int:
    """Threads for a CPU batch: torch's intra-op count, for batches big enough to
    pay for starting them (PARALLEL_MIN_BYTES) and with a span for each."""
    if path != "cpu" or nbytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(torch.get_num_threads(), spans))


def _in_threads(
    threads: int,
    src_buf: torch.Tensor,
    dst_buf: torch.Tensor,
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
    large_span_bytes: int,
    path: str,
) -> int:
    """Split the spans into ``threads`` contiguous shares of about equal bytes and
    copy them concurrently. torch's ``copy_`` and numpy's row assignment release
    the GIL while they move bytes, so the shares run on separate cores. The
    spans are disjoint on the destination (validated), so shares never race."""
    cum = np.cumsum(length)
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, threads) / threads, side="left") + 1
    bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < src.size)), src.size]
    shares = list(itertools.pairwise(bounds))
    results = [0] * len(shares)
    errors: list[BaseException] = []

    def work(i: int, a: int, b: int) -> None:
        try:
            results[i] = _copy_spans(
                src_buf,
                dst_buf,
                src[a:b],
                dst[a:b],
                length[a:b],
                large_span_bytes,
                path,
                threaded=True,
            )
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    workers = [
        threading.Thread(target=work, args=(i, a, b), daemon=True)
        for i, (a, b) in enumerate(shares[1:], start=1)
    ]
    for w in workers:
        w.start()
    work(0, *shares[0])
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return sum(results)


def _copy_gather(
    words: _Words,
    dst: int,
    count: int,
    length: int,
    dst_step: int,
    sources: np.ndarray,
) -> None:
    """One gather family as one ``index_select``: the destination rows are one
    strided view, and the source is viewed as a row starting at EVERY word
    (overlapping rows), so a row's index is its source offset in words.

    Measured on the 2-core CI machine class (300 MiB of 16 KiB spans read in
    order and written to a random permutation of evenly spaced blocks, paired
    rounds): 0.81-0.90x memcpy as one gather; 0.61-0.63x through the grouped
    short-span path (a numpy scatter on Python threads). torch sees rows that
    overlap (not dense), so it does not refuse to read and write one storage;
    the batch was validated, so no row read is written.

    Words are chosen by :func:`_gather_word` so that torch runs the rows on
    every thread (:data:`TORCH_GRAIN_ELEMENTS`).
    """
    w = _gather_word(length, words.size, words.wide)
    if w != words.size:
        words = words.narrowed(w)
    sw, dw = words.src, words.dst
    k = length // w
    # The source is viewed from the lowest row read: torch checks the first
    # row of the source view against the first row written, and a view from
    # the buffer's start may overlap it there though no row read does (the
    # batch was validated: no source span overlaps a destination span).
    lo = int(sources.min()) // w
    window = sw[lo : (int(sources.max()) + length) // w]
    rows = window.as_strided((window.numel() - k + 1, k), (1, 1))
    out = dw.as_strided((count, k), (dst_step // w, 1), dw.storage_offset() + dst // w)
    index = torch.from_numpy(sources // w - lo).to(sw.device)
    torch.index_select(rows, 0, index, out=out)


def execute_batch(
    batch: CopyBatch,
    src_buf: torch.Tensor,
    dst_buf: torch.Tensor,
    *,
    large_span_bytes: int = LARGE_SPAN_BYTES,
    progression_min_bytes: int = PROGRESSION_MIN_BYTES,
    torch_span_bytes: int = TORCH_SPAN_BYTES,
    threaded_span_bytes: int = THREADED_SPAN_BYTES,
    path: str = "auto",
) -> CopyStats:
    """Copy every span of ``batch`` from ``src_buf`` to ``dst_buf``.

    Bytes outside the spans are never written; the whole batch is checked
    before the first byte. ``path`` is ``"auto"`` (Triton on CUDA when
    importable, else torch; numpy rows on CPU), or one of ``"triton"``,
    ``"torch"``, ``"cpu"`` to force a path (tests run every path on CPU).
    ``large_span_bytes``, ``progression_min_bytes``, ``torch_span_bytes`` and
    ``threaded_span_bytes`` move the thresholds between the strategies (tests
    drive every strategy with small batches).
    """
    if path not in _PATHS:
        raise InvalidValueError(f"execute_batch: path must be one of {_PATHS}, got {path!r}")
    large_span_bytes = check_bytes(large_span_bytes, "execute_batch: large_span_bytes", lo=1)
    progression_min_bytes = check_bytes(
        progression_min_bytes, "execute_batch: progression_min_bytes"
    )
    torch_span_bytes = check_bytes(torch_span_bytes, "execute_batch: torch_span_bytes", lo=1)
    threaded_span_bytes = check_bytes(
        threaded_span_bytes, "execute_batch: threaded_span_bytes", lo=1
    )
    src, dst, length = _checked_spans(batch, src_buf, dst_buf)
    spans, nbytes = int(np.count_nonzero(batch.length)), int(length.sum())
    if spans == 0:
        return CopyStats(spans=0, nbytes=0, ops=0, path="empty")
    if path == "auto":
        if src_buf.device.type == "cpu":
            path = "cpu"
        else:
            path = "triton" if src_buf.device.type == "cuda" and triton_available() else "torch"
    if path == "cpu" and src_buf.device.type != "cpu":
        raise InvalidValueError(
            f"execute_batch: the cpu path needs CPU buffers, got {src_buf.device}"
        )
    if path == "triton":
        if not triton_available():
            raise InvalidValueError(
                "execute_batch: path='triton' needs Triton, which is not installed; "
                "use path='auto' (it picks the torch path without Triton)"
            )
        from .triton_copy import triton_copy

        ops = triton_copy(src_buf, dst_buf, src, dst, length)
        return CopyStats(spans=spans, nbytes=nbytes, ops=ops, path="triton")

    if path == "cpu":
        # Spans whose destinations are evenly spaced, in any source order, are
        # gathered by torch in one call: an image written upward, downward or
        # shuffled over evenly spaced blocks is one gather. Paired A/B against
        # the other roads (600 MiB, spans read in order, written shuffled or
        # reversed): 16 KiB units shuffled 1.06-1.16x the grouped short-span
        # path; 1 MiB 0.93x memcpy shuffled (0.86x one copy_ each), 2 MiB
        # 0.93-0.96x (0.89-0.91x), 4.5 MiB 0.96x (0.94x). torch splits a
        # gather's bytes, not its rows, over its threads (3 rows of 36 MiB:
        # 0.99x). Short spans are gathered first; among the rest, upward
        # strided families (both sides advance by one step: relocated blocks)
        # are one strided copy_, and what is left is gathered in families of
        # MIN_RUN or more: two spans always "advance by one step", and whole
        # units with each image's shorter last unit between them make
        # families of two, slower than two copy_ calls (Qwen3-Next images in
        # 2 MiB units: 0.82x memcpy against 0.86-0.87x). Spans between
        # large_span_bytes and torch_span_bytes gathered so (256 KiB units,
        # rows of 16-byte words: :func:`_gather_word`) beat one memcpy each on
        # threads by 5-10% in scattered stores and 9-26% in restores, within
        # -1.3..+2.5% in shuffled stores (paired A/B, four layouts).
        short = length < large_span_bytes
        gathered, covered = gathers(src, dst, length, progression_min_bytes, ~short)
        families, in_family = progressions(
            src, dst, length, progression_min_bytes, min_spans=MIN_RUN, skip=covered
        )
        covered = covered | in_family
        more_gathered, more = gathers(
            src, dst, length, progression_min_bytes, short | covered, min_spans=MIN_RUN
        )
        gathered += more_gathered
        covered = covered | more
    else:
        gathered = []
        families, covered = progressions(src, dst, length, progression_min_bytes)
    # Strided families, gathers and very long spans go to torch, which runs
    # them on its own OpenMP team; the rest (spans below the threshold grouped
    # by length: THREADED_SPAN_BYTES when split over threads, LARGE_SPAN_BYTES
    # on one; longer ones one memcpy each) on Python threads. The threads go FIRST:
    # torch's workers spin on the cores for a while after each parallel op,
    # and threads started then share the cores with them (measured: 0.66x
    # memcpy).
    alone = ~covered & (length >= torch_span_bytes)
    rest = ~covered & ~alone
    ops = 0
    if rest.any():
        r_src, r_dst, r_len = src[rest], dst[rest], length[rest]
        threads = _threads_for(path, int(r_len.sum()), r_src.size)
        if threads > 1:
            ops += _in_threads(
                threads,
                src_buf,
                dst_buf,
                r_src,
                r_dst,
                r_len,
                min(large_span_bytes, threaded_span_bytes),
                path,
            )
        else:
            ops += _copy_spans(src_buf, dst_buf, r_src, r_dst, r_len, large_span_bytes, path)
    if families or gathered or alone.any():
        words = _Words.of(src_buf, dst_buf, src, dst, length, widest=16 if path == "cpu" else 8)
        for grid in grids(families):  # families of families: one call each
            copy_grid(words, *grid)
            ops += 1
        for gather in gathered:
            _copy_gather(words, *gather)
            ops += 1
        for s, d, n in zip(
            src[alone].tolist(), dst[alone].tolist(), length[alone].tolist(), strict=True
        ):
            _copy_one(words, s, d, n)
            ops += 1
    return CopyStats(spans=spans, nbytes=nbytes, ops=ops, path=path)


def triton_available() -> bool:
    """True when Triton imports (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
