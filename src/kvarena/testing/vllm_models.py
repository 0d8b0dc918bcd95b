"""Tiny random models saved as vLLM loads them (``save_pretrained``: a config and
safetensors, no tokenizer), for the connector's tests, benchmark and example.

Their weights are drawn wide (a normal of standard deviation 4 / sqrt(fan-in)),
so the logits are peaked: greedy decoding then has no near-ties for
bfloat16 rounding to flip, and "outputs identical" is a test that can fail
only for a wrong byte. Sizes are the smallest vLLM's CPU kernels take
(Gated DeltaNet head dims of 64; attention blocks a multiple of 32 tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_COMMON: dict[str, Any] = dict(
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

TINY: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", num_hidden_layers=2),
    "qwen3_next": dict(
        model_type="qwen3_next",
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
        model_type="granitemoehybrid",
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


def save_tiny(kind: str, directory: str | Path, *, seed: int = 0) -> Path:
    """Save the tiny ``kind`` model (a key of :data:`TINY`) under ``directory``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(_COMMON)
    fields.update(TINY[kind])
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 4.0 / p.shape[-1] ** 0.5)
    out = Path(directory) / kind
    model.save_pretrained(out)
    return out
