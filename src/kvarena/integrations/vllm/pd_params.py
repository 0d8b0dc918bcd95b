"""The ``kv_transfer_params`` a prefill and a decode engine exchange through a proxy.

vLLM's disaggregated serving carries a request's handoff in
``kv_transfer_params``: a proxy or router sends the prompt to a prefill
engine with ``do_remote_decode``, takes the ``kv_transfer_params`` its answer
returns, and sends the same prompt with them to a decode engine. kvarena
speaks the fields vLLM's ``NixlConnector`` speaks (``do_remote_prefill``,
``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
``remote_host``, ``remote_port``, ``tp_size``, ``remote_num_tokens``), so a
proxy written for it (vLLM's disaggregated-serving example proxy,
``vllm-router``'s PD mode) drives kvarena unchanged: it copies the dict
whole and reads none of it.

This module is the one parser of those fields (what the decode side trusts
of them is checked here, before anything is allocated) and the one writer of
the prefill side's answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def prefix_digest(tokens: Sequence[int]) -> str:
    """What a prefill answer says its tokens were (BLAKE2b of their int64 bytes):
    a decode engine checks its own prompt begins with them before it reads, so a
    proxy that pairs the wrong answer with a request costs a recompute, never
    another prompt's cache."""
    raw = np.asarray(list(tokens), dtype="<i8").tobytes()
    return hashlib.blake2b(raw, digest_size=16, person=b"kvarena-pd").hexdigest()


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request asks this (prefill) engine to hold its KV for a decode engine."""
    return bool(params) and bool(params.get("do_remote_decode"))  # type: ignore[union-attr]


@dataclass(frozen=True, kw_only=True)
class Offer:
    """What a prefill engine answers for a request a decode engine will read:
    where its blocks are (``block_ids``: one list per KV cache group, by the
    block's position in the request), how many tokens they hold, and where to
    ask for the engine's NIXL metadata."""

    engine_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    host: str
    port: int
    tp_size: int
    block_size: int  # tokens per block there: the block ids' positions mean nothing otherwise
    prefix: str  # :func:`prefix_digest` of the ``num_tokens`` tokens

    def params(self) -> dict[str, Any]:
        """The answer's ``kv_transfer_params`` (NixlConnector's field names)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": [list(g) for g in self.block_ids],
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "remote_num_tokens": self.num_tokens,
            "kvarena_block_size": self.block_size,
            "kvarena_prefix": self.prefix,
        }

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None, *, groups: int) -> Offer | str | None:
        """The offer a decode request carries: None where it carries none
        (``do_remote_prefill`` unset), else the offer, or why it cannot be used
        (a string: the request is then computed here, never guessed at)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        missing = [
            k
            for k in (
                "remote_engine_id",
                "remote_request_id",
                "remote_block_ids",
                "remote_host",
                "remote_port",
                "remote_num_tokens",
                "kvarena_block_size",
                "kvarena_prefix",
            )
            if params.get(k) is None
        ]
        if missing:
            return f"kv_transfer_params lack {', '.join(missing)}"
        ids = params["remote_block_ids"]
        if (
            not isinstance(ids, Sequence)
            or len(ids) != groups
            or not all(isinstance(g, Sequence) for g in ids)
        ):
            return (
                f"remote_block_ids must hold one list per KV cache group ({groups}), "
                f"got {str(ids)[:80]}"
            )
        flat = [b for g in ids for b in g]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in flat):
            return "remote_block_ids must be non-negative integers"
        tokens, port, tp = (
            params["remote_num_tokens"],
            params["remote_port"],
            params.get("tp_size", 1),
        )
        block = params["kvarena_block_size"]
        for name, value, low in (
            ("remote_num_tokens", tokens, 0),
            ("remote_port", port, 1),
            ("kvarena_block_size", block, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                return f"{name} must be an integer >= {low}, got {value!r}"
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            return f"tp_size must be a positive integer, got {tp!r}"
        return cls(
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            block_ids=tuple(tuple(g) for g in ids),
            num_tokens=tokens,
            host=str(params["remote_host"]),
            port=port,
            tp_size=tp,
            block_size=block,
            prefix=str(params["kvarena_prefix"]),
        )
