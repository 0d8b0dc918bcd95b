"""vLLM alone vs vLLM + kvarena's connector, on a slice of the shared Mooncake trace.

.venv-vllm/bin/python benchmarks/bench_vllm.py [--requests 240] [--tokens-per-hash 32]
    [--model qwen3_next] [--device-kv 20MiB] [--max-out 8] [--decode-out 128]
    [--decode-rounds 12] [--bounds]

The trace's requests name their prompts by hash ids, one per 512-token block
shared between requests. Each hash id is expanded here into ``--tokens-per-hash``
token ids (drawn from a generator seeded by the id, below the model's
vocabulary), so prompts keep the trace's sharing at a length a CPU prefills in
seconds; outputs are capped at ``--max-out`` tokens. The requests run one at a
time, in trace order, through a tiny random model (``kvarena.integrations.transformers.tiny.SERVED``:
Qwen3-Next by default, Gated DeltaNet + attention) with a device KV budget
(``--device-kv``) far below the slice's history, so vLLM's own prefix cache
keeps little of it:

- vLLM alone (its device prefix cache);
- vLLM + kvarena, a host tier;
- vLLM + kvarena, a host tier and a disk tier.

Per row: prompt tokens computed, hit tokens (vLLM's ``num_cached_tokens``: the
device cache and the connector's loads together; the connector's share and
the deepest tier each load read), TTFT p50/p99, decode tokens/s (over the
requests that decoded), and whether every request's tokens equal vLLM alone's.
Then the TTFT of a shared 4,096-token prefix, cold and warm from the host
tier; decode tokens/s over 128-token outputs with the engines alive side by
side (``bench_vllm_decode.py``, in a process of its own: vLLM alone, vLLM with a
connector that does nothing, vLLM with kvarena; per round ratios); and
kvarena's own time inside the connector's per-step methods, timed in place.
The trace's engines run in this process (the ``uni`` executor), one after
another. ``--bounds`` runs no engine: it prints an attention-only model's
infinite-cache bound beside a hybrid's (256-token blocks) on the slice as
expanded here and at the trace's own scale (from the hash ids).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TRACE = (
    Path(__file__).resolve().parents[1].parent
    / "shared"
    / "traces"
    / "mooncake_synthetic_trace.jsonl"
)


def prompts(path: Path, n: int, per_hash: int, vocab: int, max_out: int):
    out = []
    with open(path) as f:
        for line in f:
            if len(out) >= n:
                break
            rec = json.loads(line)
            ids: list[int] = []
            for h in rec["hash_ids"]:
                rng = random.Random(h)
                ids += [rng.randrange(3, vocab) for _ in range(per_hash)]
            # The last hash block may be partial: keep the trace's length in proportion.
            keep = max(1, rec["input_length"] * per_hash // 512)
            out.append((ids[:keep], max(1, min(max_out, rec["output_length"]))))
    return out


def bound(work: list[tuple[list[int], int]], block: int) -> int:
    """The infinite cache's hit tokens: each prompt's longest block-aligned prefix
    (at most ``len - 1`` tokens) that an earlier prompt also began with."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for prompt, _ in work:
        k, limit = 0, (len(prompt) - 1) // block
        while k < limit and tuple(prompt[: (k + 1) * block]) in seen:
            k += 1
        total += k * block
        seen.update(tuple(prompt[: (b + 1) * block]) for b in range(len(prompt) // block))
    return total


def trace_bound(path: Path, n: int, block: int) -> tuple[int, int]:
    """The infinite cache's hit tokens over the first ``n`` requests at the trace's
    own scale (a hash id is 512 tokens), from the hash ids alone: each prompt's
    longest run of whole hash blocks an earlier prompt began with, at most
    ``len - 1`` tokens, rounded down to ``block`` (1: every token, an
    attention-only model with partial blocks); and the prompt tokens."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    with open(path) as f:
        for line in itertools.islice(f, n):
            rec = json.loads(line)
            ids, length = rec["hash_ids"], rec["input_length"]
            whole = length // 512
            k = 0
            while k < whole and tuple(ids[: k + 1]) in seen:
                k += 1
            hit += min(k * 512, length - 1) // block * block
            total += length
            seen.update(tuple(ids[: j + 1]) for j in range(whole))
    return hit, total


def engine(model: Path, device_kv: int, tiers: list[str] | None, max_len: int):
    from vllm import LLM

    from kvarena.integrations.vllm import kv_transfer_config
    from kvarena.testing.vllm_engine import engine_args

    kw = {}
    if tiers is not None:
        kw["kv_transfer_config"] = kv_transfer_config(tiers)
    return LLM(
        **engine_args(
            model,
            kv_cache_memory_bytes=device_kv,
            distributed_executor_backend="uni",
            max_model_len=max_len,
            disable_log_stats=False,
        ),
        **kw,
    )


def shut(llm) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
    llm.llm_engine.engine_core.shutdown()


def run(name: str, llm, work: list[tuple[list[int], int]]) -> dict:
    from vllm import SamplingParams

    tokens, ttft, rates, computed, cached = [], [], [], 0, 0
    for prompt, n_out in work:
        params = SamplingParams(max_tokens=n_out, temperature=0, detokenize=False, ignore_eos=True)
        start = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
        m = o.metrics
        first = m.first_token_latency if m is not None and m.first_token_latency else wall
        ttft.append(first)
        n = len(o.outputs[0].token_ids)
        if m is not None and n > 1 and m.last_token_ts > m.first_token_ts:
            rates.append((n - 1) / (m.last_token_ts - m.first_token_ts))
        tokens.append(list(o.outputs[0].token_ids))
        cached += o.num_cached_tokens
        computed += len(prompt) - o.num_cached_tokens
    row = {
        "run": name,
        "computed": computed,
        "hit": cached,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * sorted(ttft)[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "decode_tok_s": statistics.median(rates) if rates else float("nan"),
        "tokens": tokens,
    }
    try:  # the scheduler's half of the connector, in this process
        conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        row["connector_hit"] = conn._scheduler.telemetry.hit_tokens
        row["by_tier"] = dict(conn._scheduler.telemetry.hit_tokens_by_tier)
    except AttributeError:
        row["connector_hit"], row["by_tier"] = 0, {}
    return row


def shared_prefix(model: Path, device: int, prefix: int, repeats: int) -> dict:
    """TTFT of a prompt whose ``prefix`` tokens were computed before: cold (a
    new prefix), and warm from the host tier after ``reset_prefix_cache`` (so
    vLLM's device cache holds none of it); medians over ``repeats`` prefixes."""
    from vllm import SamplingParams

    llm = engine(model, device, ["host:2GiB"], prefix + 256)
    params = SamplingParams(max_tokens=1, temperature=0, detokenize=False, ignore_eos=True)
    cold, warm, same = [], [], True
    for r in range(repeats + 1):
        rng = random.Random(1000 + r)
        base = [rng.randrange(3, 500) for _ in range(prefix)]
        timed = []
        for tail in ([7, 8, 9], [11, 12, 13, 14]):
            start = time.perf_counter()
            o = llm.generate([{"prompt_token_ids": base + tail}], params, use_tqdm=False)[0]
            timed.append((time.perf_counter() - start, o.num_cached_tokens))
            llm.reset_prefix_cache()
        if r == 0:
            continue  # the first round warms the engine's kernels
        cold.append(timed[0][0])
        warm.append(timed[1][0])
        same = same and timed[1][1] >= prefix - 256
    shut(llm)
    c, w = statistics.median(cold), statistics.median(warm)
    return {"prefix": prefix, "cold_ms": 1e3 * c, "warm_ms": 1e3 * w, "ratio": w / c, "hit": same}


def decode_rate(model: Path, device: int, tiers: list[str] | None, out: int) -> float:
    """Median decode tokens/s of 8 unrelated 256-token prompts generating ``out``
    tokens each, one at a time (the first warms the engine and is not counted)."""
    from vllm import SamplingParams

    llm = engine(model, device, tiers, 256 + out + 16)
    params = SamplingParams(max_tokens=out, temperature=0, detokenize=False, ignore_eos=True)
    rates = []
    for r in range(9):
        rng = random.Random(5000 + r)
        prompt = [rng.randrange(3, 500) for _ in range(256)]
        o = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        if r and m is not None and n > 1 and m.last_token_ts > m.first_token_ts:
            rates.append((n - 1) / (m.last_token_ts - m.first_token_ts))
    shut(llm)
    return statistics.median(rates)


CONNECTOR_CALLS = (
    "build_connector_meta",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "clear_connector_metadata",
)
"""The connector methods vLLM calls in every step, scheduler and worker side."""


class ConnectorClock:
    """Wall time spent inside the connector's per-step methods (both halves run in
    this process): what kvarena itself adds to a decode step, measured directly
    instead of read off a tokens/s difference that the machine's noise swamps."""

    def __init__(self) -> None:
        from kvarena.integrations.vllm.connector import KvarenaConnector

        self.cls, self.seconds, self.steps, self.saved = KvarenaConnector, 0.0, 0, {}

    def __enter__(self) -> ConnectorClock:
        for name in CONNECTOR_CALLS:
            f = self.saved[name] = getattr(self.cls, name)
            setattr(self.cls, name, self._timed(f, name == "build_connector_meta"))
        return self

    def _timed(self, f, step: bool):
        def call(conn, *a, **k):
            t = time.perf_counter()
            try:
                return f(conn, *a, **k)
            finally:
                self.seconds += time.perf_counter() - t
                self.steps += step

        return call

    def __exit__(self, *exc) -> None:
        for name, f in self.saved.items():
            setattr(self.cls, name, f)


def connector_time(model: Path, device: int, out: int) -> dict:
    """kvarena's own time in each engine step of a decode (a host tier), and its
    share of the step."""
    with ConnectorClock() as clock:
        rate = decode_rate(model, device, ["host:2GiB"], out)
    per_step = clock.seconds / max(1, clock.steps)
    return {"tok_s": rate, "us_per_step": 1e6 * per_step, "share": per_step * rate}


def side_by_side(model_kind: str, device_kv: str, out: int, rounds: int) -> dict:
    """``bench_vllm_decode.py``'s engines side by side (vLLM alone, a connector that
    does nothing, kvarena), run in a process of its own: it needs vLLM's
    multiprocessing mode, which this process has turned off."""
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("bench_vllm_decode.py")),
        "--json",
        f"--model={model_kind}",
        f"--device-kv={device_kv}",
        f"--out={out}",
        f"--rounds={rounds}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    # vLLM logs to stdout too: the result is the last line that is a JSON object.
    last = [line for line in done.stdout.splitlines() if line.startswith("{")][-1]
    return json.loads(last)


def print_bounds(trace: Path, n: int, per_hash: int) -> None:
    """An attention-only model's bound (every token but the last of a shared
    prefix) beside a hybrid's (256-token blocks, vLLM's unified block for the
    tiny Qwen3-Next), on the slice as this benchmark expands it and at the
    trace's own scale."""
    from kvarena.integrations.transformers.tiny import SERVED_COMMON

    work = prompts(trace, n, per_hash, SERVED_COMMON["vocab_size"], 1)
    print(f"first {n} requests of {trace.name}; hit tokens of an infinite cache")
    print(
        f"{'scale':<28} {'prompt tokens':>14} {'attention-only':>15} {'hybrid (256)':>13} {'ratio':>6}"
    )
    rows = [
        (
            f"{per_hash} tokens a hash id",
            sum(len(p) for p, _ in work),
            bound(work, 1),
            bound(work, 256),
        )
    ]
    for m in sorted({n, 3993}):
        (att, total), (hyb, _) = trace_bound(trace, m, 1), trace_bound(trace, m, 256)
        rows.append((f"512 tokens a hash id, {m:,}", total, att, hyb))
    for label, total, att, hyb in rows:
        print(f"{label:<28} {total:>14,} {att:>15,} {hyb:>13,} {hyb / max(att, 1):>6.3f}")


def main() -> None:
    from kvarena.checks import parse_bytes
    from kvarena.integrations.transformers.tiny import SERVED, SERVED_COMMON, save_tiny

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--tokens-per-hash", type=int, default=32)
    ap.add_argument("--model", default="qwen3_next", choices=sorted(SERVED))
    ap.add_argument("--device-kv", default="20MiB")
    ap.add_argument("--max-out", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=4096, help="the shared-prefix TTFT row's prefix")
    ap.add_argument("--decode-out", type=int, default=128, help="the decode rows' output tokens")
    ap.add_argument("--decode-rounds", type=int, default=12, help="side-by-side decode rounds")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--bounds",
        action="store_true",
        help="print the hybrid's and an attention-only model's bounds alone (no engine)",
    )
    args = ap.parse_args()
    if args.bounds:
        print_bounds(Path(args.trace), args.requests, args.tokens_per_hash)
        return

    work_dir = Path(tempfile.mkdtemp(prefix="kvarena-bench-vllm-"))
    model = save_tiny(args.model, work_dir)
    work = prompts(
        Path(args.trace),
        args.requests,
        args.tokens_per_hash,
        SERVED_COMMON["vocab_size"],
        args.max_out,
    )
    history = sum(len(p) for p, _ in work)
    max_len = max(len(p) + n for p, n in work) + 64
    device = parse_bytes(args.device_kv)
    runs = [
        ("vLLM alone", None),
        ("vLLM + kvarena host", ["host:2GiB"]),
        ("vLLM + kvarena host+disk", ["host:64MiB", f"disk:{work_dir / 'disk'}:4GiB"]),
    ]
    rows = []
    block = device_tokens = 0
    for name, tiers in runs:
        llm = engine(model, device, tiers, max_len)
        cc = llm.llm_engine.vllm_config.cache_config
        block = cc.block_size
        device_tokens = (cc.num_gpu_blocks or 0) * block
        rows.append(run(name, llm, work))
        shut(llm)
    limit = bound(work, block)
    warm = shared_prefix(model, device, args.prefix, 3)
    own = connector_time(model, device, args.decode_out)
    decode = side_by_side(args.model, args.device_kv, args.decode_out, args.decode_rounds)
    ref = rows[0]["tokens"]
    for r in rows:
        r["identical"] = r.pop("tokens") == ref
    if args.json:
        print(
            json.dumps(
                {
                    "requests": len(work),
                    "prompt_tokens": history,
                    "bound_hit": limit,
                    "device_tokens": device_tokens,
                    "rows": rows,
                    "warm": warm,
                    "connector_time": own,
                    "decode": decode,
                },
                indent=1,
            )
        )
        return
    print(
        f"{len(work)} requests of {args.trace} ({args.tokens_per_hash} tokens per hash id), "
        f"{history:,} prompt tokens, tiny {args.model}, device KV {args.device_kv} = "
        f"{device_tokens:,} tokens (1/{history / max(1, device_tokens):.1f} of the history)"
    )
    print(
        f"{'run':26} {'computed':>9} {'hit':>8} {'kvarena':>8} {'x alone':>8} "
        f"{'TTFT p50':>9} {'p99':>8} {'decode t/s':>10}  identical  tiers"
    )
    base_hit = max(1, rows[0]["hit"])
    for r in rows:
        print(
            f"{r['run']:26} {r['computed']:>9,} {r['hit']:>8,} {r['connector_hit']:>8,} "
            f"{r['hit'] / base_hit:>8.2f} {r['ttft_p50_ms']:>7.1f}ms {r['ttft_p99_ms']:>6.1f}ms "
            f"{r['decode_tok_s']:>10.1f}  {'yes' if r['identical'] else 'NO':9}  {r['by_tier']}"
        )
    print(
        f"{'infinite cache (bound)':26} {history - limit:>9,} {limit:>8,} {'':>8} "
        f"{limit / base_hit:>8.2f}   ({block}-token blocks; kvarena reaches "
        f"{rows[1]['hit'] / max(1, limit):.2f} of it, vLLM alone {rows[0]['hit'] / max(1, limit):.2f})"
    )

    print(
        f"shared prefix of {warm['prefix']:,} tokens, TTFT: cold {warm['cold_ms']:.1f} ms, "
        f"warm from the host tier {warm['warm_ms']:.1f} ms ({warm['ratio']:.2f}x cold; "
        f"hit {'yes' if warm['hit'] else 'NO'})"
    )
    over = decode["over_alone"]
    print(
        f"decode of {decode['out']} tokens after a {decode['prompt']}-token prompt, engines "
        f"side by side, {decode['rounds']} rounds (benchmarks/bench_vllm_decode.py; per round "
        f"ratios, medians): vLLM alone {decode['tok_s']['alone']:.1f} t/s; a connector that "
        f"does nothing {over['noop']['median']:.3f}x alone; kvarena "
        f"{over['kvarena']['median']:.3f}x alone ({decode['over_noop']['kvarena']['median']:.3f}x "
        f"the no-op connector); kvarena with alone's core binding "
        f"({decode['bound_by']}) {over['kvarena_bound']['median']:.3f}x alone"
    )
    print(
        f"kvarena's own time in the connector's per-step methods: {own['us_per_step']:.0f} µs "
        f"a step = {100 * own['share']:.2f}% of a decode step at {own['tok_s']:.1f} t/s"
    )


if __name__ == "__main__":
    main()
