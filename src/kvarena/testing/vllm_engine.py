"""The ``vllm.LLM`` arguments the connector's tests, benchmarks and examples
share, for the served tiny models of
:mod:`kvarena.integrations.transformers.tiny` (``save_tiny``)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any


def engine_args(model: str | Path, **overrides: Any) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a tiny model in a test: token ids in (no
    tokenizer), eager, a 64 MiB KV cache, prefix caching on, 4k tokens; any of them
    overridden, anything more (an executor, a connector) added."""
    args: dict[str, Any] = dict(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        dtype="bfloat16",
        enable_prefix_caching=True,
        max_model_len=4096,
    )
    args.update(overrides)
    return args


def freeze_heap() -> None:
    """Freeze what this process holds out of the collector's sight, before it
    starts an engine of its own (``vllm.LLM`` with the engine core in the process).

    With torch, vLLM and transformers imported a process holds some 700,000
    objects, and vLLM makes five full collections while it starts an engine
    (loading the model, then freezing its heap): ~0.6 s each on two cores,
    most of an engine start in a test. Frozen first, they walk the engine's
    own objects alone. vLLM unfreezes the heap when the engine shuts down and
    collects it whole then, so garbage frozen here is freed at that close."""
    gc.freeze()


def split_args(model: str | Path, prompt_tokens: int) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments of one engine computing a prompt of
    ``prompt_tokens`` tokens as a prefill engine and a decode engine split it:
    its first ``N - 1`` tokens in one step, then the last (a hybrid's greedy
    tokens can depend on where a step boundary carries its state over)."""
    return engine_args(
        model,
        distributed_executor_backend="uni",
        max_num_batched_tokens=prompt_tokens - 1,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
