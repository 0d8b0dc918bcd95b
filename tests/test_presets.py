"""Presets against the published numbers (shared/reference/model_cache_facts.json)."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from kvarena.errors import InvalidValueError
from kvarena.models import (
    PRESETS,
    ServingOptions,
    UnknownModelError,
    detect_family,
    load_config,
    model_cache,
)

HYBRIDS = {"qwen3-next-80b-a3b", "nemotron-h-8b", "kimi-linear-48b-a3b"}
FACTS = Path(__file__).resolve().parents[2] / "shared" / "reference" / "model_cache_facts.json"

# (preset, options, KV bytes per token over all paged layers, per-request state bytes)
PUBLISHED = [
    ("llama-3.1-8b", {}, 131_072, 0),
    ("llama-3.1-8b", {"kv_dtype": "fp8"}, 65_536, 0),
    ("qwen3-8b", {}, 147_456, 0),
    ("qwen3-8b", {"kv_dtype": "fp8"}, 73_728, 0),
    # Global layers page (81,920 B/token); 52 local layers keep a 1024-token ring.
    ("gemma-3-27b", {}, 81_920, 436_207_616),
    # openai/gpt-oss-20b: 12 global layers page 2 x 8 heads x 64 x 2 B a token;
    # 12 sliding layers keep a 128-token ring: 12 x 2 x 128 x 8 x 64 x 2 B.
    ("gpt-oss-20b", {}, 24_576, 3_145_728),
    ("gpt-oss-20b", {"kv_dtype": "fp8"}, 12_288, 1_572_864),
    ("deepseek-v3", {}, 70_272, 0),
    ("deepseek-v3", {"kv_dtype": "fp8"}, 35_136, 0),
    ("deepseek-v3", {"kv_dtype": "fp8_ds_mla"}, 40_016, 0),
    ("qwen3-next-80b-a3b", {}, 24_576, 39_518_208),
    ("qwen3-next-80b-a3b", {"kv_dtype": "fp8"}, 12_288, 39_518_208),
    ("qwen3-next-80b-a3b", {"state_dtype": "float32"}, 24_576, 77_266_944),
    ("mamba2-2.7b", {}, 0, 85_950_464),
    ("mamba2-2.7b", {"state_dtype": "float32"}, 0, 169_836_544),
    ("nemotron-h-8b", {}, 16_384, 51_806_208),
    ("nemotron-h-8b", {"kv_dtype": "fp8", "state_dtype": "float32"}, 8_192, 102_137_856),
    ("kimi-linear-48b-a3b", {}, 8_064, 43_417_600),
    ("kimi-linear-48b-a3b", {"kv_dtype": "fp8"}, 4_032, 43_417_600),
]


@pytest.mark.parametrize(("preset", "opts", "kv_per_token", "state"), PUBLISHED)
def test_presets_match_published_bytes(preset, opts, kv_per_token, state):
    m = model_cache(preset, ServingOptions(**opts))
    assert m.kv_bytes_per_token == kv_per_token
    assert m.state_bytes == state


@pytest.mark.parametrize(
    ("preset", "per_layer_state", "attention", "states"),
    [
        ("qwen3-next-80b-a3b", 1_097_728, 12, 36),  # vLLM mamba page per layer
        ("nemotron-h-8b", 2_158_592, 4, 24),
        ("kimi-linear-48b-a3b", 2_170_880, 7, 20),
        ("mamba2-2.7b", 1_342_976, 0, 64),
    ],
)
def test_layer_counts_and_per_layer_state(preset, per_layer_state, attention, states):
    m = model_cache(preset)
    assert (m.state_bytes_per_layer, m.attention_layers, m.state_layers) == (
        per_layer_state,
        attention,
        states,
    )


def test_deepseek_v3_fp8_ds_mla_row_is_656_bytes():
    m = model_cache("deepseek-v3", ServingOptions(kv_dtype="fp8_ds_mla"))
    (kv,) = m.page_fields
    assert kv.dtype == torch.uint8 and kv.shape == (64, 656) and kv.layers == 61
    assert (
        model_cache("deepseek-v3", ServingOptions(spec_tokens=1)).page_fields[0].layers == 62
    )  # + MTP


def test_deepseek_v4_flash_rings_and_pages():
    m = model_cache("deepseek-v4-flash")
    f = {x.name: x for x in m.state_fields}
    # Per layer per request: CSA main 65,536 B, CSA indexer 16,384 B, HCA 524,288 B, window 131,072 B.
    assert f["csa_kv_state"].bytes_per_layer + f["csa_score_state"].bytes_per_layer == 65_536
    assert f["csa_indexer_kv_state"].bytes_per_layer * 2 == 16_384
    assert f["hca_kv_state"].bytes_per_layer + f["hca_score_state"].bytes_per_layer == 524_288
    assert f["swa_window"].bytes_per_layer == 131_072 and f["swa_window"].layers == 43
    assert (f["csa_kv_state"].layers, f["hca_kv_state"].layers) == (21, 20)
    assert f["csa_score_state"].fill == -math.inf and not f["hca_kv_state"].in_checkpoint
    p = {x.name: x for x in m.page_fields}
    # A 256-token block holds 64 CSA rows and 2 HCA rows of 1,024 B (bf16).
    assert p["csa_kv"].shape == (64, 512) and p["hca_kv"].shape == (2, 512)
    assert p["csa_indexer_k"].bytes_per_layer == 64 * 132
    fp8 = {
        x.name: x
        for x in model_cache("deepseek-v4-flash", ServingOptions(kv_dtype="fp8")).page_fields
    }
    assert fp8["csa_kv"].bytes_per_layer == 64 * 584
    spec = {
        x.name: x
        for x in model_cache("deepseek-v4-flash", ServingOptions(spec_tokens=2)).state_fields
    }
    assert spec["csa_kv_state"].shape[0] == 10 and spec["swa_window"].shape[0] == 130


def test_tensor_parallel_splits_heads_and_replicates_kv_heads():
    m = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=4))
    f = {x.name: x for x in m.state_fields}
    assert f["conv_state"].shape == (3, 2048) and f["recurrent_state"].shape == (8, 128, 128)
    assert m.page_fields[0].shape == (16, 1, 256)  # 2 KV heads over 4 ranks: replicated
    assert model_cache("llama-3.1-8b", ServingOptions(tp=2)).kv_bytes_per_token == 131_072 // 2
    with pytest.raises(ValueError, match="not divisible by tensor-parallel size 3"):
        model_cache("mamba2-2.7b", ServingOptions(tp=3))
    # 8 KV heads: TP 16 replicates each on two ranks; TP 12 fits neither way.
    assert model_cache("llama-3.1-8b", ServingOptions(tp=16)).page_fields[0].shape == (16, 1, 128)
    with pytest.raises(
        InvalidValueError, match="num_key_value_heads = 8 and tensor-parallel size 12"
    ):
        model_cache("llama-3.1-8b", ServingOptions(tp=12))


def test_kimi_recurrent_state_is_fp32_by_default():
    f = {x.name: x for x in model_cache("kimi-linear-48b-a3b").state_fields}
    assert f["recurrent_state"].dtype == torch.float32 and f["conv_state"].dtype == torch.bfloat16
    f16 = {
        x.name: x
        for x in model_cache(
            "kimi-linear-48b-a3b", ServingOptions(state_dtype="bfloat16")
        ).state_fields
    }
    assert f16["recurrent_state"].dtype == torch.bfloat16


def test_gqa_sliding_windows_are_paged_whole_and_said_so():
    """A GQA config's sliding-window layers page their whole context (a superset
    of the window: the model runs exactly), the bytes of full attention, and
    the plan says how many layers slide."""
    llama = load_config("llama-3.1-8b")[1]
    full = model_cache(llama)
    assert full.notes == ()
    cases = [
        # Mistral-7B-v0.1: a window on every layer.
        ({"model_type": "mistral", "sliding_window": 4096}, "32 of 32 layers"),
        # Qwen2: the layers from max_window_layers on, only when switched on.
        ({"use_sliding_window": True, "max_window_layers": 21, "sliding_window": 4096}, "11 of 32"),
        ({"use_sliding_window": False, "max_window_layers": 21, "sliding_window": 4096}, None),
        # layer_types says it per layer, wherever the window size is given.
        ({"layer_types": ["sliding_attention", "full_attention"] * 16}, "16 of 32 layers"),
        ({"layer_types": ["full_attention"] * 32, "sliding_window": 4096}, None),
        ({"sliding_window": None}, None),
    ]
    for fields, said in cases:
        m = model_cache({**llama, **fields})
        assert m.page_fields == full.page_fields
        assert m.kv_bytes_per_token == full.kv_bytes_per_token == 131_072
        if said is None:
            assert m.notes == (), fields
        else:
            (note,) = m.notes
            assert said in note and "pages their whole context" in note, (fields, note)
    assert "4096-token sliding window" in model_cache({**llama, "sliding_window": 4096}).notes[0]


def _kv(layers: int, heads: int, dim: int, dtype_bytes: int = 2) -> int:
    """K and V of ``heads`` x ``dim`` over ``layers``: one token (or one ring row)."""
    return layers * 2 * heads * dim * dtype_bytes


# Configs as their model cards publish them (the fields a cache reads), each with
# (family, KV bytes per token, ring bytes per request, note words or None).
MORE_FAMILIES = [
    (  # Qwen/Qwen3-30B-A3B: head_dim 128 is not hidden / heads (64)
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "hidden_size": 2048,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 48,
        },
        "gqa",
        _kv(48, 4, 128),
        0,
        None,
    ),
    (  # mistralai/Mixtral-8x7B-v0.1: head_dim from hidden / heads
        {
            "architectures": ["MixtralForCausalLM"],
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "sliding_window": None,
        },
        "gqa",
        _kv(32, 8, 128),
        0,
        None,
    ),
    (  # microsoft/Phi-3-mini-4k-instruct: a window on every layer, paged whole
        {
            "model_type": "phi3",
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "hidden_size": 3072,
            "sliding_window": 2047,
        },
        "gqa",
        _kv(32, 32, 96),
        0,
        "32 of 32 layers attend only a 2047-token",
    ),
    (  # Qwen/Qwen1.5-MoE-A2.7B
        {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "hidden_size": 2048,
            "use_sliding_window": False,
            "sliding_window": 32768,
            "max_window_layers": 21,
        },
        "gqa",
        _kv(24, 16, 128),
        0,
        None,
    ),
    (  # zai-org/GLM-4.5-Air
        {
            "model_type": "glm4_moe",
            "num_hidden_layers": 46,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_size": 4096,
        },
        "gqa",
        _kv(46, 8, 128),
        0,
        None,
    ),
    (  # google/gemma-2-9b: no layer_types; every other layer (the even ones) slides
        {
            "model_type": "gemma2",
            "num_hidden_layers": 42,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "hidden_size": 3584,
            "sliding_window": 4096,
        },
        "gemma2",
        _kv(21, 8, 256),
        4096 * _kv(21, 8, 256),
        "21 sliding-window layers",
    ),
    (  # CohereForAI/c4ai-command-r7b-12-2024: every 4th layer global
        {
            "model_type": "cohere2",
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "sliding_window": 4096,
            "sliding_window_pattern": 4,
        },
        "cohere2",
        _kv(8, 8, 128),
        4096 * _kv(24, 8, 128),
        "24 sliding-window layers",
    ),
    (  # gpt-oss without layer_types: alternate layers, sliding first
        {
            "architectures": ["GptOssForCausalLM"],
            "num_hidden_layers": 36,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "hidden_size": 2880,
            "sliding_window": 128,
        },
        "gpt_oss",
        _kv(18, 8, 64),
        128 * _kv(18, 8, 64),
        "128-token K/V ring",
    ),
]


@pytest.mark.parametrize(("config", "family", "kv", "ring", "said"), MORE_FAMILIES)
def test_more_families_read_their_configs(config, family, kv, ring, said):
    """GQA-shaped families page every layer (sliding ones whole, said so); the
    families whose configs name global and sliding layers keep a ring per
    request for the sliding ones. Bytes in bfloat16, as each model is served."""
    assert detect_family(config) == family
    m = model_cache({**config, "torch_dtype": "bfloat16"})
    assert m.family == family
    assert (m.kv_bytes_per_token, m.state_bytes) == (kv, ring)
    assert m.recurrent_layers == 0 and not m.is_hybrid
    notes = list(m.notes)
    if said is None:
        assert notes == []
    else:
        assert len(notes) == 1 and said in notes[0], notes
    # Tensor parallelism splits the KV heads (8 per rank at most here).
    tp = model_cache({**config, "torch_dtype": "bfloat16"}, ServingOptions(tp=8))
    per_rank = max(1, (config["num_key_value_heads"] + 7) // 8)
    assert tp.kv_bytes_per_token * config["num_key_value_heads"] == kv * per_rank


def test_a_multimodal_checkpoint_caches_for_its_language_model():
    """A wrapper type kvarena does not know is read through its ``text_config``
    (mistralai/Mistral-Small-3.1-24B: 40 Mistral layers, 8 KV heads of 128),
    with the checkpoint's dtype; nothing is guessed for a field it lacks."""
    text = {
        "model_type": "mistral",
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 5120,
    }
    wrapper = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": {"model_type": "pixtral"},
    }
    assert detect_family(wrapper) == "gqa"
    m = model_cache(wrapper)
    assert (m.family, m.kv_bytes_per_token, m.notes) == ("gqa", _kv(40, 8, 128), ())
    # The text config's own dtype wins over the checkpoint's.
    fp16 = model_cache({**wrapper, "text_config": {**text, "torch_dtype": "float16"}})
    assert {f.dtype for f in fp16.page_fields} == {torch.float16}
    # A text config that leaves a field to its class's default is refused by name.
    with pytest.raises(UnknownModelError, match=r"llava\.text_config: .*'num_hidden_layers'"):
        model_cache({"model_type": "llava", "text_config": {"model_type": "llama"}})
    with pytest.raises(UnknownModelError, match="model_type='blip'"):
        model_cache({"model_type": "blip", "text_config": {"model_type": "opt"}})


GRANITE_H = {  # shaped like ibm-granite/granite-4.0-h-tiny, in the hub's words
    "model_type": "granitemoehybrid",
    "torch_dtype": "bfloat16",
    "num_hidden_layers": 40,
    "hidden_size": 1536,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "layer_types": ["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 24,
    "mamba_n_heads": 48,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}


def _mamba2_layer(heads: int, dim: int, state: int, groups: int, kernel: int) -> int:
    """vLLM's Mamba2 states of one layer in bf16: conv (kernel - 1, heads x dim +
    2 x groups x state) and SSM (heads, dim, state)."""
    return 2 * ((kernel - 1) * (heads * dim + 2 * groups * state) + heads * dim * state)


def test_mamba2_hybrids_with_mamba_fields():
    """Granite 4.0 hybrids (``layer_types`` in the hub's words or transformers 5's)
    and Bamba (``attn_layer_indices``): attention layers page, Mamba2 layers keep
    Nemotron-H-shaped states."""
    m = model_cache(GRANITE_H)
    assert (m.family, m.attention_layers, m.state_layers, m.recurrent_layers) == (
        "granitemoehybrid",
        2,
        38,
        38,
    )
    assert m.is_hybrid
    assert m.kv_bytes_per_token == _kv(2, 4, 128)
    assert m.state_bytes == 38 * _mamba2_layer(48, 64, 128, 1, 4)
    # transformers 5 writes the same layers as full_attention / linear_attention.
    words5 = [
        "full_attention" if k == "attention" else "linear_attention"
        for k in GRANITE_H["layer_types"]
    ]
    assert model_cache({**GRANITE_H, "layer_types": words5}).state_fields == m.state_fields
    bamba = {
        **{k: v for k, v in GRANITE_H.items() if k != "layer_types"},
        "model_type": "bamba",
        "attn_layer_indices": [5, 15],
    }
    b = model_cache(bamba)
    assert (b.family, b.page_fields, b.state_fields) == ("bamba", m.page_fields, m.state_fields)
    # No attention named: every layer Mamba2, nothing pages.
    only = model_cache({k: v for k, v in bamba.items() if k != "attn_layer_indices"})
    assert (only.page_fields, only.state_layers) == ((), 40)
    # TP 4 splits the Mamba heads and their channels and the 4 KV heads; the one
    # group's B and C stay whole on every rank.
    tp = model_cache(GRANITE_H, ServingOptions(tp=4))
    assert tp.kv_bytes_per_token * 4 == m.kv_bytes_per_token
    assert tp.state_bytes == 38 * _mamba2_layer(12, 64, 128, 1, 4)
    for bad, words in [
        ({"attn_layer_indices": [5, 5]}, "names a layer twice"),
        ({"attn_layer_indices": [40]}, "'attn_layer_indices'"),
        ({"mamba_expand": 4}, "the Mamba2 inner size must agree"),
        ({"mamba_d_conv": 1}, "'mamba_d_conv'"),
    ]:
        with pytest.raises(UnknownModelError, match=words):
            model_cache({**bamba, **bad})
    with pytest.raises(UnknownModelError, match=r"layer_types holds \['moe'\]"):
        model_cache({**GRANITE_H, "layer_types": ["moe"] * 40})


def test_falcon_h1_layers_attend_and_keep_mamba2_states():
    """Falcon-H1 runs attention and Mamba2 side by side in every layer (here
    transformers' FalconH1Config defaults): all 32 layers page and all keep a
    state, sized by vLLM from mamba_d_ssm: conv (3, 1024 + 2 x 256)."""
    falcon = {
        "model_type": "falcon_h1",
        "torch_dtype": "bfloat16",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "mamba_d_ssm": 1024,
        "mamba_n_heads": 128,
        "mamba_d_head": 8,
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    }
    m = model_cache(falcon)
    assert (m.attention_layers, m.state_layers, m.recurrent_layers) == (32, 32, 32)
    assert m.kv_bytes_per_token == _kv(32, 8, 128)
    assert m.state_bytes == 32 * _mamba2_layer(128, 8, 256, 1, 4)
    assert [f.shape for f in m.state_fields] == [(3, 1536), (128, 8, 256)]
    with pytest.raises(UnknownModelError, match="mamba_d_ssm = 2048; the Mamba2 inner size"):
        model_cache({**falcon, "mamba_d_ssm": 2048})


def test_jamba_mamba_layers_beside_attention():
    """ai21labs/Jamba-v0.1 (and 1.5 Mini): every 8th layer from the 4th attends,
    the 28 others are Mamba (1) layers with vLLM's mamba1 states in bf16: conv
    (3, 8192) and SSM (8192, 16)."""
    jamba = {
        "architectures": ["JambaForCausalLM"],
        "torch_dtype": "bfloat16",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    }
    m = model_cache(jamba)
    assert (m.family, m.attention_layers, m.state_layers, m.is_hybrid) == ("jamba", 4, 28, True)
    assert m.kv_bytes_per_token == _kv(4, 8, 128)
    assert m.state_bytes == 28 * 2 * (3 * 8192 + 8192 * 16)
    fp32 = model_cache(jamba, ServingOptions(state_dtype="float32"))
    assert {f.name: f.dtype for f in fp32.state_fields}["ssm_state"] == torch.float32
    tp = model_cache(jamba, ServingOptions(tp=8))
    assert [f.shape for f in tp.state_fields] == [(3, 1024), (1024, 16)]
    # Transformers' defaults where the config names no period: 8 and 4.
    bare = {k: v for k, v in jamba.items() if not k.startswith("attn_layer")}
    assert model_cache(bare).attention_layers == 4
    with pytest.raises(UnknownModelError, match="'attn_layer_offset'"):
        model_cache({**jamba, "attn_layer_offset": 8})


def test_lfm2_short_conv_layers_beside_attention():
    """Shaped like LiquidAI/LFM2-1.2B: 6 of 16 layers attend (``full_attn_idxs`` in
    the first configs, ``layer_types`` later); each of the 10 conv layers keeps
    vLLM's short-conv state, (conv_L_cache - 1, hidden / TP) in the model dtype."""
    lfm2 = {
        "architectures": ["Lfm2ForCausalLM"],
        "torch_dtype": "bfloat16",
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "conv_L_cache": 3,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14],
    }
    m = model_cache(lfm2)
    assert (m.family, m.attention_layers, m.state_layers, m.recurrent_layers) == ("lfm2", 6, 10, 10)
    assert m.kv_bytes_per_token == _kv(6, 8, 64)
    assert m.state_bytes == 10 * 2 * 2048 * 2
    kinds = ["full_attention" if i in lfm2["full_attn_idxs"] else "conv" for i in range(16)]
    named = {k: v for k, v in lfm2.items() if k != "full_attn_idxs"}
    assert model_cache({**named, "layer_types": kinds}).state_fields == m.state_fields
    (conv,) = model_cache(lfm2, ServingOptions(tp=4)).state_fields
    assert conv.shape == (2, 512) and conv.dtype == torch.bfloat16
    for bad, words in [
        ({"full_attn_idxs": [2, 2]}, "names a layer twice"),
        ({"full_attn_idxs": [16]}, "'full_attn_idxs'"),
        ({"conv_L_cache": 1}, "'conv_L_cache'"),
    ]:
        with pytest.raises(UnknownModelError, match=words):
            model_cache({**lfm2, **bad})


def test_mamba2_groups_split_with_the_heads_or_are_replicated():
    """A rank's conv state holds its heads' channels and the B and C of their
    groups: groups that TP divides split with the heads, a single group is
    whole on every rank (vLLM's ``extra_groups_for_head_shards``), any other
    count is refused as vLLM's Mamba2 mixer refuses it."""
    for tp in (1, 2, 8):
        conv, ssm = model_cache("mamba2-2.7b", ServingOptions(tp=tp)).state_fields
        assert conv.shape == (3, 5120 // tp + 2 * 1 * 128)  # n_groups 1: replicated
        assert ssm.shape == (80 // tp, 64, 128)
    for tp in (1, 4, 8):
        conv, ssm = model_cache("nemotron-h-8b", ServingOptions(tp=tp)).state_fields
        assert conv.shape == (3, (8192 + 2 * 8 * 128) // tp)  # n_groups 8: split
        assert ssm.shape == (128 // tp, 64, 128)
    with pytest.raises(InvalidValueError, match=r"n_groups = 8 is not divisible by .* 16"):
        model_cache("nemotron-h-8b", ServingOptions(tp=16))


def test_llama4_chunked_layers_keep_a_ring_of_one_chunk():
    """meta-llama/Llama-4-Scout-17B-16E: 3 of every 4 layers attend within 8,192-token
    chunks (the RoPE layers; every 4th is global and NoPE). A chunked layer never
    reads past its chunk, so it keeps a ring of one chunk per request; the 12 global
    layers page. ``no_rope_layers`` (1 = chunked) wins over the interval; an empty
    list, as the hub's config has it, means the interval."""
    text = {
        "model_type": "llama4_text",
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 5120,
        "attention_chunk_size": 8192,
        "no_rope_layers": [],
    }
    scout = {"model_type": "llama4", "torch_dtype": "bfloat16", "text_config": text}
    m = model_cache(scout)
    assert (m.family, m.attention_layers, m.state_layers) == ("llama4", 12, 36)
    assert m.kv_bytes_per_token == _kv(12, 8, 128)
    assert m.state_bytes == 8192 * _kv(36, 8, 128)
    (note,) = m.notes
    assert "36 chunked-attention layers keep a 8192-token K/V ring" in note
    flags = [0] * 8 + [1] * 40
    listed = model_cache({**scout, "text_config": {**text, "no_rope_layers": flags}})
    assert (listed.attention_layers, listed.state_layers) == (8, 40)
    kinds = ["chunked_attention" if f else "full_attention" for f in flags]
    typed = model_cache({**scout, "text_config": {**text, "layer_types": kinds}})
    assert typed.state_fields == listed.state_fields
    for bad, words in [
        ({"no_rope_layers": [1, 0]}, "no_rope_layers names 2 layers"),
        ({"no_rope_layers": [2] * 48}, "'no_rope_layers'"),
        ({"layer_types": ["sliding_attention"] * 48}, "layer_types holds"),
        ({"attention_chunk_size": 0}, "'attention_chunk_size'"),
    ]:
        with pytest.raises(UnknownModelError, match=words):
            model_cache({**scout, "text_config": {**text, **bad}})


def test_windowed_families_count_layers_from_layer_types():
    """``layer_types`` wins over a pattern, whatever the order of the kinds; a
    config that names no sliding layer keeps no ring and says nothing."""
    base = load_config("gpt-oss-20b")[1]
    kinds = ["full_attention"] * 5 + ["sliding_attention"] * 19
    m = model_cache({**base, "layer_types": kinds, "sliding_window_pattern": 2})
    assert (m.attention_layers, m.state_layers) == (5, 19)
    assert m.kv_bytes_per_token == _kv(5, 8, 64)
    assert m.state_bytes == 128 * _kv(19, 8, 64)
    full = model_cache({**base, "layer_types": ["full_attention"] * 24})
    assert (full.state_fields, full.notes, full.state_layers) == ((), (), 0)
    assert full.kv_bytes_per_token == _kv(24, 8, 64)
    # Every sliding: nothing pages, every layer keeps its ring.
    ring = model_cache({**base, "layer_types": ["sliding_attention"] * 24})
    assert (ring.page_fields, ring.attention_layers) == ((), 0)
    assert ring.state_bytes == 128 * _kv(24, 8, 64)


def test_config_sources_and_family_detection(tmp_path):
    name, cfg = load_config("nemotron-h-8b")
    assert name == "nemotron-h-8b"
    assert detect_family(cfg) == "nemotron_h"
    path = tmp_path / "my-model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    assert model_cache(path).state_bytes == model_cache(cfg).state_bytes == 51_806_208
    # Named by the checkout's folder, or by a config file's own name.
    assert load_config(path)[0] == load_config(path / "config.json")[0] == "my-model"
    (path / "nemotron-small.json").write_text(json.dumps(cfg))
    assert load_config(path / "nemotron-small.json")[0] == "nemotron-small"
    assert model_cache(path / "nemotron-small.json").name == "nemotron-small"
    # mamba_ssm-format config (no model_type): detected by ssm_cfg.
    ssm = {
        "d_model": 2560,
        "n_layer": 64,
        "ssm_cfg": {"layer": "Mamba2"},
        "torch_dtype": "bfloat16",
    }
    assert model_cache(ssm).state_bytes == 85_950_464
    with pytest.raises(UnknownModelError, match="model_type='gpt2'"):
        model_cache({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnknownModelError, match="not a built-in preset"):
        model_cache("no-such-model")
    with pytest.raises(UnknownModelError, match="lacks the field 'num_hidden_layers'"):
        model_cache({"model_type": "llama"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 0}, "tp"),
        ({"kv_dtype": "int4"}, "kv_dtype"),
        ({"state_dtype": "fp8"}, "state_dtype"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_serving_option_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServingOptions(**kwargs)
    with pytest.raises(ValueError, match="MLA format"):
        model_cache("llama-3.1-8b", ServingOptions(kv_dtype="fp8_ds_mla"))


def test_every_preset_counts_agree_with_its_fields():
    for preset in PRESETS:
        m = model_cache(preset)
        assert all(f.layers > 0 for f in (*m.page_fields, *m.state_fields)), preset
        # A block's bytes are whole tokens' bytes, in every paged field.
        assert all(f.bytes_per_entry % m.block_size == 0 for f in m.page_fields), preset
        # The layers that hold state are the widest state field's (every such layer has one).
        assert m.state_layers == max((f.layers for f in m.state_fields), default=0), preset
        widest = max((f.layers for f in m.page_fields), default=0)
        assert widest <= m.attention_layers <= sum(f.layers for f in m.page_fields), preset
        assert m.recurrent_layers in (0, m.state_layers), preset
        assert m.is_hybrid == (preset in HYBRIDS), preset


def test_against_the_facts_file():
    # CI lays shared/ beside the checkout: a missing facts file there is a failure,
    # never a silent skip. Only outside CI may a bare checkout skip it, saying why.
    if not FACTS.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{FACTS} is missing; CI must run with shared/ beside the checkout")
        pytest.skip(f"{FACTS} not beside this checkout (outside CI)")
    facts = json.loads(FACTS.read_text())
    llama = facts["llama-3.1-8b-instruct"]["attention_kv"]["per_token_all_layers"]
    assert model_cache("llama-3.1-8b").kv_bytes_per_token == llama["bf16"]
    nxt = facts["qwen3-next-80b-a3b"]["recurrent_state"]["per_request_all_36_layers"]
    assert model_cache("qwen3-next-80b-a3b").state_bytes == nxt["bf16_state"]
    nem = facts["nemotron-h-8b"]["recurrent_state"]["per_request_24_layers"]
    assert (
        model_cache("nemotron-h-8b", ServingOptions(state_dtype="float32")).state_bytes
        == nem["fp32_ssm"]
    )
    v3 = facts["deepseek-v3-r1"]["attention_kv"]["per_token_all_layers"]
    assert (
        model_cache("deepseek-v3", ServingOptions(kv_dtype="fp8_ds_mla")).kv_bytes_per_token
        == v3["fp8_ds_mla"]
    )
