"""The ``vllm.LLM`` arguments the connector's tests, benchmarks and examples
share, for the served tiny models of
:mod:`kvarena.integrations.transformers.tiny` (``save_tiny``)."""

from __future__ import annotations

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
