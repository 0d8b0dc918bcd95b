"""Checkpoint policies on synthetic workloads of documented shapes, side by side.

Three plain-JSONL traces (``tokens`` per line), generated from a seed:

- ``system-prompt``: 4 system prompts of 1,500-3,000 tokens, each request one
  of them followed by a unique 40-400-token question (1,200 requests);
- ``multi-turn``: 120 chats of 6 turns; each turn's prompt is the previous
  turn's prompt, its 100-300-token output, and a new 50-500-token message (a
  conversation's next turn contains the previous prompt and its output);
- ``document``: 60 documents of 4,000-12,000 tokens, each read by 12 unique
  40-200-token questions, the questions of several documents interleaved.

Each trace is replayed (bookkeeping mode, Qwen3-Next-80B at TP 8 in 80 GiB
unless told otherwise) under today's default, the same with ``learn``, and
the rest of ``kvarena replay --compare`` (vLLM align, no state reuse, KV only:
the same KV with no state, the infinite bound); the table prints hit tokens
and their ratio to KV only.

    .venv/bin/python benchmarks/bench_policy_workloads.py [--tp 8] [--memory 80GiB]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvarena.models import ServingOptions, model_cache
from kvarena.prefix import CheckpointPolicy
from kvarena.replay import ReplayConfig, load_trace, replay
from kvarena.replay.policies import compare
from kvarena.report import vllm_unification

VOCAB = 150_000


def _line(ms: float, tokens: np.ndarray, output: int) -> str:
    return json.dumps(
        {"timestamp": round(ms, 3), "tokens": tokens.tolist(), "output_length": output}
    )


def system_prompt(rng: np.random.Generator) -> Iterator[str]:
    systems = [rng.integers(0, VOCAB, int(rng.integers(1500, 3001))) for _ in range(4)]
    for i in range(1200):
        q = rng.integers(0, VOCAB, int(rng.integers(40, 401)))
        yield _line(i * 250.0, np.concatenate([systems[int(rng.integers(4))], q]), 200)


def multi_turn(rng: np.random.Generator) -> Iterator[str]:
    chats = [np.zeros(0, dtype=np.int64) for _ in range(120)]
    t = 0.0
    for _turn in range(6):
        for c in rng.permutation(len(chats)):
            message = rng.integers(0, VOCAB, int(rng.integers(50, 501)))
            chats[c] = np.concatenate([chats[c], message])
            output = int(rng.integers(100, 301))
            yield _line(t, chats[c], output)
            chats[c] = np.concatenate([chats[c], rng.integers(0, VOCAB, output)])
            t += 200.0


def document(rng: np.random.Generator) -> Iterator[str]:
    docs = [rng.integers(0, VOCAB, int(rng.integers(4000, 12001))) for _ in range(60)]
    order = [d for d in range(60) for _ in range(12)]
    # Questions of a few documents at a time, interleaved (a window of 5 documents).
    order = sorted(order, key=lambda d: d // 5 + rng.random())
    for i, d in enumerate(order):
        q = rng.integers(0, VOCAB, int(rng.integers(40, 201)))
        yield _line(i * 300.0, np.concatenate([docs[d], q]), 150)


WORKLOADS = {"system-prompt": system_prompt, "multi-turn": multi_turn, "document": document}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--memory-gib", type=int, default=80)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    args = ap.parse_args()
    options = ServingOptions(tp=args.tp)
    model = model_cache("qwen3-next-80b-a3b", options)
    # vLLM's align policy at vLLM's own unified block size, as `kvarena replay --compare`.
    v = vllm_unification(model, args.memory_gib << 30, args.max_seqs)
    vllm_model = (
        model_cache("qwen3-next-80b-a3b", replace(options, block_size=v["attention_block_tokens"]))
        if v
        else None
    )
    today = CheckpointPolicy.parse("end,interval:8192,branch")
    learn = CheckpointPolicy.parse("end,interval:8192,branch,learn")
    base = dict(budget_bytes=args.memory_gib << 30, max_seqs=args.max_seqs)
    print(f"Qwen3-Next-80B-A3B, TP {args.tp}, {args.memory_gib} GiB, seed {args.seed}")
    head = f"{'workload':14} {'requests':>8} {'policy':40} {'hit tokens':>12} {'vs KV only':>10}"
    print(head)
    with tempfile.TemporaryDirectory() as d:
        for name in args.workloads.split(","):
            path = Path(d) / f"{name}.jsonl"
            rng = np.random.default_rng(args.seed)
            path.write_text("\n".join(WORKLOADS[name](rng)) + "\n")
            trace = load_trace(path)
            rows = compare(model, trace, ReplayConfig(**base, policy=today), vllm_model=vllm_model)
            rows.insert(
                1, replay(model, trace, ReplayConfig(**base, policy=learn), label=learn.describe())
            )
            kv_only = next(r for r in rows if r.label.startswith("KV only")).hit_tokens
            for r in rows:
                ratio = r.hit_tokens / kv_only if kv_only else 0.0
                print(f"{name:14} {len(trace):>8} {r.label:40} {r.hit_tokens:>12,} {ratio:>9.3f}x")


if __name__ == "__main__":
    main()
