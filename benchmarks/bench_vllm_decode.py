"""Decode tokens/s: vLLM alone, with a connector that does nothing, with kvarena.

.venv-vllm/bin/python benchmarks/bench_vllm_decode.py [--model qwen3_next] [--rounds 16]
    [--out 128] [--prompt 256] [--control] [--json]

Whole engines run one after another differ by more than a connector costs (on
2 shared cores, alternating engine pairs measured 0.83-1.59x of each other with
the same code): a slow minute falls on one engine and not the other. Here every
engine is alive at once, each with its engine core and worker in processes of
their own (vLLM's multiprocessing mode, so one engine's connector is no other's),
and each round sends one request to each, with the same prompt, in an order
that turns round by round, a pause between requests so the previous engine's
worker threads have gone back to sleep. Each round's ratios (output tokens/s
from the first token to the last) are taken under the same minute of the
machine; the row is their median.

The engines: vLLM alone; vLLM with ``noop_connector.py``'s (beside it)
connector, which does nothing, so what vLLM itself does for any connector is
measured apart; vLLM with kvarena's connector over a host tier; and kvarena
again with the CPU cores bound as vLLM alone binds them. vLLM's CPU platform
reserves one core per rank for the engine core and, once any KV connector is
configured, one more (``vllm/utils/ompmultiprocessing.py``: "for nixl_connector
under p/d case"); on a machine with no more cores than that it reserves none, and
the worker's OpenMP threads then share every core with the engine core's
polling loop. ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vLLM's own override) gives the
connector's engine vLLM alone's binding. ``--control`` adds a second vLLM
alone: how far from 1.00 the setup puts two identical engines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Set before vLLM is imported: one engine-core process per engine.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
# The no-op connector lives beside this file; vLLM's engine-core process
# imports it by module path, so the folder goes on that process's path too.
HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)

PAUSE_S = 0.3
"""Between requests: longer than the OpenMP workers of the engine just used
spin before they sleep (GNU OpenMP: a few ms; Intel's KMP_BLOCKTIME: 200 ms)."""


ENGINES = {
    "alone": "vLLM alone",
    "noop": "vLLM + a connector that does nothing",
    "kvarena": "vLLM + kvarena (host tier)",
    "kvarena_bound": "vLLM + kvarena, alone's core binding",
    "alone2": "a second vLLM alone (control)",
}

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BOUND = "1"
"""The cores vLLM alone reserves at one rank: the engine core's."""


def engine(model: Path, device_kv: int, which: str, max_len: int):
    """One engine. Its engine-core and worker processes read the environment when
    they start, so a binding set here for one engine is that engine's alone."""
    from noop_connector import noop_transfer_config
    from vllm import LLM

    from kvarena.integrations.vllm import kv_transfer_config
    from kvarena.testing.vllm_engine import engine_args

    kw: dict = {}
    if which.startswith("kvarena"):
        kw["kv_transfer_config"] = kv_transfer_config(["host:2GiB"])
    elif which == "noop":
        kw["kv_transfer_config"] = noop_transfer_config()
    before = os.environ.get(RESERVED)
    if which == "kvarena_bound":
        os.environ[RESERVED] = BOUND
    try:
        return LLM(
            **engine_args(
                model,
                kv_cache_memory_bytes=device_kv,
                max_model_len=max_len,
                disable_log_stats=False,
            ),
            **kw,
        )
    finally:
        if before is None:
            os.environ.pop(RESERVED, None)
        else:
            os.environ[RESERVED] = before


def rate(llm, prompt: list[int], out: int) -> float:
    """Output tokens/s of one request, from its first token to its last."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=out, temperature=0, detokenize=False, ignore_eos=True)
    o = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    m, n = o.metrics, len(o.outputs[0].token_ids)
    if m is None or n < 2 or m.last_token_ts <= m.first_token_ts:
        raise RuntimeError(f"request metrics missing or empty ({n} tokens): cannot time decode")
    return (n - 1) / (m.last_token_ts - m.first_token_ts)


def measure(
    model: Path, *, rounds: int, out: int, prompt_len: int, device_kv: int, control: bool = False
) -> dict:
    """Every engine up at once, one request to each per round in an order that
    turns round by round (so none always follows the same one); per round each
    engine's rate over vLLM alone's and over the no-op connector's, and their
    medians. ``control``: a second vLLM alone as well (an A/A check of the setup)."""
    names = ["alone", "noop", "kvarena", "kvarena_bound"] + (["alone2"] if control else [])
    max_len = prompt_len + out + 16
    llms = {}
    try:
        for name in names:
            llms[name] = engine(model, device_kv, name, max_len)
        vocab = llms["alone"].llm_engine.model_config.get_vocab_size()
        warm = [random.Random(-1).randrange(3, vocab) for _ in range(prompt_len)]
        for llm in llms.values():
            rate(llm, warm, out)  # first requests: warm-up, not counted
        rates: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            rng = random.Random(7000 + r)
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            turn = r % len(names)
            for name in names[turn:] + names[:turn]:
                time.sleep(PAUSE_S)
                rates[name].append(rate(llms[name], prompt, out))
    finally:
        for llm in llms.values():
            llm.llm_engine.engine_core.shutdown()

    def ratios(a: str, b: str) -> dict:
        rs = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
        q = statistics.quantiles(rs, n=4)
        return {"median": statistics.median(rs), "q1": q[0], "q3": q[2], "all": rs}

    return {
        "rounds": rounds,
        "bound_by": f"{RESERVED}={BOUND}",
        "out": out,
        "prompt": prompt_len,
        "tok_s": {n: statistics.median(v) for n, v in rates.items()},
        "over_alone": {n: ratios(n, "alone") for n in names if n != "alone"},
        "over_noop": {n: ratios(n, "noop") for n in ("kvarena",)},
    }


def report(r: dict) -> str:
    lines = [
        f"decode of {r['out']} tokens after a {r['prompt']}-token prompt; engines side by side, "
        f"{r['rounds']} rounds of one request each; per round ratios, median (quartiles)",
        f"{'engine':<38} {'t/s':>7} {'/ alone':>20} {'/ no-op connector':>20}",
    ]

    def cell(x: dict | None) -> str:
        return "" if x is None else f"{x['median']:.3f} ({x['q1']:.2f}-{x['q3']:.2f})"

    for name, t in r["tok_s"].items():
        lines.append(
            f"{ENGINES[name]:<38} {t:7.1f} {cell(r['over_alone'].get(name)):>20} "
            f"{cell(r['over_noop'].get(name)):>20}"
        )
    return "\n".join(lines)


def main() -> None:
    from kvarena.checks import parse_bytes
    from kvarena.integrations.transformers.tiny import SERVED, save_tiny

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_next", choices=sorted(SERVED))
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--out", type=int, default=128, help="output tokens per request")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--device-kv", default="20MiB")
    ap.add_argument("--control", action="store_true", help="a second vLLM alone (A/A)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error(f"--rounds must be at least 2, got {args.rounds}")
    work = Path(tempfile.mkdtemp(prefix="kvarena-bench-decode-"))
    model = save_tiny(args.model, work)
    r = measure(
        model,
        rounds=args.rounds,
        out=args.out,
        prompt_len=args.prompt,
        device_kv=parse_bytes(args.device_kv),
        control=args.control,
    )
    print(json.dumps(r) if args.json else report(r))


if __name__ == "__main__":
    main()
