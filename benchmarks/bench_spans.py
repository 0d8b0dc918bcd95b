"""Where one copy per span stops losing to grouped short-span moves: the
measurement behind ``kvarena.copy.executor.LARGE_SPAN_BYTES``.

For each span length, a batch of scattered spans (64 MiB in all, sources and
destinations in shuffled order so nothing coalesces) runs through
``execute_batch`` twice, side by side: every span as one contiguous copy
(``large_span_bytes=1``) and every span in the grouped short-span path
(``large_span_bytes`` above the length). A plain memcpy of the same bytes is
the ceiling. The crossover is the shortest length from which one copy per
span is at least as fast as grouping, at every longer length too.

    python benchmarks/bench_spans.py [--mib 64] [--repeats 7]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from _timing import side_by_side

from kvarena.copy import CopyBatch, execute_batch
from kvarena.copy.executor import LARGE_SPAN_BYTES

LENGTHS_KIB = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def measure(length: int, total: int, repeats: int) -> dict[str, float]:
    n = max(4, total // length)
    gen = torch.Generator().manual_seed(length)
    src_buf = torch.randint(0, 256, (n * length,), dtype=torch.uint8, generator=gen)
    dst_buf = torch.ones(n * length, dtype=torch.uint8)
    rng = np.random.default_rng(length)
    src = rng.permutation(n) * length
    dst = rng.permutation(n) * length
    batch = CopyBatch(src, dst, np.full(n, length))
    flat = torch.ones_like(src_buf)
    t = side_by_side(
        {
            "each": lambda: execute_batch(batch, src_buf, dst_buf, large_span_bytes=1),
            "grouped": lambda: execute_batch(batch, src_buf, dst_buf, large_span_bytes=length + 1),
            "memcpy": lambda: flat.copy_(src_buf),
        },
        repeats,
        torch.device("cpu"),
    )
    assert torch.equal(dst_buf.view(n, length)[dst[0] // length], src_buf[src[0] : src[0] + length])
    gbps = {k: n * length / s / 1e9 for k, s in t.items()}
    return {**gbps, "each_x": t.speed("each", "memcpy"), "grouped_x": t.speed("grouped", "memcpy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.mib} MiB of "
        f"scattered spans, median of {args.repeats}; LARGE_SPAN_BYTES now "
        f"{LARGE_SPAN_BYTES >> 10} KiB"
    )
    header = (
        f"{'span':>8} {'one copy each':>14} {'grouped':>9} {'memcpy':>8} "
        f"{'each/memcpy':>12} {'grouped/memcpy':>15}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for kib in LENGTHS_KIB:
        g = measure(kib << 10, args.mib << 20, args.repeats)
        rows.append((kib, g))
        print(
            f"{kib:>5} KiB {g['each']:>9.2f} GB/s {g['grouped']:>9.2f} {g['memcpy']:>8.2f} "
            f"{g['each_x']:>11.2f}x {g['grouped_x']:>14.2f}x"
        )
    cross = next(
        (
            kib
            for i, (kib, _) in enumerate(rows)
            if all(g["each"] >= g["grouped"] for _, g in rows[i:])
        ),
        None,
    )
    print(f"crossover: {cross} KiB" if cross else "crossover: beyond the lengths measured")


if __name__ == "__main__":
    main()
