"""Where one copy per span stops losing to grouped short-span moves: the
measurement behind ``kvarena.copy.thresholds.THREADED_SPAN_BYTES`` (batches
split over threads: the default 512 MiB) and ``LARGE_SPAN_BYTES`` (batches on
one thread, below ``PARALLEL_MIN_BYTES``: ``--mib 1``).

Spans of one length evenly spaced at the destination are one gather on
either side of the threshold, so the threshold decides only for spans in no
family: here destinations lie in random order at uneven gaps (0-15 x 64 bytes
between them), 512 MiB of spans in all by default (the size of a 64-request
checkpoint store). Each batch runs through ``execute_batch`` twice, side by
side: every span as one copy (``large_span_bytes=1``: one memcpy each on
threads, or one torch ``copy_`` each from ``TORCH_SPAN_BYTES``) and every span
on the grouped short-span road (``large_span_bytes`` above the length: runs
adjacent at the source scatter in one pass, the rest through a staging
chunk). Two placements of the sources: *shuffled* (nothing adjacent) and
*image* (in order, as a checkpoint store reads a state). A plain memcpy of
the same bytes is the ceiling; buffers come from the allocator the caches
use. The crossover is the shortest length from which one copy per span is at
least as fast as grouping, at every longer length too, in both placements.

    python benchmarks/bench_spans.py [--mib 512] [--repeats 7]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from _timing import cache_memory, filled, plain_copy, side_by_side

from kvarena.copy import CopyBatch, execute_batch
from kvarena.copy.thresholds import LARGE_SPAN_BYTES, THREADED_SPAN_BYTES

LENGTHS_KIB = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


PLACEMENTS = ("shuffled", "image")


def measure(length: int, total: int, repeats: int, placement: str) -> dict[str, float]:
    n = max(4, total // length)
    cpu = torch.device("cpu")
    rng = np.random.default_rng(length)
    gaps = rng.integers(0, 16, n) * 64
    dst = (np.cumsum(length + gaps) - (length + gaps))[rng.permutation(n)]
    src = rng.permutation(n) * length if placement == "shuffled" else np.arange(n) * length
    src_buf = cache_memory((n * length,), torch.uint8, cpu)
    src_buf.copy_(torch.randint(0, 256, (n * length,), dtype=torch.uint8))
    dst_buf = filled(int(dst.max()) + length, 1, cpu)
    flat = filled(n * length, 1, cpu)
    batch = CopyBatch(src, dst, np.full(n, length))
    t = side_by_side(
        {
            "each": lambda: execute_batch(batch, src_buf, dst_buf, large_span_bytes=1),
            "grouped": lambda: execute_batch(
                batch,
                src_buf,
                dst_buf,
                large_span_bytes=length + 1,
                threaded_span_bytes=length + 1,
            ),
            "memcpy": lambda: plain_copy(flat, src_buf),
        },
        repeats,
        torch.device("cpu"),
    )
    # Both roads wrote the same bytes; spans across the batch are checked.
    for i in np.linspace(0, n - 1, 16).astype(int).tolist():
        d, s = int(dst[i]), int(src[i])
        assert torch.equal(dst_buf[d : d + length], src_buf[s : s + length]), i
    gbps = {k: n * length / s / 1e9 for k, s in t.items()}
    return {**gbps, "each_x": t.speed("each", "memcpy"), "grouped_x": t.speed("grouped", "memcpy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.mib} MiB of "
        f"spans at uneven destinations, median of {args.repeats}; LARGE_SPAN_BYTES now "
        f"{LARGE_SPAN_BYTES >> 10} KiB, THREADED_SPAN_BYTES {THREADED_SPAN_BYTES >> 10} KiB"
    )
    header = (
        f"{'span':>8} {'placement':>9} {'one copy each':>14} {'grouped':>9} {'memcpy':>8} "
        f"{'each/memcpy':>12} {'grouped/memcpy':>15}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for kib in LENGTHS_KIB:
        for placement in PLACEMENTS:
            g = measure(kib << 10, args.mib << 20, args.repeats, placement)
            rows.append((kib, g))
            print(
                f"{kib:>5} KiB {placement:>9} {g['each']:>9.2f} GB/s {g['grouped']:>9.2f} "
                f"{g['memcpy']:>8.2f} {g['each_x']:>11.2f}x {g['grouped_x']:>14.2f}x"
            )
    # Ratios to the memcpy of the same round, not GB/s: rows of one length run
    # minutes apart on a machine whose memcpy moves 13-30 GB/s run to run.
    cross = next(
        (
            kib
            for i, (kib, _) in enumerate(rows)
            if all(g["each_x"] >= g["grouped_x"] for _, g in rows[i:])
        ),
        None,
    )
    print(f"crossover: {cross} KiB" if cross else "crossover: beyond the lengths measured")


if __name__ == "__main__":
    main()
