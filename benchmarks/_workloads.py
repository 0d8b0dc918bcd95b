"""Synthetic request traces of documented shapes, for comparing checkpoint policies.

Plain-JSONL traces (``tokens`` per line), generated from a seed:

- ``system-prompt``: 4 system prompts of 1,500-3,000 tokens, each request one
  of them followed by a unique 40-400-token question (1,200 requests);
- ``multi-turn``: 120 chats of 6 turns; each turn's prompt is the previous
  turn's prompt, its 100-300-token output, and a new 50-500-token message (a
  conversation's next turn contains the previous prompt and its output);
- ``document``: 60 documents of 4,000-12,000 tokens, each read by 12 unique
  40-200-token questions, the questions of several documents interleaved.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

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


def write_workload(name: str, path: Path, seed: int = 0) -> Path:
    """Write workload ``name`` (one of :data:`WORKLOADS`) to ``path``."""
    rng = np.random.default_rng(seed)
    path.write_text("\n".join(WORKLOADS[name](rng)) + "\n")
    return path
