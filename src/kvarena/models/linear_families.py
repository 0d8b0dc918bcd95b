"""Kimi-Linear (KDA beside MLA) and DeepSeek-V4 (compressed attention with sliding windows)."""

from __future__ import annotations

import math

import torch

from ..errors import InvalidValueError
from ..layout import EntryField
from .attention_families import _mla_row
from .config import MAX_LAYERS, ConfigError, ConfigReader
from .hybrid_families import _LINEAR_KINDS
from .options import ModelCache, ServingOptions
from .shapes import _block, _kv_dtype, _model, _model_dtype, _split, _state_dtype


def _kimi_layers(c: ConfigReader) -> tuple[int, int, int, int, int]:
    """(MLA layers, KDA layers, KDA heads, head dim, conv kernel) from
    ``linear_attn_config`` (the original config) or transformers 5's flat fields."""
    lin = c.sub("linear_attn_config", optional=True)
    if lin is not None:
        mla = len(lin.int_list("full_attn_layers", lo=1, hi=MAX_LAYERS))
        kda = len(lin.int_list("kda_layers", lo=1, hi=MAX_LAYERS))
        return (
            mla,
            kda,
            lin.integer("num_heads"),
            lin.integer("head_dim"),
            lin.integer("short_conv_kernel_size", lo=2),
        )
    if not c.has("layer_types"):
        raise ConfigError(
            f"{c.where}: the config lacks the field 'linear_attn_config' (or 'layer_types')"
        )
    kinds = c.layer_kinds(None, _LINEAR_KINDS)
    mla = kinds.count("full_attention")
    return (
        mla,
        len(kinds) - mla,
        c.integer("linear_num_heads"),
        c.integer("linear_head_dim"),
        c.integer("linear_conv_kernel_dim", lo=2),
    )


def _kimi_linear(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
    mla, kda, heads, head_dim, kernel = _kimi_layers(c)
    model = _model_dtype(c, o)
    block = _block(o, 64)
    row, dtype = _mla_row(c, o, model)
    page = [EntryField("kv", mla, (block, *row), dtype)]
    state = [
        # Short convolutions over q, k and v: three heads x head_dim channels each.
        EntryField(
            "conv_state",
            kda,
            (kernel - 1, _split(3 * heads * head_dim, o.tp, "KDA conv dim")),
            model,
        ),
        EntryField(
            "recurrent_state",
            kda,
            (_split(heads, o.tp, "KDA heads"), head_dim, head_dim),
            _state_dtype(o, torch.float32),
        ),
    ]
    return _model(
        name,
        "kimi_linear",
        o,
        block,
        page,
        state,
        attention=mla,
        state_layers=kda,
        recurrent=kda,
        align=64,
    )


def _deepseek_v4(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
    layers = c.integer("num_hidden_layers", hi=MAX_LAYERS)
    # One ratio per layer (0: sliding window only, 4: CSA, 128: HCA), and the
    # release's list also covers its multi-token-prediction layers after them.
    nextn = c.integer("num_nextn_predict_layers", lo=0, hi=MAX_LAYERS, default=0)
    listed = c.int_list("compress_ratios", lo=0, hi=128, max_len=layers + nextn)
    if len(listed) < layers:
        raise ConfigError(
            f"{c.where}: compress_ratios names {len(listed)} layers but num_hidden_layers is "
            f"{layers}; one ratio per layer (0, 4 or 128)"
        )
    ratios = listed[:layers]
    odd = sorted({r for r in ratios if r not in (0, 4, 128)})
    if odd:
        raise ConfigError(
            f"{c.where}: compress_ratios holds {odd}; DeepSeek-V4 layers compress by 0, 4 or 128"
        )
    csa, hca = ratios.count(4), ratios.count(128)
    block = _block(o, 256)
    if block % 128:
        raise InvalidValueError(
            f"DeepSeek-V4 blocks must be a multiple of 128 tokens (one HCA row), got {block}"
        )
    head_dim, k = c.integer("head_dim", lo=65), o.spec_tokens
    index_dim = c.integer("index_head_dim")
    model = _model_dtype(c, o)
    if o.kv_dtype in ("fp8", "fp8_ds_mla"):
        # 448 fp8 NoPE + 64 bf16 RoPE + 8 B of UE8M0 scales: 584 B per compressed row.
        row, kv = (head_dim - 64 + 64 * 2 + 8,), torch.uint8
    else:
        row, kv = (head_dim,), _kv_dtype(o, model)
    page = [
        EntryField("csa_kv", csa, (block // 4, *row), kv),
        # Indexer keys: 128 fp8 values + one fp32 scale per compressed row.
        EntryField("csa_indexer_k", csa, (block // 4, index_dim + 4), torch.uint8),
        EntryField("hca_kv", hca, (block // 128, *row), kv),
    ]
    f32, ninf = torch.float32, -math.inf
    window = c.integer("sliding_window") + k
    state = [
        # Compressor rings: coff * ratio rows (coff 2 for the overlapping ratio-4
        # CSA, 1 for HCA), each row kv + score of 2 * coff * head_dim / 2 fp32.
        EntryField("csa_kv_state", csa, (8 + k, 2 * head_dim), f32),
        EntryField("csa_score_state", csa, (8 + k, 2 * head_dim), f32, fill=ninf),
        EntryField("csa_indexer_kv_state", csa, (8 + k, 2 * index_dim), f32),
        EntryField("csa_indexer_score_state", csa, (8 + k, 2 * index_dim), f32, fill=ninf),
        EntryField("swa_window", layers, (window, *row), kv),
        EntryField("hca_kv_state", hca, (128 + k, head_dim), f32, in_checkpoint=False),
        EntryField(
            "hca_score_state", hca, (128 + k, head_dim), f32, fill=ninf, in_checkpoint=False
        ),
    ]
    notes = ("HCA compressor rings are rebuilt from the compressed KV, so checkpoints skip them",)
    # Every layer keeps a sliding-window ring; the CSA and HCA layers also page.
    return _model(
        name,
        "deepseek_v4",
        o,
        block,
        page,
        state,
        attention=csa + hca,
        state_layers=layers,
        align=64,
        notes=notes,
    )
