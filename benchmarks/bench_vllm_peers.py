"""vLLM alone, with kvarena, and with LMCache: the same prompts, side by side.

.venv-vllm/bin/python benchmarks/bench_vllm_peers.py [--model llama|qwen3_next|both]
    [--docs 8] [--questions 8] [--lmcache-python .venv-lmcache/bin/python] [--json]

Every engine is a ``vllm serve`` process alive at once, driven over HTTP as a
client drives it (streamed completions: each token's time is seen): vLLM
alone; vLLM with kvarena's connector over a host tier; vLLM with LMCache 0.5.6
in its multiprocess mode (its own server process on loopback, the connector
vLLM ships, ``LMCacheMPConnector``), which runs here for attention-only models
only (``../shared/reference/lmcache_cpu_facts.md``): for a hybrid model, and
where LMCache's environment is not there, its rows are left out with the
reason printed. The connector engines get vLLM alone's core binding
(``VLLM_CPU_NUM_OF_RESERVED_CPU=1``), every engine the same device KV budget.

The workload: ``--docs`` documents of 1,024 tokens, each asked ``--questions``
questions of 64 tokens (prompts share their document), sent one at a time,
the engines in turn, the order turning request by request so no engine meets
the machine's slow minutes alone. Two passes, each engine's device cache reset
before the second: pass 2's hits come from the tiers alone. Per engine: pass
2's hit tokens (the server's ``cached_tokens``), TTFT p50/p99 and request
latency p50/p99 of pass 2 (every request of it is tier-served where the engine
has tiers), and whether every output equals vLLM alone's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from _host import host

ROOT = Path(__file__).resolve().parents[1]
DOC, QUESTION, OUT = 1024, 64, 16
DEVICE_KV = 8 << 20  # every engine's KV cache: small enough that pass 1 evicts
PAUSE_S = 1.0
"""Between requests: longer than the engine just used keeps the cores after its
answer (its OpenMP workers spin before they sleep), so the next engine has
them. Measured with two servers on this 2-core machine: at 0.3 s, one request
in four met a stall of 200-700 ms (the engine before it still spinning on the
cores its threads are bound to), for every engine alike; at 1 s, none."""
PEER_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1"}


def p99(values: list[float]) -> float:
    """The 99th percentile, linearly between the two samples around it."""
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def _prompts(docs: int, questions: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(docs):
        doc = [rng.randrange(3, 500) for _ in range(DOC)]
        out += [doc + [rng.randrange(3, 500) for _ in range(QUESTION)] for _ in range(questions)]
    return out


def _stream(url: str, model: str, prompt: list[int]) -> dict:
    """One streamed completion: its tokens, TTFT, latency and cached tokens."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": OUT,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    tokens: list[int] = []
    first = cached = None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - t0
                tokens += ids
            usage = chunk.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens") or 0
    return {
        "tokens": tokens,
        "ttft": first,
        "latency": time.perf_counter() - t0,
        "cached": cached or 0,
    }


class LMCacheServer:
    """LMCache's multiprocess server on loopback (its own process)."""

    def __init__(self, python: str, log: Path) -> None:
        from kvarena.testing.vllm_server import free_port

        self.port, http = free_port(), free_port()
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [
                python,
                "-m",
                "lmcache.v1.multiprocess.http_server",
                *("--host", "127.0.0.1", "--port", str(self.port)),
                *("--http-host", "127.0.0.1", "--http-port", str(http)),
                *("--chunk-size", "64", "--l1-size-gb", "0.5"),
                *("--supported-transfer-mode", "auto", "--max-workers", "1"),
                *("--eviction-policy", "LRU"),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **PEER_ENV},
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"LMCache's server exited: {log.read_text()[-2000:]}")
            try:
                httpx.get(f"http://127.0.0.1:{http}/", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("LMCache's server did not come up in 120 s")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


def _servers(kind: str, model: Path, tmp: Path, lmcache_python: str | None) -> tuple[dict, list]:
    """Every engine's server (name -> VllmServer), and what else must be stopped;
    where one fails to start, those started before it are stopped too."""
    servers: dict = {}
    extra: list = []
    try:
        _start(servers, extra, kind, model, tmp, lmcache_python)
    except BaseException:
        for s in servers.values():
            s.stop(signal.SIGKILL)
        for e in extra:
            e.stop()
        raise
    return servers, extra


def _start(
    servers: dict, extra: list, kind: str, model: Path, tmp: Path, lmcache_python: str | None
) -> None:
    from kvarena.testing.vllm_server import VllmServer

    block = 32 if kind == "llama" else None
    dev = {"VLLM_SERVER_DEV_MODE": "1"}  # its /reset_prefix_cache
    bound = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    common = {"block_size": block, "kv_cache_memory_bytes": DEVICE_KV}
    details = ("--enable-prompt-tokens-details",)
    servers["vLLM alone"] = VllmServer(model, tmp / "alone.log", options=details, env=dev, **common)
    servers["kvarena"] = VllmServer(
        model,
        tmp / "kvarena.log",
        kv_transfer_config={
            "kv_connector": "KvarenaConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tiers": ["host:512MiB"]},
        },
        options=details,
        env={**dev, **bound},
        **common,
    )
    if lmcache_python is not None and kind == "llama":
        cache = LMCacheServer(lmcache_python, tmp / "lmcache-server.log")
        extra.append(cache)
        servers["LMCache"] = VllmServer(
            model,
            tmp / "lmcache.log",
            kv_transfer_config={
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://127.0.0.1",
                    "lmcache.mp.port": cache.port,
                },
            },
            options=details,
            env={**dev, **bound, **PEER_ENV},
            python=lmcache_python,
            **common,
        )


def bench(kind: str, args) -> tuple[list[dict], list[str]]:
    from kvarena.integrations.transformers.tiny import save_tiny

    notes: list[str] = []
    lmcache = args.lmcache_python if Path(args.lmcache_python).exists() else None
    if lmcache is None:
        notes.append(f"LMCache left out: no {args.lmcache_python} (its own environment)")
    elif kind != "llama":
        notes.append(
            f"LMCache left out for {kind}: its CPU path refuses more than one KV cache "
            "group, which every hybrid model has (lmcache_cpu_facts.md)"
        )
    prompts = _prompts(args.docs, args.questions)
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        model = save_tiny(kind, tmp)
        servers, extra = _servers(kind, model, tmp, lmcache)
        names = list(servers)
        results: dict[str, list[list[dict]]] = {n: [[], []] for n in names}
        try:
            for p in range(2):
                if p == 1:
                    for s in servers.values():
                        httpx.post(s.url + "/reset_prefix_cache", timeout=60).raise_for_status()
                for i, prompt in enumerate(prompts):
                    turn = names[i % len(names) :] + names[: i % len(names)]
                    for n in turn:
                        time.sleep(PAUSE_S)
                        results[n][p].append(_stream(servers[n].url, str(model), prompt))
        finally:
            for s in servers.values():
                s.stop(signal.SIGTERM)
            for e in extra:
                e.stop()
    reference = [r["tokens"] for r in results["vLLM alone"][0]]
    rows = []
    for n in names:
        second = results[n][1]
        ttft = sorted(r["ttft"] for r in second)
        lat = sorted(r["latency"] for r in second)
        same = all([r["tokens"] for r in results[n][p]] == reference for p in range(2))
        rows.append(
            {
                "model": kind,
                "engine": n,
                "hit_tokens": sum(r["cached"] for r in second),
                "ttft_p50_ms": statistics.median(ttft) * 1e3,
                "ttft_p99_ms": p99(ttft) * 1e3,
                "latency_p50_ms": statistics.median(lat) * 1e3,
                "latency_p99_ms": p99(lat) * 1e3,
                "identical": same,
            }
        )
    return rows, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["llama", "qwen3_next", "both"], default="both")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--lmcache-python", default=str(ROOT / ".venv-lmcache" / "bin" / "python"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    kinds = ["llama", "qwen3_next"] if args.model == "both" else [args.model]
    rows, notes = [], []
    for kind in kinds:
        r, n = bench(kind, args)
        rows += r
        notes += n
    if args.json:
        print(json.dumps({"host": host(), "rows": rows, "notes": notes}, indent=2))
        return
    print(host())
    print(
        f"{args.docs} documents x {args.questions} questions, {DOC + QUESTION:,}-token prompts, "
        f"{OUT} tokens out; pass 2 after each engine's device cache was reset"
    )
    head = (
        f"{'model':<11}{'engine':<12}{'hit tokens':>11}{'TTFT p50':>10}{'p99':>8}"
        f"{'request p50':>12}{'p99':>8}{'identical':>10}"
    )
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['model']:<11}{r['engine']:<12}{r['hit_tokens']:>11,}{r['ttft_p50_ms']:>10.1f}"
            f"{r['ttft_p99_ms']:>8.1f}{r['latency_p50_ms']:>12.1f}{r['latency_p99_ms']:>8.1f}"
            f"{'yes' if r['identical'] else 'NO':>10}"
        )
    print("(ms)")
    for n in notes:
        print(n)


if __name__ == "__main__":
    main()
