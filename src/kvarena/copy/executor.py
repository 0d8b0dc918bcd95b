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
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import check_bytes
from ..errors import InvalidValueError
from ..layout.regions import check_byte_buffer
from ..spans import ascending, coalesce, distinct, gathers, progressions
from .plan import CopyBatch
from .words import as_words, word_bytes_for

LARGE_SPAN_BYTES = 128 * 1024
"""Spans at least this long leave the grouped short-span road: they move as a
gather or strided family (of MIN_RUN or more), else one copy each. In a batch
split over threads, spans in no family leave it sooner (THREADED_SPAN_BYTES).

Measured with ``benchmarks/bench_spans.py --mib 1`` on the 2-core CI machine
class (torch 2.13, spans at uneven destinations, so no family takes them; a
batch that small runs on one thread, where a span of its own is a torch
call): grouping moves 1.2-5x the bytes per second of one call per span below
64 KiB (4 KiB: 0.08-0.10x memcpy vs 0.02x; 32 KiB: 0.09-0.10x vs
0.07-0.08x), and the two tie from 64 KiB on."""

THREADED_SPAN_BYTES = 8 * 1024
"""In a batch split over threads, spans in no family move one memcpy each from
this length (grouped by length below it).

Measured with ``benchmarks/bench_spans.py`` on the 2-core CI machine class
(torch 2.13, 512 MiB of spans at uneven destinations, so no gather or strided
family takes them, paired rounds): one numpy memcpy each on two threads
0.23-0.24x memcpy at 8 KiB against 0.20x grouped, 0.49-0.51x against
0.29-0.30x at 16 KiB, 0.79-0.83x against 0.39-0.47x at 256 KiB; at 4 KiB the
two tie (0.13-0.14x). A batch on one thread (below PARALLEL_MIN_BYTES) keeps
LARGE_SPAN_BYTES: there each span would be a torch call, and grouping won
(1 MiB of 8-64 KiB spans: 0.09x against 0.04-0.09x)."""

TORCH_SPAN_BYTES = 1 << 20
"""Spans at least this long that no family takes are each one torch ``copy_``
on torch's own threads.

Measured on the 2-core CI machine class (torch 2.13, paired rounds, spans
scattered on the destination): 64 spans of 4.7 MB, one ``copy_`` each 0.82x
memcpy vs one numpy memcpy each on two Python threads 0.67x; 256 of 1 MiB
0.82x vs 0.72x; from 256 KiB down the two tie (0.72x vs 0.74x), and below
that the thread hand-off of each ``copy_`` costs more than it splits."""

STAGING_BYTES = 1 << 20
"""Short spans move through staging chunks of about this many bytes (cache-sized)."""

MIN_RUN = 4
"""Short spans adjacent on one side move in one pass once this many form a run."""

PROGRESSION_MIN_BYTES = 256 * 1024
"""A strided family of spans moves as one ``copy_`` from this many bytes up.

Measured on the 2-core CI machine class (torch 2.13): a ``copy_`` call costs
5-10 us of setup and thread hand-off, the time 75-150 KiB take to copy, so
from 256 KiB the call runs above 90% of its streaming speed. 804 blocks of
192 KiB, every other one relocated: one strided ``copy_`` 14.2-14.8 GB/s,
one call per span 10-12 GB/s, a plain memcpy of the bytes 14.7-15.9 GB/s."""

PARALLEL_MIN_BYTES = 4 << 20
"""CPU batches of at least this many bytes are split over torch's threads.

Measured on the 2-core CI machine (``benchmarks/bench_checkpoint.py``,
``bench_boundary.py``): starting a thread costs tens of microseconds, about
the time one core copies 0.5 MiB; at 4 MiB the second core's share pays for
it several times over, below it the gain is lost in noise."""


class CopyBoundsError(InvalidValueError):
    """A batch addresses bytes outside its buffers, or overlaps itself."""


@dataclass(frozen=True, kw_only=True)
class CopyStats:
    """What an execution issued: spans, bytes, copy calls and the path taken."""

    spans: int
    nbytes: int
    ops: int
    path: str


def _check_disjoint(s: np.ndarray, lengths: np.ndarray, what: str) -> None:
    """Refuse two spans (non-empty, sorted by start ``s``) that overlap."""
    e = s + lengths
    bad = np.nonzero(s[1:] < e[:-1])[0]
    if bad.size:
        i = int(bad[0])
        raise CopyBoundsError(
            f"{what}: spans [{int(s[i])}, {int(e[i])}) and [{int(s[i + 1])}, {int(e[i + 1])}) overlap"
        )


def _check_reads_miss_writes(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
    """Refuse a source span that overlaps any destination span (one storage;
    spans non-empty, sorted by destination).

    Destinations are disjoint (checked first), so sorted by start their ends
    ascend too: the only destination that can overlap ``[a, b)`` is the last
    one starting before ``b``.
    """
    if src.size == 0:
        return
    src_end, dst_end = src + length, dst + length
    if int(src_end.max()) <= int(dst[0]) or int(dst_end[-1]) <= int(src.min()):
        return  # all reads on one side of all writes (units below, slots above)
    last = np.searchsorted(dst, src_end, side="left") - 1
    hit = (last >= 0) & (dst_end[np.maximum(last, 0)] > src)
    if hit.any():
        i = int(np.nonzero(hit)[0][0])
        j = int(last[i])
        raise CopyBoundsError(
            f"copy batch reads [{int(src[i])}, {int(src_end[i])}) where it also writes "
            f"[{int(dst[j])}, {int(dst_end[j])}) (source and destination share one storage)"
        )


def validate_batch(batch: CopyBatch, src_buf: torch.Tensor, dst_buf: torch.Tensor) -> None:
    """Refuse a batch that would read or write outside its buffers, or race itself."""
    _checked_spans(batch, src_buf, dst_buf)


def _checked_spans(
    batch: CopyBatch, src_buf: torch.Tensor, dst_buf: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch's non-empty spans, coalesced and so sorted by destination,
    once every check has passed.

    Overlaps are looked for among the COALESCED spans: a merged span covers
    exactly the bytes of the spans it joins on each side, and spans it joins
    tile its range without overlapping, so two spans overlap (or a span reads
    what one writes) in the batch exactly when they do after merging; the
    sorts behind the checks then run over a few long spans, not thousands.
    """
    check_byte_buffer(src_buf, "copy source buffer")
    check_byte_buffer(dst_buf, "copy destination buffer")
    if src_buf.device != dst_buf.device:
        raise InvalidValueError(
            f"copy buffers live on {src_buf.device} and {dst_buf.device}; one device"
        )
    n = batch.num_spans
    if not (batch.src.shape == batch.dst.shape == batch.length.shape == (n,)):
        raise InvalidValueError("copy batch arrays must be 1-D of one length")
    if n == 0:
        return batch.src, batch.dst, batch.length
    if batch.length.min() < 0:
        raise CopyBoundsError(f"copy batch holds a negative length {int(batch.length.min())}")
    for name, starts, buf in (("source", batch.src, src_buf), ("destination", batch.dst, dst_buf)):
        size = buf.numel()
        # Each term is bounded before the sum, so start + length cannot wrap int64.
        if int(starts.min()) < 0 or int(starts.max()) > size or int(batch.length.max()) > size:
            raise CopyBoundsError(
                f"copy batch {name} spans start in [{int(starts.min())}, {int(starts.max())}] "
                f"with lengths up to {int(batch.length.max())}, but the {name} buffer holds "
                f"[0, {size})"
            )
        hi = int((starts.astype(np.int64) + batch.length.astype(np.int64)).max())
        if hi > size:
            raise CopyBoundsError(
                f"copy batch {name} spans reach byte {hi} but the {name} buffer holds [0, {size})"
            )
    keep = batch.length > 0
    if keep.all():
        src, dst, length = coalesce(batch.src, batch.dst, batch.length)
    else:
        src, dst, length = coalesce(batch.src[keep], batch.dst[keep], batch.length[keep])
    _check_disjoint(dst, length, "copy batch destination")
    if src_buf.untyped_storage().data_ptr() == dst_buf.untyped_storage().data_ptr():
        # Reading one byte twice is fine (one state into two images); reading
        # a byte another span of the batch writes is a race.
        shift = src_buf.storage_offset() - dst_buf.storage_offset()
        _check_reads_miss_writes(src + shift, dst, length)
    return src, dst, length


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


_PATHS = ("auto", "cpu", "torch", "triton")


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


def _copy_progression(
    words: _Words,
    src: int,
    dst: int,
    count: int,
    length: int,
    src_step: int,
    dst_step: int,
) -> None:
    """One family of spans as one call between two ``[count, length]`` row
    views of words. Destination rows are disjoint and, the batch being
    validated, no row read is written; torch sees strided (not dense) views
    here and moves them without an overlap copy of its own."""
    w, sw, dw = words.size, words.src, words.dst
    rows = (count, length // w)
    view_src = sw.as_strided(rows, (src_step // w, 1), sw.storage_offset() + src // w)
    view_dst = dw.as_strided(rows, (dst_step // w, 1), dw.storage_offset() + dst // w)
    view_dst.copy_(view_src)


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
        for family in families:
            _copy_progression(words, *family)
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
