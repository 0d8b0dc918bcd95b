"""Inter-token latency of decoding requests while others load their prefixes.

.venv-vllm/bin/python benchmarks/bench_vllm_latency.py [--model llama|qwen3_next|both]
    [--decoding 4] [--arrivals 12] [--prompt 2048] [--delay-ms 2] [--rounds 1] [--json]

vLLM runs every request of a batch in one step: whatever a step waits for,
every decoding request waits for. Here ``--decoding`` requests decode (greedy,
``ignore_eos``) while ``--arrivals`` others arrive, one every few steps, whose
``--prompt``-token prefixes were saved by an earlier engine. vLLM's token
budget per step is 512 (:data:`BATCHED`). Rows, each a fresh
engine (in this process, so the connector's scheduler half is timed where it
runs):

- ``no arrivals``: the decoding requests alone (the floor, ``/alone``);
- ``arrivals computed``: the arrivals' prefixes held nowhere (vLLM computes them);
- ``arrivals held on device``: the same arrivals computed once before, so
  vLLM's own prefix cache serves them: the run with nothing loaded, the loads'
  rows' baseline (``/held``);
- ``a burst held on device``: the same, but every arrival reaches vLLM in the
  step the last one arrives, as a stuck store's do when it is released: the
  stuck store's baseline (``/burst``), what a burst of ready requests costs
  the batch with nothing loaded;
- ``loads from disk``: the prefixes only in a disk tier;
- ``loads from Redis +Nms``: the prefixes only in a Redis whose replies a
  loopback proxy delays by ``--delay-ms`` (a network's round trip);
- ``loads from a stuck Redis``: the same store with every reply held back
  until the last arrival is in: the worst a load can be.

Per row: the decoding requests' inter-token latency (p50, p99, max; each
token's time is when the step that made it returns) and its p99 against the
``no arrivals`` row; the arrivals' TTFT (p50) and tokens they hit; the
connector's scheduler time per step (lookups, step plans, reports: p50, max);
and for loads, the bytes per second of the tier reads against a plain read of
the same objects (the raw tier: files read whole, Redis GETs on the same
proxy). Every run's tokens are checked equal to the ``arrivals computed`` run
(vLLM alone's answer, the connector loading nothing).

One row's p99 is a few of its ~150 gaps: on two shared cores it moves by
±50% run to run. ``--rounds N`` runs every row N times (every other round in
reverse order, so a drifting machine weighs on every row alike); the table
pools the rounds' gaps, and a line per row gives each round's p99 against the
held row's of the same round.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler timed here

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _delay_proxy import ProxyProcess
from _host import host

BLOCK = {"llama": 32, "qwen3_next": None}  # qwen3_next: vLLM's unified block (256)
EVERY = 3  # steps between arrivals
KV_CACHE_BYTES = 64 << 20
BATCHED = 512
"""vLLM's token budget per step (``max_num_batched_tokens``), as a deployment that
bounds its inter-token latency sets it: prefills that become ready together
(loads that land in the same step, a stuck store released) are spread over
steps instead of run in one long one."""


def _engine(model: Path, block: int | None, tiers: list[str] | None):
    from vllm import LLM

    from kvarena.integrations.vllm import kv_transfer_config
    from kvarena.testing.vllm_engine import engine_args

    kw = {"kv_transfer_config": kv_transfer_config(tiers)} if tiers else {}
    return LLM(
        **engine_args(
            model,
            distributed_executor_backend="uni",
            block_size=block,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_num_batched_tokens=BATCHED,
            **kw,
        )
    )


def _close(llm) -> None:
    import gc

    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _timed_scheduler(llm) -> list[float]:
    """Wrap the connector's scheduler half: seconds it spends per step."""
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector
    spent: list[float] = []
    if connector is None:
        return spent
    side = connector._scheduler
    step = [0.0]
    for name in ("matched", "allocated", "reported", "loaded", "finished"):
        real = getattr(side, name)

        def timed(*a, _real=real, **k):
            t0 = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                step[0] += time.perf_counter() - t0

        setattr(side, name, timed)
    real_plan = side.plan

    def plan(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_plan(*a, **k)
        finally:
            spent.append(step[0] + time.perf_counter() - t0)
            step[0] = 0.0

    side.plan = plan
    return spent


def _reads(llm) -> list[tuple[int, float]]:
    """Wrap the worker's tier reads (each tier's ``get_many``): bytes and seconds."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    got: list[tuple[int, float]] = []
    for tier in get_kv_transfer_group()._worker.tiers.tiers:
        real = tier.get_many

        def timed(names, _real=real):
            t0 = time.perf_counter()
            out = _real(names)
            got.append((sum(len(x) for x in out if x is not None), time.perf_counter() - t0))
            return out

        tier.get_many = timed
    return got


def _run(
    llm, decoding: list[list[int]], arrivals: list[list[int]], proxy=None, burst: bool = False
) -> dict:
    """Decode, and send the arrivals once every decoding request has its first
    token (``proxy``: a stuck store's, held from the first arrival to the last;
    ``burst``: each arrival sent when the last arrives, its TTFT counted from
    when it arrived)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    spent = _timed_scheduler(llm)
    long = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=8, temperature=0)
    for i, p in enumerate(decoding):
        engine.add_request(f"d{i}", {"prompt_token_ids": p}, long)
    seen: dict[str, int] = {}
    times: dict[str, list[float]] = {}
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    steps = 0
    started = False
    while engine.has_unfinished_requests():
        if started and steps % EVERY == 0 and len(added) < len(arrivals):
            if not added and proxy is not None:
                proxy.hold()
            added[f"a{len(added)}"] = time.perf_counter()
            due = list(added)[-1:] if not burst else list(added)
            if len(added) == len(arrivals) or not burst:
                for rid in due:
                    engine.add_request(rid, {"prompt_token_ids": arrivals[int(rid[1:])]}, short)
            if len(added) == len(arrivals) and proxy is not None:
                proxy.release()
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            rid = o.request_id.split("-")[0]
            n = len(o.outputs[0].token_ids)
            if n > seen.get(rid, 0):
                seen[rid] = n
                times.setdefault(rid, []).append(now)
                if rid.startswith("a") and rid not in first:
                    first[rid] = now - added[rid]
            if o.finished:
                tokens[rid] = list(o.outputs[0].token_ids)
                cached[rid] = o.num_cached_tokens
        if not started and all(seen.get(f"d{i}", 0) >= 1 for i in range(len(decoding))):
            started = True
    # the decoding requests' gaps while arrivals came and were served
    window_end = max((added[r] + first[r] for r in first), default=float("inf"))
    gaps = []
    for i in range(len(decoding)):
        ts = times[f"d{i}"]
        gaps += [b - a for a, b in itertools.pairwise(ts) if b <= window_end + 0.05]
    return {
        "gaps": gaps,
        "ttft": [first[r] for r in sorted(first)],
        "hit": sum(cached.get(f"a{i}", 0) for i in range(len(arrivals))),
        "tokens": tokens,
        "sched": spent,
    }


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _raw_disk(directory: Path) -> float:
    files = sorted(directory.glob("*.kvi"))
    t0 = time.perf_counter()
    n = sum(len(f.read_bytes()) for f in files)
    return n / (time.perf_counter() - t0)


def _raw_redis(port: int, names: int) -> float:
    import redis

    client = redis.Redis(port=port)
    keys = client.keys("*")[:names]
    t0 = time.perf_counter()
    n = sum(len(client.get(k) or b"") for k in keys)
    client.close()
    return n / (time.perf_counter() - t0)


def bench(kind: str, args) -> list[dict]:
    from conftest import redis_binary

    from kvarena.integrations.transformers.tiny import save_tiny
    from kvarena.testing.redis_server import RedisServer

    rng = random.Random(5)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer(tmp, binary=redis_binary()) as server:
        model = save_tiny(kind, Path(tmp))
        block = BLOCK[kind]
        decoding = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(args.decoding)]
        arrivals = [
            [rng.randrange(3, 500) for _ in range(args.prompt)] for _ in range(args.arrivals)
        ]
        fresh = [[rng.randrange(3, 500) for _ in range(args.prompt)] for _ in range(args.arrivals)]
        disk = Path(tmp) / "disk"
        filler = _engine(model, block, [f"disk:{disk}:1GiB", server.url])
        from vllm import SamplingParams

        filler.generate(
            [{"prompt_token_ids": p} for p in arrivals],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )
        _close(filler)  # its writer flushed at close: every object on disk and in Redis
        runs = [
            ("no arrivals", None, []),
            ("arrivals computed", None, fresh),
            ("arrivals held on device", "device", arrivals),
            ("a burst held on device", "burst", arrivals),
            ("loads from disk", [f"disk:{disk}:1GiB"], arrivals),
            (f"loads from Redis +{args.delay_ms:g}ms", "redis", arrivals),
            ("loads from a stuck Redis", "stuck", arrivals),
        ]
        reference: dict[str, list[int]] | None = None
        pooled: dict[str, dict] = {
            label: {"gaps": [], "ttft": [], "sched": [], "reads": []} for label, _, _ in runs
        }
        p99s: dict[str, list[float]] = {label: [] for label, _, _ in runs}
        hits: dict[str, list[int]] = {label: [] for label, _, _ in runs}
        for round_ in range(args.rounds):
            # every other round in reverse, so a machine that drifts over a run
            # weighs on every row alike
            for label, tiers, arriving in runs if round_ % 2 == 0 else runs[::-1]:
                proxy = stuck = None
                if tiers in ("redis", "stuck"):
                    proxy = ProxyProcess(server.port, args.delay_ms / 1e3)
                    stuck = proxy if tiers == "stuck" else None
                    tiers = [f"redis://127.0.0.1:{proxy.port}"]
                on_device, burst = tiers in ("device", "burst"), tiers == "burst"
                if tiers in (None, "device", "burst"):  # holds nothing
                    empty = Path(tmp) / f"{label.replace(' ', '-')}-{round_}"
                    tiers = [f"disk:{empty}:1GiB"]
                llm = _engine(model, block, tiers)
                if on_device:  # computed once before: vLLM's own prefix cache holds them
                    llm.generate(
                        [{"prompt_token_ids": p} for p in arriving],
                        SamplingParams(max_tokens=1),
                        use_tqdm=False,
                    )
                reads = _reads(llm)
                got = _run(llm, decoding, arriving, proxy=stuck, burst=burst)
                _close(llm)
                if proxy is not None:
                    proxy.close()
                ds = {k: v for k, v in got["tokens"].items() if k.startswith("d")}
                if reference is None:
                    reference = ds
                assert ds == reference, f"{kind} {label}: the decoding requests' tokens changed"
                hits[label].append(got["hit"])
                for key in ("gaps", "ttft", "sched"):
                    pooled[label][key] += got[key]
                pooled[label]["reads"] += reads
                p99s[label].append(_pct(got["gaps"], 0.99))
        for label, _, _ in runs:
            got = pooled[label]
            read_bytes = sum(b for b, _ in got["reads"])
            read_s = sum(s for _, s in got["reads"])
            rows.append(
                {
                    "model": kind,
                    "row": label,
                    "itl_p50_ms": statistics.median(got["gaps"]) * 1e3,
                    "itl_p99_ms": _pct(got["gaps"], 0.99) * 1e3,
                    "itl_max_ms": max(got["gaps"]) * 1e3,
                    "ttft_p50_ms": statistics.median(got["ttft"]) * 1e3 if got["ttft"] else None,
                    "hit_tokens": min(hits[label]),  # the same each round, or the least
                    "hit_tokens_by_round": hits[label],
                    "sched_p50_us": statistics.median(got["sched"]) * 1e6,
                    "sched_max_us": max(got["sched"]) * 1e6,
                    "read_mb_s": read_bytes / read_s / 1e6
                    if label.startswith("loads") and read_s
                    else None,
                    "itl_p99_ms_by_round": [x * 1e3 for x in p99s[label]],
                }
            )
        proxy = ProxyProcess(server.port, args.delay_ms / 1e3)
        rows_raw = {"disk": _raw_disk(disk), "redis": _raw_redis(proxy.port, 4 * args.arrivals)}
        proxy.close()
        by_row = {r["row"]: r for r in rows}
        floor = by_row["no arrivals"]["itl_p99_ms"]
        held = by_row["arrivals held on device"]  # the same arrivals, nothing loaded
        burst = by_row["a burst held on device"]  # the same, all at once
        for r in rows:
            r["itl_p99_vs_alone"] = r["itl_p99_ms"] / floor
            r["itl_p99_vs_held"] = r["itl_p99_ms"] / held["itl_p99_ms"]
            r["itl_p99_vs_burst"] = r["itl_p99_ms"] / burst["itl_p99_ms"]
            for base, name in ((held, "held"), (burst, "burst")):
                r[f"itl_p99_vs_{name}_by_round"] = [
                    x / b
                    for x, b in zip(
                        r["itl_p99_ms_by_round"], base["itl_p99_ms_by_round"], strict=True
                    )
                ]
            raw = "disk" if "disk" in r["row"] else "redis" if "Redis" in r["row"] else None
            r["raw_mb_s"] = rows_raw[raw] / 1e6 if raw else None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["llama", "qwen3_next", "both"], default="both")
    ap.add_argument("--decoding", type=int, default=4)
    ap.add_argument("--arrivals", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--delay-ms", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="every row this many times, alternating; the table pools their tokens",
    )
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    kinds = ["llama", "qwen3_next"] if args.model == "both" else [args.model]
    rows = [r for kind in kinds for r in bench(kind, args)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(host())
    print(
        f"{args.decoding} decoding, {args.arrivals} arrivals of {args.prompt:,} tokens, "
        f"one every {EVERY} steps"
    )
    head = (
        f"{'model':<11}{'row':<26}{'ITL p50':>8}{'p99':>7}{'max':>7}{'p99/alone':>10}{'/held':>7}{'/burst':>7}"
        f"{'TTFT p50':>9}{'hit':>7}{'sched p50':>10}{'max':>8}{'read MB/s':>10}{'raw':>8}"
    )
    print(head + "\n" + "-" * len(head))

    def f(x, spec):
        return format(x, spec) if x is not None else "-"

    for r in rows:
        print(
            f"{r['model']:<11}{r['row']:<26}{r['itl_p50_ms']:>8.1f}{r['itl_p99_ms']:>7.1f}"
            f"{r['itl_max_ms']:>7.1f}{r['itl_p99_vs_alone']:>9.2f}x{r['itl_p99_vs_held']:>6.2f}x"
            f"{r['itl_p99_vs_burst']:>6.2f}x"
            f"{f(r['ttft_p50_ms'], '>9.1f')}"
            f"{r['hit_tokens']:>7,}{r['sched_p50_us']:>9.0f}µ{r['sched_max_us']:>7.0f}µ"
            f"{f(r['read_mb_s'], '>10.0f')}{f(r['raw_mb_s'], '>8.0f')}"
        )
    print("(ms; scheduler: the connector's time per step; raw: the same objects read plainly)")
    if args.rounds > 1:
        print(
            f"ITL p99 /held and /burst, round by round ({args.rounds} rounds, "
            "every other in reverse):"
        )
        for r in rows:
            by = "; ".join(
                ", ".join(f"{x:.2f}" for x in r[f"itl_p99_vs_{name}_by_round"])
                for name in ("held", "burst")
            )
            differ = len(set(r["hit_tokens_by_round"])) > 1
            hit = f"  (hit tokens by round: {r['hit_tokens_by_round']})" if differ else ""
            print(f"  {r['model']:<11}{r['row']:<26}{by}{hit}")


if __name__ == "__main__":
    main()
