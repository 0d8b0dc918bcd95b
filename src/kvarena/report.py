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
from .layout.regions import align_up
from .models import ModelCache
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


def vllm_unification(m: ModelCache, budget: int, max_seqs: int) -> dict[str, Any] | None:
    """What vLLM's hybrid page unification forces for the same budget.

    vLLM gives every layer one page size: the attention block grows until one
    layer's page holds one layer's state (rounded to the kernel's block
    multiple: 16, or 64 for MLA), and state pages are padded to it. Layers are
    grouped ``g = min(attention layers, state layers)`` to a group; every
    group shares ``g`` page tensors, so a block id costs ``g`` pages, a request
    holds one block id per state group (per rollback copy), and each block of
    tokens needs one block id per attention group. This models vLLM v1's
    HybridKVCacheCoordinator (vllm/v1/core/kv_cache_utils.py and
    Platform._align_hybrid_block_size); the per-layer numbers match those
    recorded in model_cache_facts.json.
    """
    if not m.is_hybrid or not m.kv_bytes_per_token_per_layer:
        return None
    per_token = m.kv_bytes_per_token_per_layer
    state_page = m.state_bytes_per_layer
    block = align_up(-(-state_page // per_token), m.kernel_block_align)
    page = block * per_token
    g = min(m.attention_layers, m.recurrent_layers)
    attn_groups = -(-m.attention_layers // g)
    state_groups = -(-m.recurrent_layers // g)
    num_blocks = budget // (g * page)
    state_ids = max_seqs * state_groups * m.entries_per_req
    tokens = max(0, num_blocks - state_ids) // attn_groups * block
    # Padding: each state page's slack, plus whole pages of layer slots that a
    # last, partly filled group leaves empty.
    padding_per_request = m.entries_per_req * (
        m.recurrent_layers * (page - state_page) + (state_groups * g - m.recurrent_layers) * page
    )
    return {
        "attention_block_tokens": block,
        "page_bytes": page,
        "state_page_bytes": state_page,
        "state_page_padding_bytes": page - state_page,
        "group_size": g,
        "attention_groups": attn_groups,
        "state_groups": state_groups,
        "num_block_ids": num_blocks,
        "state_block_ids": state_ids,
        "padding_bytes_at_max_seqs": padding_per_request * max_seqs,
        "kv_token_capacity": tokens,
        "fits_max_seqs": num_blocks >= state_ids,
    }


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
        "vllm_unified": vllm_unification(m, plan.budget_bytes, plan.max_seqs),
        "notes": list(m.notes),
    }
