"""The serving options every command that plans a cache takes, and their check."""

from __future__ import annotations

from typing import Annotated

import typer

from ..checks import check_count, parse_bytes
from ..models import KV_DTYPES, PRESETS, STATE_DTYPES, ServingOptions
from ..pools.plan import MAX_SEQS

MaxSeqs = Annotated[int, typer.Option(help="requests in flight")]
BlockSize = Annotated[int | None, typer.Option(help="tokens per PAGE block (family default)")]
Tp = Annotated[int, typer.Option(help="tensor-parallel size")]
KvDtype = Annotated[str, typer.Option(help=f"one of {', '.join(KV_DTYPES)}")]
StateDtype = Annotated[str, typer.Option(help=f"one of {', '.join(STATE_DTYPES)}")]
SpecTokens = Annotated[int, typer.Option(help="speculative tokens (rollback copies)")]

ModelArg = Annotated[
    str, typer.Argument(help=f"a preset ({', '.join(PRESETS)}) or a config.json path")
]


def serving(
    memory: str,
    max_seqs: int,
    tp: int,
    kv_dtype: str,
    state_dtype: str,
    block_size: int | None,
    spec_tokens: int,
) -> tuple[int, ServingOptions]:
    """The budget and serving options every planning command takes, checked."""
    budget = parse_bytes(memory)
    check_count(max_seqs, "--max-seqs", lo=1, hi=MAX_SEQS)
    options = ServingOptions(
        tp=tp,
        kv_dtype=kv_dtype,
        state_dtype=state_dtype,
        block_size=block_size,
        spec_tokens=spec_tokens,
    )
    return budget, options
