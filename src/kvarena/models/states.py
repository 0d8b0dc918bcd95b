"""Per-request state declarations of real hybrid models, from published shapes.

These are the STATE-pool entries of three model families at a given
tensor-parallel size, with the shapes vLLM and ATOM allocate (conv states in
vLLM's default ``(state_len, dim)`` layout). Numbers come from the models'
Hugging Face configs and the engines' shape calculators, gathered in
``shared/reference/model_cache_facts.json``:

- Qwen3-Next-80B-A3B: 36 Gated DeltaNet layers (3 of every 4 of 48); conv
  ``(3, 8192)``, recurrent ``(32, 128, 128)`` per layer at TP 1: 39,518,208 B
  per request in bf16.
- Mamba2-2.7B: 64 layers; conv ``(3, 5376)``, SSM ``(80, 64, 128)``:
  85,950,464 B per request in bf16.
- DeepSeek-V4-Flash: compressor rings of 21 CSA layers (main kv/score 8 rows x
  1024 fp32, indexer kv/score 8 x 256 fp32) and 20 HCA layers (128 x 512 fp32,
  not carried by checkpoints), score rings starting at ``-inf``, plus the
  128-token sliding window of all 43 layers (512-wide bf16 rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..layout import EntryField


def _split(n: int, tp: int, what: str) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tensor-parallel size must be a positive int, got {tp!r}")
    if n % tp:
        raise ValueError(f"{what} = {n} is not divisible by tensor-parallel size {tp}")
    return n // tp


def qwen3_next_gdn_state(
    tp: int = 1,
    conv_dtype: torch.dtype = torch.bfloat16,
    ssm_dtype: torch.dtype = torch.bfloat16,
) -> list[EntryField]:
    """Qwen3-Next-80B-A3B's Gated DeltaNet state of one request."""
    layers = 36
    key_dim, value_dim = 16 * 128, 32 * 128
    conv_dim = _split(2 * key_dim + value_dim, tp, "conv dim")
    heads = _split(32, tp, "linear value heads")
    return [
        EntryField("conv_state", layers, (3, conv_dim), conv_dtype),
        EntryField("recurrent_state", layers, (heads, 128, 128), ssm_dtype),
    ]


def mamba2_state(
    tp: int = 1,
    conv_dtype: torch.dtype = torch.bfloat16,
    ssm_dtype: torch.dtype = torch.bfloat16,
) -> list[EntryField]:
    """Mamba2-2.7B's state of one request (64 layers, d_state 128, 80 heads of 64)."""
    conv_dim = _split(5120 + 2 * 128, tp, "conv dim")
    heads = _split(80, tp, "SSM heads")
    return [
        EntryField("conv_state", 64, (3, conv_dim), conv_dtype),
        EntryField("ssm_state", 64, (heads, 64, 128), ssm_dtype),
    ]


def deepseek_v4_flash_state(window_dtype: torch.dtype = torch.bfloat16) -> list[EntryField]:
    """DeepSeek-V4-Flash's compressor rings and sliding window of one request."""
    f32, ninf = torch.float32, -math.inf
    csa, hca, all_layers = 21, 20, 43
    return [
        EntryField("csa_kv_state", csa, (8, 1024), f32),
        EntryField("csa_score_state", csa, (8, 1024), f32, fill=ninf),
        EntryField("csa_indexer_kv_state", csa, (8, 256), f32),
        EntryField("csa_indexer_score_state", csa, (8, 256), f32, fill=ninf),
        EntryField("swa_window", all_layers, (128, 512), window_dtype),
        EntryField("hca_kv_state", hca, (128, 512), f32, in_checkpoint=False),
        EntryField("hca_score_state", hca, (128, 512), f32, fill=ninf, in_checkpoint=False),
    ]


REFERENCE_STATES: dict[str, Callable[[], list[EntryField]]] = {
    "qwen3-next-80b-a3b": qwen3_next_gdn_state,
    "mamba2-2.7b": mamba2_state,
    "deepseek-v4-flash": deepseek_v4_flash_state,
}
"""Built-in state declarations by model name, at TP 1 and bf16 defaults."""
