"""What vLLM's hybrid page unification makes of a model's cache, from sizes alone.

kvarena's plan is compared with vLLM's own layout everywhere a user picks
between them (``kvarena plan``, the memory pictures, the replay's vLLM-align
row, the prefix benchmark), so the model of vLLM's layout lives once, here,
beside the model declarations it reads, and imports nothing of vLLM.

vLLM gives every layer one page size: the attention block grows until one
layer's page holds one layer's state (rounded to the kernel's block
multiple: 16, or 64 for MLA), and state pages are padded to it. Layers are
grouped ``g = min(attention layers, state layers)`` to a group; every group
shares ``g`` page tensors, so a block id costs ``g`` pages, a request holds
one block id per state group (per rollback copy), and each block of tokens
needs one block id per attention group. This models vLLM v1's
HybridKVCacheCoordinator (``vllm/v1/core/kv_cache_utils.py`` and
``Platform._align_hybrid_block_size``); the per-layer numbers match those
recorded in ``model_cache_facts.json``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..layout.regions import align_up
from .options import ModelCache


@dataclass(frozen=True, kw_only=True)
class VllmPages:
    """vLLM's unified pages for one model, budget and request count."""

    attention_block_tokens: int
    page_bytes: int
    state_page_bytes: int
    state_page_padding_bytes: int
    group_size: int
    attention_groups: int
    state_groups: int
    num_block_ids: int
    state_block_ids: int
    padding_bytes_at_max_seqs: int
    kv_token_capacity: int
    fits_max_seqs: bool

    @classmethod
    def of(cls, m: ModelCache, budget: int, max_seqs: int) -> VllmPages | None:
        """vLLM's pages for ``m`` in ``budget`` bytes at ``max_seqs`` requests;
        None for a model vLLM does not unify (no attention beside state layers)."""
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
            m.recurrent_layers * (page - state_page)
            + (state_groups * g - m.recurrent_layers) * page
        )
        return cls(
            attention_block_tokens=block,
            page_bytes=page,
            state_page_bytes=state_page,
            state_page_padding_bytes=page - state_page,
            group_size=g,
            attention_groups=attn_groups,
            state_groups=state_groups,
            num_block_ids=num_blocks,
            state_block_ids=state_ids,
            padding_bytes_at_max_seqs=padding_per_request * max_seqs,
            kv_token_capacity=tokens,
            fits_max_seqs=num_blocks >= state_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
