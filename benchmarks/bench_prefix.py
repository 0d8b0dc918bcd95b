"""Prefix cache on the shared trace: hit tokens by policy, and lookup/admission cost.

python benchmarks/bench_prefix.py [--tp 1] [--memory-gib 80] [--limit N]

Part 1 replays ../shared/traces/mooncake_synthetic_trace.jsonl (3,993 requests)
through the real prefix cache and pools in bookkeeping mode (allocators, keys,
lookups, evictions and boundary moves; no bytes) for Qwen3-Next-80B-A3B:
kvarena's policy beside vLLM's align policy at vLLM's unified block size, no
state reuse, the same KV without state, and the infinite-cache bound.

Part 2 measures lookup and admission (lookup, references, allocation,
restore, commit, finish) per request of a 1,024-block prompt against a cache
already holding 10k, 100k and 1M cached blocks: it should grow with the
prompt, not with the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvarena import ServingOptions, model_cache, plan_cache
from kvarena.prefix import CheckpointPolicy, PrefixCache
from kvarena.replay import ReplayConfig, compare, load_trace, replay
from kvarena.report import vllm_unification

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def part1(args: argparse.Namespace) -> None:
    trace = load_trace(TRACE, limit=args.limit)
    options = ServingOptions(tp=args.tp)
    m = model_cache("qwen3-next-80b-a3b", options)
    budget = args.memory_gib << 30
    v = vllm_unification(m, budget, args.max_seqs)
    vm = model_cache(
        "qwen3-next-80b-a3b", ServingOptions(tp=args.tp, block_size=v["attention_block_tokens"])
    )
    cfg = ReplayConfig(
        budget_bytes=budget, max_seqs=args.max_seqs, policy=CheckpointPolicy.parse(args.checkpoint)
    )
    rows = compare(m, trace, cfg, vllm_model=vm)
    if args.also:
        alt = replay(
            m,
            trace,
            ReplayConfig(
                budget_bytes=budget,
                max_seqs=args.max_seqs,
                policy=CheckpointPolicy.parse(args.also),
            ),
            label=f"kvarena ({args.also})",
        )
        rows.insert(1, alt)
    kv_only = next(r for r in rows if r.label.startswith("KV only"))
    print(
        f"{len(trace):,} requests, {sum(t.tokens.size for t in trace):,} prompt tokens; "
        f"Qwen3-Next-80B-A3B TP {args.tp}, {args.memory_gib} GiB, max seqs {args.max_seqs}"
    )
    header = (
        f"{'policy':<40} {'hit tokens':>12} {'hit %':>6} {'vs KV only':>10} {'lost tokens':>12} "
        f"{'images w/r':>12} {'evicted img':>11} {'admit µs':>9} {'wall s':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        d = r.to_dict()
        m_ = r.metrics
        print(
            f"{r.label:<40} {r.hit_tokens:>12,} {100 * d['hit_fraction']:>6.1f} "
            f"{r.hit_tokens / max(1, kv_only.hit_tokens):>9.2f}x {m_.get('lost_tokens', 0):>12,} "
            f"{m_.get('images_written', 0):>6,}/{m_.get('images_read', 0):<5,} "
            f"{m_.get('evicted_images', 0):>11,} {r.admission_us:>9,.0f} {r.wall_seconds:>7.1f}"
        )


def part2(args: argparse.Namespace) -> None:
    m = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=args.tp))
    bs = m.block_size
    prompt_blocks = 1024
    print(f"\nlookup + admission of a {prompt_blocks}-block ({prompt_blocks * bs:,}-token) prompt")
    header = (
        f"{'cached blocks':>14} {'lookup µs':>10} {'µs/block':>9} {'admit µs':>9} {'µs/block':>9}"
    )
    print(header)
    print("-" * len(header))
    for cached in (10_000, 100_000, 1_000_000):
        block = m.kv_bytes_per_token * bs
        slot = m.state_bytes
        budget = (cached + 8 * prompt_blocks) * block + 64 * slot * 2
        pc = PrefixCache(plan_cache(m, budget_bytes=budget, max_seqs=8), "meta")
        # Fill the cache with `cached` blocks of distinct prefixes (no images needed).
        chunk = 4096
        for i in range(-(-cached // chunk)):
            n = min(chunk, cached - i * chunk)
            toks = np.arange(n * bs, dtype=np.int64) + (i + 1) * (1 << 40)
            pc.admit(("fill", i), toks)
            pc.commit(("fill", i), toks.size)
            pc.finish(("fill", i))
        assert pc.cached_blocks >= cached
        probe = np.arange(prompt_blocks * bs + 1, dtype=np.int64) + (1 << 50)
        pc.admit("seed", probe)
        pc.commit("seed", probe.size)
        for b in pc.running("seed").checkpoints:
            pc.checkpoint("seed", b)
        pc.finish("seed")
        look, adm = [], []
        for rep in range(args.repeats):
            t = time.perf_counter()
            hit = pc.lookup(probe)
            look.append(time.perf_counter() - t)
            t = time.perf_counter()
            a = pc.admit(("probe", rep), probe)
            pc.commit(("probe", rep), probe.size)
            pc.finish(("probe", rep))
            adm.append(time.perf_counter() - t)
        assert hit.tokens == prompt_blocks * bs and a.hit.tokens == hit.tokens
        lk, ad = statistics.median(look) * 1e6, statistics.median(adm) * 1e6
        print(
            f"{cached:>14,} {lk:>10,.0f} {lk / prompt_blocks:>9.2f} {ad:>9,.0f} {ad / prompt_blocks:>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--memory-gib", type=int, default=80)
    parser.add_argument("--max-seqs", type=int, default=64)
    parser.add_argument("--checkpoint", default="end:512,interval:8192,branch")
    parser.add_argument(
        "--also", default="end,branch", help="another kvarena policy row ('' for none)"
    )
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-trace", action="store_true")
    args = parser.parse_args()
    if not args.skip_trace:
        if not TRACE.is_file():
            sys.exit(f"{TRACE} not found: run with ../shared beside the checkout")
        part1(args)
    part2(args)


if __name__ == "__main__":
    main()
