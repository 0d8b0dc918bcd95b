"""Tiny random models of each supported family, built from configs (no download).

The tests, the demo, the examples and the benchmarks generate with these:
small enough for a CPU in seconds, yet each with the family's layer mix
(Gemma-3's sliding and global layers, Qwen3-Next's Gated DeltaNet beside
attention, Nemotron-H's Mamba2 + attention + MLP layers...).

Two sizes, one factory. :data:`TINY` models run in-process through
transformers; :data:`SERVED` models are saved as vLLM loads them
(:func:`save_tiny`: a config and safetensors, no tokenizer), at the smallest
sizes vLLM's CPU kernels take (Gated DeltaNet head dims of 64; attention
blocks a multiple of 32 tokens), their weights drawn wide (a normal of
standard deviation 4 / sqrt(fan-in)) so the logits are peaked: greedy
decoding then has no near-ties for bfloat16 rounding to flip, and "outputs
identical" is a test that can fail only for a wrong byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    vocab_size=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
_GATED_DELTANET = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
"""The Gated DeltaNet layers' fields Qwen3-Next and Qwen3.5 share."""
_MAMBA2_FIELDS = dict(
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2
)
"""The Mamba2 layers' fields Granite 4.0 hybrids and Bamba share."""

TINY: dict[str, dict[str, Any]] = {
    "llama": dict(num_hidden_layers=2),
    "qwen3": dict(num_hidden_layers=2),
    "gemma3_text": dict(
        num_hidden_layers=4,
        sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    ),
    "gemma2": dict(
        num_hidden_layers=4,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "gpt_oss": dict(
        num_hidden_layers=4,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "cohere2": dict(
        num_hidden_layers=4,
        sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    ),
    "qwen3_next": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        **_GATED_DELTANET,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "qwen3_5_text": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        **_GATED_DELTANET,
    ),
    "mamba2": dict(
        num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=1, expand=2
    ),
    "nemotron_h": dict(
        num_hidden_layers=4,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        hybrid_override_pattern="M*M-",
    ),
    "granitemoehybrid": dict(
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        **_MAMBA2_FIELDS,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "bamba": dict(
        num_hidden_layers=4,
        attn_layer_indices=[2],
        **_MAMBA2_FIELDS,
    ),
    "jamba": dict(
        num_hidden_layers=4,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=4,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_expand=2,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    ),
    "lfm2": dict(
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "conv"],
        conv_L_cache=3,
    ),
    "llama4_text": dict(
        num_hidden_layers=4,
        attention_chunk_size=8,
        no_rope_layers=[1, 1, 1, 0],
        num_local_experts=2,
        num_experts_per_tok=1,
        intermediate_size_mlp=128,
    ),
    "deepseek_v3": dict(
        num_hidden_layers=2,
        num_key_value_heads=4,
        head_dim=8,  # DeepSeek's head_dim is the RoPE part of the key
        moe_intermediate_size=32,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "kimi_linear": dict(
        num_hidden_layers=4,
        num_key_value_heads=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        kv_lora_rank=32,
        linear_num_heads=4,
        linear_head_dim=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        mlp_layer_types=["dense"] * 4,
    ),
}
"""model_type -> the config fields of its tiny model (over the common ones)."""


SERVED_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

SERVED: dict[str, dict[str, Any]] = {
    "llama": dict(num_hidden_layers=2),
    "qwen3_next": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
    "granitemoehybrid": dict(
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_expand=1,
        mamba_d_conv=4,
        num_local_experts=0,
        shared_intermediate_size=512,
    ),
}
"""model_type -> the config fields of its served tiny model (over SERVED_COMMON)."""


def _config(
    sizes: dict[str, dict[str, Any]],
    common: dict[str, Any],
    model_type: str,
    overrides: dict[str, Any],
) -> Any:
    from transformers import AutoConfig

    if model_type not in sizes:
        raise KeyError(f"no tiny {model_type!r}; known: {', '.join(sizes)}")
    return AutoConfig.for_model(model_type, **{**common, **sizes[model_type], **overrides})


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The tiny config of ``model_type`` (a transformers ``PretrainedConfig``)."""
    return _config(TINY, _COMMON, model_type, overrides)


def tiny_model(
    model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Any:
    """A random model of ``model_type`` in eval mode, same weights for the same seed."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def save_tiny(
    model_type: str,
    directory: str | Path,
    *,
    seed: int = 0,
    name: str | None = None,
    **overrides: Any,
) -> Path:
    """Save the served tiny ``model_type`` (a key of :data:`SERVED`; config fields
    ``overrides``, e.g. another layer pattern) under ``directory`` as vLLM loads
    it, in a folder ``name`` (default: the model type); returns that folder."""
    from transformers import AutoModelForCausalLM

    config = _config(SERVED, SERVED_COMMON, model_type, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 4.0 / p.shape[-1] ** 0.5)
    out = Path(directory) / (name or model_type)
    model.save_pretrained(out)
    return out
