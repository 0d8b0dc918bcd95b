"""Prefix cache: hit tokens by checkpoint policy on several workloads, and admission cost.

python benchmarks/bench_prefix.py [--tp 8,1] [--workloads shared,system-prompt,...] [--jobs 2]

Part 1 replays each workload through the real prefix cache and pools in
bookkeeping mode (allocators, keys, lookups, evictions and boundary moves; no
bytes) for Qwen3-Next-80B-A3B in 80 GiB, max 64 sequences, at each TP:
``shared`` is ../shared/traces/mooncake_synthetic_trace.jsonl (3,993
requests), the others are generated (``benchmarks/_workloads.py``: a shared
system prompt with unique questions, multi-turn chats whose next turn
contains the previous prompt and output, documents read by many questions).
Side by side: kvarena's default policy, the previous default, a hand-tuned
policy (``end:512``: the trace's 512-token hash blocks, known to the tuner),
vLLM's align policy at vLLM's unified block size, clairvoyant placement
(images exactly where a later request could resume, known from the whole
trace: what placement alone can reach, :mod:`kvarena.replay.clairvoyant`),
the same KV with no state (KV only: the bound a policy is judged against)
and the infinite cache.

Part 2 measures lookup and admission (lookup, references, allocation,
restore, commit, finish) per request of a 1,024-block prompt against a cache
already holding 10k, 100k and 1M cached blocks: it should grow with the
prompt, not with the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
from _workloads import WORKLOADS, write_workload

from kvarena import ServingOptions, model_cache, plan_cache
from kvarena.models import ModelCache
from kvarena.models.vllm_pages import VllmPages
from kvarena.prefix import DEFAULT_POLICY, CheckpointPolicy, PrefixCache
from kvarena.replay import ReplayConfig, ReplayResult, load_trace, replay
from kvarena.replay.clairvoyant import clairvoyant_bound
from kvarena.replay.policies import infinite_bound

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
MODEL = "qwen3-next-80b-a3b"
POLICIES = {
    "default": DEFAULT_POLICY,
    "previous default": "end,interval:8192,branch",
    "hand-tuned": "end:512,interval:{interval},branch",
}
HAND_TUNED_INTERVAL = {1: 32768}
"""The hand-tuned interval by TP (8,192 elsewhere): the best of 8,192 / 16,384 / 32,768
on the shared trace."""


def _row(task: tuple[str, str, int, int, int, str]) -> tuple[str, ReplayResult]:
    """One replay: (trace path, row name, tp, budget, max seqs, policy or a row kind)."""
    path, name, tp, budget, max_seqs, policy = task
    trace = load_trace(Path(path))
    options = ServingOptions(tp=tp)
    model = model_cache(MODEL, options)
    cfg = ReplayConfig(budget_bytes=budget, max_seqs=max_seqs)
    if name == "vLLM align":
        v = VllmPages.of(model, budget, max_seqs)
        bs = v.attention_block_tokens if v else model.block_size
        vm = model_cache(MODEL, replace(options, block_size=bs))
        align = CheckpointPolicy(end=True, branch=False, learn=False)
        return name, replay(vm, trace, replace(cfg, policy=align), label=f"vLLM align ({bs})")
    if name == "clairvoyant":
        return name, clairvoyant_bound(model, trace, cfg)
    if name == "KV only":
        kv = ModelCache.from_fields(model.page_fields, [], block_size=model.block_size, name="kv")
        return name, replay(kv, trace, cfg, label="KV only (no state)")
    if name == "infinite":
        return name, infinite_bound(trace, model.block_size)
    pol = CheckpointPolicy.parse(policy)
    return name, replay(model, trace, replace(cfg, policy=pol), label=f"{name} ({policy})")


def part1(args: argparse.Namespace) -> None:
    budget = args.memory_gib << 30
    rows = [*POLICIES, "vLLM align", "clairvoyant", "KV only", "infinite"]
    with tempfile.TemporaryDirectory() as d, ProcessPoolExecutor(args.jobs) as pool:
        paths = {}
        for w in args.workloads.split(","):
            if w == "shared":
                if not TRACE.is_file():
                    sys.exit(f"{TRACE} not found: run with ../shared beside the checkout")
                paths[w] = str(TRACE)
            elif w in WORKLOADS:
                paths[w] = str(write_workload(w, Path(d) / f"{w}.jsonl", args.seed))
            else:
                sys.exit(f"unknown workload {w!r}; legal: shared, {', '.join(WORKLOADS)}")
        tps = [int(t) for t in args.tp.split(",")]
        tasks = [
            (
                paths[w],
                r,
                tp,
                budget,
                args.max_seqs,
                POLICIES.get(r, "").format(interval=HAND_TUNED_INTERVAL.get(tp, 8192)),
            )
            for w in paths
            for tp in tps
            for r in rows
        ]
        results = list(pool.map(_row, tasks))
    head = (
        f"{'policy':<52} {'hit tokens':>12} {'vs KV only':>10} {'lost tokens':>12} "
        f"{'images w/r':>13} {'admit µs':>9}"
    )
    i = 0
    for w in paths:
        for tp in tps:
            block = dict(results[i : i + len(rows)])
            i += len(rows)
            kv = block["KV only"].hit_tokens
            first = block["infinite"]
            print(
                f"\n{w}: {first.requests:,} requests, {first.prompt_tokens:,} prompt tokens; "
                f"TP {tp}, {args.memory_gib} GiB, max seqs {args.max_seqs}"
            )
            print(head)
            for r in block.values():
                m = r.metrics
                images = f"{m.get('images_written', 0):,}/{m.get('images_read', 0):,}"
                print(
                    f"{r.label:<52} {r.hit_tokens:>12,} {r.hit_tokens / max(1, kv):>9.3f}x "
                    f"{m.get('lost_tokens', 0):>12,} {images:>13} {r.admission_us:>9,.0f}"
                )


def part2(args: argparse.Namespace) -> None:
    tp = int(args.tp.split(",")[0])
    m = model_cache(MODEL, ServingOptions(tp=tp))
    bs = m.block_size
    prompt_blocks = 1024
    print(
        f"\nlookup + admission of a {prompt_blocks}-block ({prompt_blocks * bs:,}-token) "
        f"prompt, TP {tp}"
    )
    header = (
        f"{'cached blocks':>14} {'lookup µs':>10} {'µs/block':>9} {'admit µs':>9} {'µs/block':>9}"
    )
    print(header)
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
            f"{cached:>14,} {lk:>10,.0f} {lk / prompt_blocks:>9.2f} {ad:>9,.0f} "
            f"{ad / prompt_blocks:>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="8,1", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--memory-gib", type=int, default=80)
    parser.add_argument("--max-seqs", type=int, default=64)
    parser.add_argument("--workloads", default=",".join(["shared", *WORKLOADS]))
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated workloads")
    parser.add_argument("--jobs", type=int, default=2, help="replays run at once")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-trace", action="store_true", help="part 2 only")
    args = parser.parse_args()
    if not args.skip_trace:
        part1(args)
    part2(args)


if __name__ == "__main__":
    main()
