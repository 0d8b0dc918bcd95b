"""Real transformers models generating with their cache in a kvarena pool.

Tiny random models built from configs (no downloads), float32, greedy: every
token must equal what the same model produces with transformers' own
``DynamicCache``, and every block and slot must come back on release.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

import kvarena  # noqa: E402
from kvarena.integrations.transformers import KvarenaPool, hf_layout  # noqa: E402
from kvarena.integrations.transformers.layout import LINEAR, PAGED, RING  # noqa: E402
from kvarena.integrations.transformers.pool import forward_with  # noqa: E402
from kvarena.integrations.transformers.tiny import TINY, tiny_model  # noqa: E402

FAMILIES = sorted(TINY)
HYBRID = ["gemma3_text", "qwen3_next", "nemotron_h", "kimi_linear"]
NEW = 10


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, family, dtype=torch.float32):
    key = (family, dtype)
    if key not in models:
        models[key] = tiny_model(family, dtype=dtype)
    return models[key]


def _prompts(batch, length, seed=0, pad=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if pad:  # row 0 left-padded by `pad` tokens
        ids[0, :pad] = 0
        mask[0, :pad] = 0
    return ids, mask


def _pool(model, **kw):
    kw.setdefault("budget_bytes", 8 << 20)
    kw.setdefault("max_seqs", 8)
    return KvarenaPool.from_config(model.config, dtype=model.dtype, **kw)


def _all_back(pool):
    c = pool.cache
    assert pool.live_caches == 0
    assert c.blocks.num_live == 0
    assert c.slots.num_free == c.slots.capacity


def _reference(model, ids, mask, **gen):
    cache = DynamicCache(config=model.config)
    return model.generate(ids, attention_mask=mask, cache=cache, **gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_layout_declares_what_the_model_caches(models, family, dtype):
    """Every field's per-row shape and dtype equals what DynamicCache holds after
    a real forward (bf16 models keep float32 recurrent states)."""
    model = _model(models, family, dtype)
    layout = hf_layout(model.config, dtype=model.dtype)
    cache = DynamicCache(config=model.config)
    ids, _ = _prompts(2, 5)
    with torch.no_grad():
        forward_with(model, ids, cache)
    fields = {f.name: f for f in (*layout.model.page_fields, *layout.model.state_fields)}
    assert len(cache.layers) == len(layout.kinds)
    for i, (kind, layer) in enumerate(zip(layout.kinds, cache.layers, strict=True)):
        if kind in (PAGED, RING):
            k, v = ("k", "v") if kind == PAGED else ("k_window", "v_window")
            assert (
                tuple(layer.keys.shape[1:2]) + tuple(layer.keys.shape[3:]) == fields[k].shape[1:]
            ), i
            assert (
                tuple(layer.values.shape[1:2]) + tuple(layer.values.shape[3:])
                == fields[v].shape[1:]
            )
            assert layer.keys.dtype == fields[k].dtype == dtype
        elif kind == LINEAR:
            conv, rec = layer.conv_states[0], layer.recurrent_states[0]
            assert tuple(conv.shape[1:]) == fields["conv_state"].shape and conv.dtype == dtype
            if rec is None:  # a conv-only layer (LFM2): the pool declares no recurrent state
                assert "recurrent_state" not in fields
                continue
            assert tuple(rec.shape[1:]) == fields["recurrent_state"].shape
            assert rec.dtype == fields["recurrent_state"].dtype == torch.float32
        else:
            assert getattr(layer, "keys", None) is None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch,pad", [(1, 0), (2, 5)])
def test_greedy_is_token_identical(models, family, batch, pad):
    model = _model(models, family)
    ids, mask = _prompts(batch, 21, seed=batch, pad=pad)
    want = _reference(model, ids, mask, max_new_tokens=NEW, do_sample=False)
    pool = _pool(model)
    cache = pool.new_cache(batch)
    got = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got, want)
    if pool.cache.state_fields:  # the batch's states are views into one run of slots
        slots = [s[0] for s in cache.slots]
        assert slots == list(range(slots[0], slots[0] + batch))
    pool.release(cache)
    _all_back(pool)


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "gemma3_text"])
def test_seeded_sampling_is_token_identical(models, family):
    model = _model(models, family)
    ids, mask = _prompts(2, 12, seed=3)
    gen = dict(max_new_tokens=NEW, do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(7)
    want = _reference(model, ids, mask, **gen)
    pool = _pool(model)
    cache = pool.new_cache(2)
    torch.manual_seed(7)
    got = model.generate(ids, attention_mask=mask, cache=cache, **gen)
    assert torch.equal(got, want)
    pool.release(cache)
    _all_back(pool)


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_is_token_identical(models, family):
    """Beams share blocks (copied on write) and copy each state whole on reorder."""
    model = _model(models, family)
    ids, mask = _prompts(1, 19, seed=5)
    gen = dict(max_new_tokens=NEW, num_beams=3, do_sample=False, early_stopping=False)
    want = _reference(model, ids, mask, **gen)
    pool = _pool(model)
    cache = pool.new_cache(3)
    got = model.generate(ids, attention_mask=mask, cache=cache, **gen)
    assert torch.equal(got, want)
    pool.release(cache)
    _all_back(pool)


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text"])
def test_scattered_slots_fall_back_to_copies(models, family):
    """When no run of slots is free, the states are gathered copies written back
    by sync(): same tokens, and the slots hold the final states."""
    model = _model(models, family)
    pool = _pool(model, max_seqs=6)
    c = pool.cache
    hold = c.allocate_slots_batch([("x", i) for i in range(c.num_slots)])
    for i in range(0, c.num_slots, 2):
        c.release_slots(("x", i))  # every other slot free: no two consecutive
    ids, mask = _prompts(2, 21, seed=9, pad=3)
    want = _reference(model, ids, mask, max_new_tokens=NEW, do_sample=False)
    cache = pool.new_cache(2)
    slots = [s[0] for s in cache.slots]
    assert c.state_rows("k_window" if family == "gemma3_text" else "conv_state", slots) is None
    got = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got, want)
    name = c.state_fields[0].name
    cache.sync()
    assert torch.equal(c.gather_states(name, slots), cache.rows.state(name))
    pool.release(cache)
    for i in range(1, len(hold), 2):
        c.release_slots(("x", i))
    _all_back(pool)


@pytest.mark.parametrize(
    "family", ["llama", "gemma3_text", "qwen3_next", "nemotron_h", "kimi_linear"]
)
def test_prefix_reuse_is_token_identical(models, family):
    """A second prompt sharing a prefix reuses its blocks and restores the state
    image, computes only the rest, and generates what an uncached run does."""
    model = _model(models, family)
    pool = _pool(model, budget_bytes=16 << 20)
    first, _ = _prompts(1, 45, seed=11)
    cache = pool.prefill(model, first)
    assert pool.prefix.metrics.hit_tokens == 0
    # Computed up to the image boundary (hybrids keep one at 32 tokens), no further.
    assert cache.get_seq_length() == (32 if pool.prefix.spec is not None else 0)
    out1 = model.generate(first, cache=cache, max_new_tokens=NEW, do_sample=False)
    pool.release(cache)
    assert torch.equal(
        out1, _reference(model, first, torch.ones_like(first), max_new_tokens=NEW, do_sample=False)
    )
    # Shares 40 tokens: two whole blocks of 16 (an image at 32 tokens).
    second = torch.cat([first[:, :40], _prompts(1, 9, seed=12)[0]], dim=1)
    for prompt, least in ((second, 32), (first, 32)):
        cache = pool.prefill(model, prompt)
        hit = cache.get_seq_length()
        assert least <= hit <= prompt.shape[1] - 1 and hit % 16 == 0
        got = model.generate(prompt, cache=cache, max_new_tokens=NEW, do_sample=False)
        pool.release(cache)
        want = _reference(
            model, prompt, torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False
        )
        assert torch.equal(got, want)
    assert pool.prefix.metrics.hit_tokens >= 64
    if pool.prefix.spec is not None:
        assert pool.prefix.metrics.images_read >= 2
    _all_back(pool)


def test_crop_rolls_back_attention(models):
    model = _model(models, "llama")
    ids, _ = _prompts(1, 20, seed=13)
    pool = _pool(model)
    cache = pool.new_cache(1)
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        a = model(input_ids=ids, cache=cache, use_cache=True).logits
        b = model(input_ids=ids, cache=ref, use_cache=True).logits
        assert torch.equal(a, b)
        cache.crop(-7)
        ref.crop(-7)
        assert cache.get_seq_length() == ref.get_seq_length() == 13
        nxt = ids[:, 13:16]
        a = model(input_ids=nxt, cache=cache, use_cache=True).logits
        b = model(input_ids=nxt, cache=ref, use_cache=True).logits
    assert torch.equal(a, b)
    assert len(cache.block_tables[0].blocks) == 1  # 16 tokens: one block
    pool.release(cache)
    _all_back(pool)


def test_refusals(models):
    model = _model(models, "qwen3_next")
    pool = _pool(model)
    cache = pool.new_cache(1)
    with pytest.raises(kvarena.InvalidValueError, match="cannot roll back"):
        cache.crop(-1)
    assert not cache.is_croppable
    pool.release(cache)
    with pytest.raises(kvarena.InvalidValueError, match="rollback_tokens"):
        pool.new_cache(1, model=model)  # no rollback entry in this pool
    with pytest.raises(kvarena.InvalidValueError, match="released already"):
        pool.release(cache)
    with pytest.raises(kvarena.InvalidValueError, match="one prompt"):
        pool.prefill(model, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(kvarena.InvalidValueError, match="batch_size"):
        pool.new_cache(0)
    bf16 = _model(models, "qwen3_next", torch.bfloat16)
    cache = pool.new_cache(1)  # a float32 pool
    with pytest.raises(kvarena.LayoutMismatchError, match="dtype"):
        bf16(input_ids=torch.ones(1, 3, dtype=torch.long), cache=cache, use_cache=True)
    pool.release(cache)
    _all_back(pool)


def test_a_config_without_dtype_is_not_bfloat16(models):
    model = _model(models, "llama")
    assert model.config.dtype is None or model.config.dtype == torch.float32
    layout = hf_layout(model.config)
    assert layout.dtype == torch.get_default_dtype() == torch.float32
    with pytest.raises(kvarena.InvalidValueError, match="unsupported"):
        hf_layout(model.config, dtype="int8")


@pytest.mark.parametrize("family", FAMILIES)
def test_presets_read_transformers5_configs(family):
    """The presets read the configs transformers 5 writes: ``layer_types`` (Qwen3-Next's
    here is not periodic), ``layers_block_type`` (Nemotron-H), Kimi's flat fields, and
    ``dtype: null`` (float32, with a note, never a silent bfloat16)."""
    from kvarena.integrations.transformers.tiny import tiny_config

    config = tiny_config(family)
    layout = hf_layout(config)
    model = kvarena.model_cache(config.to_dict())
    assert model.attention_layers == layout.counts[PAGED]
    assert model.state_layers == layout.counts[RING] + layout.counts[LINEAR]
    assert any("names no dtype" in n for n in model.notes)
    assert {f.dtype for f in (*model.page_fields, *model.state_fields)} == {torch.float32}
    bf16 = kvarena.model_cache(config.to_dict(), kvarena.ServingOptions(dtype="bfloat16"))
    assert not any("names no dtype" in n for n in bf16.notes)
    assert bf16.page_fields == () or bf16.page_fields[0].dtype == torch.bfloat16
    named = kvarena.model_cache({**config.to_dict(), "dtype": "bfloat16"})
    assert not any("names no dtype" in n for n in named.notes)
    if family in ("nemotron_h", "mamba2"):
        ssm = {f.name: f for f in named.state_fields}["ssm_state"]
        # transformers 5 writes mamba_ssm_cache_dtype="float32" for Nemotron-H
        want = (
            torch.float32
            if config.to_dict().get("mamba_ssm_cache_dtype") == "float32"
            else torch.bfloat16
        )
        assert ssm.dtype == want


def test_preset_refuses_a_nonsense_dtype():
    with pytest.raises(kvarena.InvalidValueError, match="dtype 'int4' unknown"):
        kvarena.ServingOptions(dtype="int4")
    with pytest.raises(kvarena.UnknownModelError, match="unsupported"):
        kvarena.model_cache(
            {
                "model_type": "llama",
                "dtype": "int8",
                "num_hidden_layers": 2,
                "num_key_value_heads": 2,
                "head_dim": 8,
            }
        )


def test_layer_types_without_a_layout_are_refused_by_name():
    """DeepSeek-V4's compressed-attention layers keep transformers' own cache classes
    (compressor rings built from the config): refused, naming the types."""
    from transformers import AutoConfig

    with pytest.raises(kvarena.UnknownModelError, match="compressed_sparse_attention"):
        hf_layout(AutoConfig.for_model("deepseek_v4"))


def test_qwen3_5_preset_reads_its_text_config():
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_5", dtype="bfloat16")
    model = kvarena.model_cache(config.to_dict())
    text = config.get_text_config(decoder=True)
    assert model.attention_layers == text.layer_types.count("full_attention")
    assert model.state_layers == text.layer_types.count("linear_attention")
    assert hf_layout(config).counts == {
        PAGED: model.attention_layers,
        RING: 0,
        LINEAR: model.state_layers,
    }


GQA_TYPES = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "phi3",
    "olmo2",
    "granite",
    "starcoder2",
    "glm4",
    "glm4_moe",
    "smollm3",
    "ernie4_5",
    "ernie4_5_moe",
    "seed_oss",
]


@pytest.mark.parametrize("model_type", GQA_TYPES)
def test_gqa_presets_read_transformers_configs(model_type):
    """Each GQA model type's config as transformers writes it plans every layer's
    K and V with the head count and head size transformers' attention uses
    (``head_dim``, else hidden size over heads), and agrees with the layout the
    transformers integration derives from the same config."""
    from transformers import AutoConfig

    # transformers' default GLM-4.5 config names no head_dim (96 heads do not divide
    # its hidden size); the released checkpoints name 128.
    extra = {"head_dim": 128} if model_type == "glm4_moe" else {}
    config = AutoConfig.for_model(model_type, num_hidden_layers=3, **extra)
    text = config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    m = kvarena.model_cache({**config.to_dict(), "dtype": "bfloat16"})
    assert m.family == "gqa" and m.attention_layers == 3 and m.state_fields == ()
    assert m.kv_bytes_per_token == 3 * 2 * text.num_key_value_heads * head_dim * 2
    layout = hf_layout(config, dtype=torch.bfloat16)
    assert layout.counts[PAGED] == 3
    assert {f.name: f.shape[1:] for f in layout.model.page_fields} == {
        f.name: f.shape[1:] for f in m.page_fields
    }


def test_every_architecture_the_presets_name_is_one_transformers_has():
    """``architectures`` detection only helps if the names are real: each one
    the presets map is a class transformers exports."""
    import transformers

    from kvarena.models.loading import _FAMILY_BY_ARCH

    missing = [a for a in _FAMILY_BY_ARCH if not hasattr(transformers, a)]
    assert missing == []
