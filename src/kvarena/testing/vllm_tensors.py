"""vLLM's own KV cache tensors for the connector's tests, made without an engine.

``allocation`` builds them with the code vLLM's model runner calls
(``get_kv_cache_config_from_groups`` and ``allocate_kv_cache``) for a hybrid of
one full-attention group and two Mamba-style groups, in any of vLLM's KV cache
layouts; ``page`` reads one layer's page of a block as vLLM's own view does and
``fill`` gives every page bytes of its own. Imports vLLM: use it where vLLM is
installed.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

BLOCKS = 12
BLOCK_SIZE = 16
ATTN = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def mamba(padded: bool) -> MambaSpec:
    """A Mamba-style state spec (conv and SSM states), its page padded to the
    attention page where vLLM unifies page sizes."""
    return MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((3, 64), (2, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
        page_size_padded=ATTN.page_size_bytes if padded else None,
    )


def allocation(
    layout: str, *, padded: bool = True, attn_layers: int = 3, states: int = 2
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """vLLM's config and per-layer CPU tensors for one attention group and
    ``states`` Mamba groups of ``attn_layers`` layers each."""
    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = layout
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(attn_layers)], ATTN)]
    for s in range(states):
        first = 10 * (s + 1)
        groups.append(
            KVCacheGroupSpec(
                [f"model.layers.{i}.ssm" for i in range(first, first + attn_layers)],
                mamba(padded),
            )
        )
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    kc = get_kv_cache_config_from_groups(cfg, groups, per_block * BLOCKS)
    caches = allocate_kv_cache(kc, torch.device("cpu"), KVCacheLayout[layout])
    return kc, caches


def page(tensor: torch.Tensor, block: int) -> bytes:
    """One layer's page of ``block`` as vLLM's own view reads it."""
    return tensor[block].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


def fill(caches: dict[str, torch.Tensor], seed: int) -> None:
    """Each layer's page of each block its own bytes, written through vLLM's views
    (the logical content, the same in every layout)."""
    g = torch.Generator().manual_seed(seed)
    for name in sorted(caches):
        t = caches[name]
        raw = torch.randint(0, 256, (t.shape[0], t[0].numel() * t.element_size()), generator=g)
        t.copy_(raw.to(torch.uint8).view(t.dtype).view(t.shape))
