"""Move the PAGE/STATE boundary across a region full of live blocks.

A unified cache for Qwen3-Next-80B-A3B at TP 8 (attention KV blocks of 16
tokens over its 12 full-attention layers; Gated DeltaNet states) is filled
with live blocks, the lower half then freed, and STATE grown across the live
top half: every live block there relocates below the new boundary, one
contiguous copy each. Prints relocated GB/s (the whole grow_state, bookkeeping
included) next to a plain memcpy of the same bytes and the
per-layer loop (one copy per field per layer per block), and the copies issued.

    python benchmarks/bench_boundary.py [--budget-mib 1024] [--grow 64] [--repeats 5]
        [--fixed-blocks 200000]

A last line times the move's fixed cost: one slot grown in a cache of many
small blocks, a handful relocated.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _timing import CACHE_FLUSH_BYTES, filled, flush_caches, plain_copy

from kvarena import EntryField, ModelCache, UnifiedCache, plan_cache
from kvarena.models import ServingOptions, model_cache


def _filled_cache(budget: int, pattern: str) -> UnifiedCache:
    model = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=8))
    cache = UnifiedCache.from_plan(plan_cache(model, budget_bytes=budget, max_seqs=8), "cpu")
    blocks = cache.blocks.allocate(cache.num_blocks)
    for b in blocks:
        cache.block_bytes_of(b).fill_(b % 251)
    # "halves": the lower half free, so live blocks move as one run; "interleaved":
    # every other block free, so no two moved blocks are adjacent on both sides.
    freed = blocks[: len(blocks) // 2] if pattern == "halves" else blocks[::2]
    for b in freed:
        cache.blocks.release(b)
    return cache


def one_round(
    budget: int, grow: int, pattern: str, scratch: torch.Tensor, turn: int
) -> tuple[float, float, float, int, int, int]:
    """Seconds of (the move, a memcpy of its bytes, the per-layer loop of the same
    relocations), bytes, copies, blocks. Each method on its own freshly filled
    buffers, after the caches are flushed (none reads bytes its set-up left in
    L3), in an order that rotates with ``turn`` (none always runs first)."""
    cache, other = _filled_cache(budget, pattern), _filled_cache(budget, pattern)
    # The moves are known before any byte moves (no block is evictable here, so
    # each live block takes the lowest free one below the new boundary); the
    # loop replays them, and the move's own remap is checked against them.
    kept, _, _, live = cache.plan_grow_state(grow)
    pairs = list(zip(live, cache.blocks.free_blocks_below(kept)[: len(live)], strict=True))
    n = len(live) * cache.block_stride
    cpu = torch.device("cpu")
    src, dst = filled(max(1, n), 7, cpu), filled(max(1, n), 1, cpu)
    views = [other.page_view(f.name) for f in other.page_fields]
    seconds: dict[str, float] = {}
    result: list = []

    def move() -> None:
        result.append(cache.grow_state(grow))

    def memcpy() -> None:
        plain_copy(dst, src)

    def loop() -> None:
        # The per-layer way: every moved block's every field, one layer at a time.
        for old, new in pairs:
            for v in views:
                for layer in range(v.shape[0]):
                    v[layer, new].copy_(v[layer, old])

    order = [("move", move), ("memcpy", memcpy), ("loop", loop)]
    for name, fn in order[turn % 3 :] + order[: turn % 3]:
        flush_caches(scratch)
        start = time.perf_counter()
        fn()
        seconds[name] = time.perf_counter() - start
    done = result[0]
    assert done.block_remap == dict(pairs), "the move relocated other blocks than planned"
    for old, new in list(done.block_remap.items())[:: max(1, len(done.block_remap) // 16)]:
        assert bool((cache.block_bytes_of(new) == old % 251).all()), (old, new)
        assert bool((other.block_bytes_of(new) == old % 251).all()), (old, new)
    assert done.copied_bytes == n, (done.copied_bytes, n)
    return (
        seconds["move"],
        seconds["memcpy"],
        seconds["loop"],
        done.copied_bytes,
        done.copies,
        len(done.block_remap),
    )


def fixed_cost(blocks: int, repeats: int) -> tuple[int, int, float]:
    """(blocks in the cache, blocks relocated, median ms) of growing STATE by one
    slot in a cache of about ``blocks`` small blocks whose lower half is free:
    the part of a boundary move that is bookkeeping, whatever the cache size."""
    page = [EntryField("k", 1, (64,), torch.uint8)]
    state = [EntryField("s", 1, (4096,), torch.uint8)]
    model = ModelCache.from_fields(page, state, block_size=16)
    seconds, moved = [], 0
    slots = 2 * 4096 * (repeats + 2)
    stride = plan_cache(model, budget_bytes=1 << 20, max_seqs=2, clamp=False).block_stride
    for _ in range(repeats):
        plan = plan_cache(model, budget_bytes=blocks * stride + slots, max_seqs=2, clamp=False)
        cache = UnifiedCache.from_plan(plan, "cpu")
        live = cache.blocks.allocate(cache.num_blocks)
        for b in live[: len(live) // 2]:
            cache.blocks.release(b)
        start = time.perf_counter()
        move = cache.grow_state(1)
        seconds.append(time.perf_counter() - start)
        moved = len(move.block_remap)
    return cache.num_blocks, moved, statistics.median(seconds) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--grow", type=int, default=64, help="state slots to add")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--fixed-blocks", type=int, default=200_000, help="cache size for the fixed-cost line"
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, cpu, budget {args.budget_mib} MiB, grow STATE by {args.grow} slots"
    )
    header = (
        f"{'free pattern':<13} {'blocks moved':>12} {'copies':>7} {'MiB':>7} "
        f"{'move GB/s':>10} {'loop GB/s':>10} {'memcpy GB/s':>12} {'move/memcpy':>12} "
        f"{'move/loop':>10}"
    )
    print(header)
    print("-" * len(header))
    scratch = torch.zeros(CACHE_FLUSH_BYTES, dtype=torch.uint8)
    one_round(64 << 20, 2, "interleaved", scratch, 0)  # first-call costs untimed
    for pattern in ("halves", "interleaved"):
        rounds = [
            one_round(args.budget_mib << 20, args.grow, pattern, scratch, turn)
            for turn in range(args.repeats)
        ]
        move_s, mem_s, loop_s = (statistics.median(r[i] for r in rounds) for i in range(3))
        # Ratios pair the methods of one round (see benchmarks/_timing.py).
        vs_mem = statistics.median(r[1] / r[0] for r in rounds)
        vs_loop = statistics.median(r[2] / r[0] for r in rounds)
        nbytes, copies, blocks = rounds[0][3], rounds[0][4], rounds[0][5]
        print(
            f"{pattern:<13} {blocks:>12} {copies:>7} {nbytes / 2**20:>7.1f} "
            f"{nbytes / move_s / 1e9:>10.2f} {nbytes / loop_s / 1e9:>10.2f} "
            f"{nbytes / mem_s / 1e9:>12.2f} {vs_mem:>11.2f}x {vs_loop:>9.2f}x"
        )
    fixed_cost(1000, 1)  # untimed first call
    total, moved, ms = fixed_cost(args.fixed_blocks, args.repeats)
    print(
        f"fixed cost: STATE grown by 1 slot in a cache of {total:,} blocks, "
        f"{moved} live blocks relocated: {ms:.2f} ms (median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
