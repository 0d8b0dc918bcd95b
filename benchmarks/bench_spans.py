"""Where one copy per span stops losing to grouped short-span moves: the
measurement behind ``kvarena.copy.executor.LARGE_SPAN_BYTES``.

For each span length, batches of spans (512 MiB in all by default, the size of a 64-request checkpoint store) run through
``execute_batch`` twice, side by side: every span as one contiguous copy
(``large_span_bytes=1``: one memcpy each, on threads) and every span on the
grouped short-span road (``large_span_bytes`` above the length: destinations
evenly spaced, so one gather). Two placements: *shuffled* (sources and
destinations both in random order, nothing coalesces) and *image* (sources in
order, as a checkpoint store reads a state; destinations shuffled). A plain
memcpy of the same bytes is the ceiling; buffers come from the allocator the
caches use. The crossover is the shortest length from which one copy per span
is at least as fast as grouping, at every longer length too, in both placements.

    python benchmarks/bench_spans.py [--mib 512] [--repeats 7]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from _timing import cache_memory, filled, plain_copy, side_by_side

from kvarena.copy import CopyBatch, execute_batch
from kvarena.copy.executor import LARGE_SPAN_BYTES, TORCH_SPAN_BYTES

LENGTHS_KIB = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


PLACEMENTS = ("shuffled", "image")


def measure(length: int, total: int, repeats: int, placement: str) -> dict[str, float]:
    n = max(4, total // length)
    cpu = torch.device("cpu")
    src_buf = cache_memory((n * length,), torch.uint8, cpu)
    src_buf.copy_(torch.randint(0, 256, (n * length,), dtype=torch.uint8))
    dst_buf, flat = filled(n * length, 1, cpu), filled(n * length, 1, cpu)
    rng = np.random.default_rng(length)
    src = rng.permutation(n) * length if placement == "shuffled" else np.arange(n) * length
    dst = rng.permutation(n) * length
    batch = CopyBatch(src, dst, np.full(n, length))
    t = side_by_side(
        {
            "each": lambda: execute_batch(batch, src_buf, dst_buf, large_span_bytes=1),
            "grouped": lambda: execute_batch(batch, src_buf, dst_buf, large_span_bytes=length + 1),
            "memcpy": lambda: plain_copy(flat, src_buf),
        },
        repeats,
        torch.device("cpu"),
    )
    # Every span landed (both roads wrote the same bytes; the last one is checked).
    rows_in, rows_out = torch.from_numpy(src // length), torch.from_numpy(dst // length)
    assert torch.equal(dst_buf.view(n, length)[rows_out], src_buf.view(n, length)[rows_in])
    gbps = {k: n * length / s / 1e9 for k, s in t.items()}
    return {**gbps, "each_x": t.speed("each", "memcpy"), "grouped_x": t.speed("grouped", "memcpy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.mib} MiB of "
        f"scattered spans, median of {args.repeats}; LARGE_SPAN_BYTES now "
        f"{LARGE_SPAN_BYTES >> 10} KiB"
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
    # minutes apart on a machine whose memcpy moves 13-23 GB/s run to run. From
    # TORCH_SPAN_BYTES up both columns are one road (a gather, or one torch
    # copy_ each), so only the lengths below it can place the crossover.
    below = [(kib, g) for kib, g in rows if kib << 10 < TORCH_SPAN_BYTES]
    cross = next(
        (
            kib
            for i, (kib, _) in enumerate(below)
            if all(g["each_x"] >= g["grouped_x"] for _, g in below[i:])
        ),
        None,
    )
    print(
        f"crossover: {cross} KiB"
        if cross
        else f"crossover: none below {TORCH_SPAN_BYTES >> 10} KiB (grouping never lost)"
    )


if __name__ == "__main__":
    main()
