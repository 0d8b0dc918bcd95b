"""``kvarena plan``'s answer, as plain data: what a model's cache looks like and
how much of it fits a budget, next to what vLLM's page unification would give.

Everything here is computed from sizes, and the pool numbers are the
:class:`~kvarena.pools.CachePlan`'s own (the record a cache is built from),
so the report cannot promise what a cache would not hold. :func:`plan_report`
returns a dict whose schema (``SCHEMA_VERSION``) is documented in the README;
the CLI renders the same dict as tables or JSON.
"""

from __future__ import annotations

import math
from typing import Any

from .checkpoint import CheckpointSpec
from .checks import check_count
from .layout import layout_fingerprint, layout_rows
from .models.vllm_pages import VllmPages
from .pools import CachePlan
from .transfer.descriptors import per_layer_descriptor_count

SCHEMA_VERSION = "kvarena-plan/2"
"""/2 over /1: ``pools`` carries the whole :class:`CachePlan` (strides, fingerprints,
used bytes, block size, entries per request) and the block count is the
stride-based one a cache holds; ``layers.state`` counts every layer holding
per-request state, ``layers.recurrent`` the recurrent ones."""


def _fields(fields) -> dict[str, Any]:
    rows, tail, entry = layout_rows(fields)
    return {
        "entry_bytes": entry,
        "tail_padding": tail,
        "fingerprint": layout_fingerprint(fields) if fields else None,
        "fields": [
            {
                "name": r.name,
                "dtype": r.dtype,
                "layers": r.layers,
                "shape": list(r.shape),
                "offset": r.start,
                "bytes": r.nbytes,
                "pad_before": r.pad_before,
                "in_checkpoint": r.in_checkpoint,
                "fill": repr(r.fill),
            }
            for r in rows
        ],
    }


def _vllm(plan: CachePlan) -> dict[str, Any] | None:
    v = VllmPages.of(plan.model, plan.budget_bytes, plan.max_seqs)
    return v.to_dict() if v is not None else None


def plan_report(plan: CachePlan, *, context_tokens: int = 32768) -> dict[str, Any]:
    """The whole ``kvarena plan`` answer for one plan."""
    m = plan.model
    context_tokens = check_count(context_tokens, "context_tokens", lo=1, hi=1 << 40)
    checkpoint = None
    if plan.state_fields and plan.page_fields:
        spec = CheckpointSpec.build(plan.state_fields, plan.block_stride)
        checkpoint = {
            "image_bytes": spec.image_bytes,
            "unit_bytes": spec.unit_bytes,
            "units_per_image": spec.units_per_image,
            "ranges": [list(r) for r in spec.ranges],
        }
    blocks = math.ceil(context_tokens / plan.block_size) if plan.page_fields else 0
    page_tensors = sum(f.layers for f in plan.page_fields)
    state_tensors = sum(f.layers for f in plan.state_fields)
    epr = plan.entries_per_req
    slots = epr * bool(plan.state_fields)
    transfer = {
        "context_tokens": context_tokens,
        "kvarena_best": slots + min(blocks, 1),
        "kvarena_worst": slots + blocks,
        "per_layer_best": per_layer_descriptor_count(
            page_tensors, state_tensors, min(blocks, 1), epr
        ),
        "per_layer_worst": per_layer_descriptor_count(page_tensors, state_tensors, blocks, epr),
    }
    return {
        "schema": SCHEMA_VERSION,
        "model": m.name,
        "family": m.family,
        "options": {
            "tp": m.options.tp,
            "kv_dtype": m.options.kv_dtype,
            "state_dtype": m.options.state_dtype,
            "block_size": plan.block_size,
            "spec_tokens": m.options.spec_tokens,
        },
        "layers": {
            "attention": m.attention_layers,
            "state": m.state_layers,
            "recurrent": m.recurrent_layers,
        },
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "state_bytes_per_request": m.state_bytes * epr,
        "page_entry": _fields(plan.page_fields),
        "state_entry": _fields(plan.state_fields),
        "state_slot_stride": plan.slot_stride,
        "pools": plan.to_dict(),
        "checkpoint": checkpoint,
        "transfer_descriptors": transfer,
        "vllm_unified": _vllm(plan),
        "notes": list(m.notes),
    }
