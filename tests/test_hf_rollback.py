"""Taking a draft back: ``crop`` on every kind of layer, token-identical to
``DynamicCache``.

Paged layers truncate their tables, sliding rings step back into their
rollback rows, and linear-attention states come back either from the states
the model handed over while recording (transformers >= 5.25's
``recurrent_states_to_keep``) or, where those do not reach, by replaying the
accepted tokens from the rollback entry (a cache made with ``model=``).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

import kvarena  # noqa: E402
from kvarena.integrations.transformers import KvarenaPool  # noqa: E402
from kvarena.integrations.transformers.pool import forward_with  # noqa: E402
from kvarena.integrations.transformers.tiny import tiny_model  # noqa: E402

STATEFUL = ["qwen3_next", "nemotron_h", "kimi_linear", "mamba2"]
# transformers 5.25 hands a forward's intermediate recurrent states to a recording
# cache and lets assisted generation run on stateful models.
HANDS_STATES = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 25)
needs_5_25 = pytest.mark.skipif(
    not HANDS_STATES, reason=f"transformers {transformers.__version__} hands no recurrent states"
)


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, family):
    if family not in models:
        models[family] = tiny_model(family)
    return models[family]


def _prompts(batch, length, seed=0):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def _pool(model, **kw):
    return KvarenaPool.from_config(
        model.config, dtype=model.dtype, budget_bytes=8 << 20, max_seqs=8, **kw
    )


def _all_back(pool):
    assert pool.live_caches == 0
    assert pool.cache.blocks.num_live == 0
    assert pool.cache.slots.num_free == pool.cache.slots.capacity


def _reference(model, ids, mask, **gen):
    return model.generate(ids, attention_mask=mask, cache=DynamicCache(config=model.config), **gen)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_assisted_decoding_is_token_identical(models, family):
    """A draft model proposes, the model verifies, crop() takes back the rejected
    tokens: paged layers truncate, sliding rings step back into their rollback rows."""
    model = _model(models, family)
    helper = tiny_model(family, seed=0, num_hidden_layers=2 if family == "llama" else 4)
    ids, mask = _prompts(1, 20, seed=4)
    gen = dict(max_new_tokens=24, do_sample=False, assistant_model=helper)
    want = _reference(model, ids, mask, **gen)
    pool = _pool(model, rollback_tokens=32)
    cache = pool.new_cache(1)
    got = model.generate(ids, attention_mask=mask, cache=cache, **gen)
    assert torch.equal(got, want)
    pool.release(cache)
    _all_back(pool)


def _speculative(model, ids, cache, ref, new, k=4, keep=None):
    """Greedy decoding that verifies drafts: ``ref``'s own tokens with one of them
    corrupted per round (at a rotating place, or none), so every round crops a
    different number of rejected tokens."""
    cache.activate_past_recording(recurrent_states_to_keep=keep)
    p = ids.shape[1]
    with torch.no_grad():
        out = ids
        nxt = forward_with(model, ids, cache).logits[:, -1:].argmax(-1)
        for rnd in range(4 * new):
            if out.shape[1] - p >= new:
                break
            out = torch.cat([out, nxt], 1)
            draft = ref[:, out.shape[1] : out.shape[1] + k].clone()
            if rnd % (k + 1) < draft.shape[1]:
                draft[0, rnd % (k + 1)] = (draft[0, rnd % (k + 1)] + 1) % 128
            pred = forward_with(model, torch.cat([nxt, draft], 1), cache).logits.argmax(-1)
            a = 0
            while a < draft.shape[1] and pred[0, a] == draft[0, a]:
                a += 1
            out = torch.cat([out, draft[:, :a]], 1)
            cache.crop(a - draft.shape[1])
            nxt = pred[:, a : a + 1]
    return out[:, : p + new]


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear", "mamba2", "gemma3_text", "llama"])
def test_speculative_decoding_with_crop_is_token_identical(models, family):
    """transformers refuses assisted generate on stateful models, so an engine's own
    draft-and-verify loop drives the cache: crop rolls the linear states back
    through the rollback entry (replaying the accepted tokens), and greedy
    decoding gives the tokens plain greedy decoding gives."""
    model = _model(models, family)
    ids, mask = _prompts(1, 20, seed=1)
    ref = _reference(model, ids, mask, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    pool = _pool(model, rollback_tokens=8)
    cache = pool.new_cache(1, model=model)
    got = _speculative(model, ids, cache, ref, 24)
    assert torch.equal(got, ref[:, :44])
    pool.release(cache)
    _all_back(pool)
    assert not model._forward_pre_hooks and all(
        not m._forward_pre_hooks for m in model.modules()
    )  # the cache's hooks left with it


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "kimi_linear", "mamba2"])
def test_crop_leaves_the_state_of_the_accepted_tokens(models, family):
    """After a 5-token forward and crop(-3), the linear states are those of
    processing only the 2 accepted tokens from the same point (up to the float
    rounding of computing their inputs inside a longer forward)."""
    model = _model(models, family)
    pool = _pool(model, rollback_tokens=8)
    ids, _ = _prompts(1, 24, seed=8)
    a, b = pool.new_cache(1, model=model), pool.new_cache(1)
    with torch.no_grad():
        forward_with(model, ids[:, :19], a)
        forward_with(model, ids[:, :19], b)
        a.activate_past_recording()
        forward_with(model, ids[:, 19:24], a)
        with pytest.raises(kvarena.InvalidValueError, match="roll back only the 5 tokens"):
            a.crop(-6)  # refused, nothing changed
        a.crop(-3)
        forward_with(model, ids[:, 19:21], b)
    for name in ("conv_state", "recurrent_state"):
        sa, sb = a.rows.state(name), b.rows.state(name)
        assert torch.allclose(sa, sb, atol=1e-5, rtol=1e-4), (name, (sa - sb).abs().max())
    assert a.get_seq_length() == b.get_seq_length()
    with pytest.raises(kvarena.InvalidValueError, match="cropped already"):
        a.crop(-1)
    pool.release(a)
    pool.release(b)
    _all_back(pool)


def test_crop_refusals_change_nothing(models):
    model = _model(models, "gemma3_text")
    pool = _pool(model, rollback_tokens=4)  # a 12-row ring for the 8-token window
    cache = pool.new_cache(1)
    ids, _ = _prompts(1, 30, seed=6)
    with torch.no_grad():
        forward_with(model, ids, cache)
    for bad in (1, -31, 1.5):
        with pytest.raises(kvarena.InvalidValueError, match="crop"):
            cache.crop(bad)
    with pytest.raises(kvarena.InvalidValueError, match="rolls back at most 5 tokens"):
        cache.crop(-6)
    assert cache.get_seq_length() == 30 and len(cache.block_tables[0].blocks) == 2
    cache.crop(0)
    cache.crop(-5)
    assert cache.get_seq_length() == 25
    assert all(layer.get_seq_length() == 25 for layer in cache.layers)
    pool.release(cache)
    nocrop = _pool(model)  # no rollback rows: transformers' own check refuses the draft
    cache = nocrop.new_cache(1)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cropped"):
        model.generate(ids, cache=cache, max_new_tokens=4, assistant_model=model)
    nocrop.release(cache)
    _all_back(pool)
    _all_back(nocrop)


@needs_5_25
@pytest.mark.parametrize("family", STATEFUL)
def test_assisted_generate_on_stateful_models_is_token_identical(models, family):
    """transformers >= 5.25 drafts and verifies on linear-attention models: the
    cache keeps the states each verification hands over and crops to them, with
    no replay (the cache is made without ``model=``)."""
    model = _model(models, family)
    helper = tiny_model(family, seed=0)
    ids, mask = _prompts(1, 20, seed=4)
    gen = dict(max_new_tokens=24, do_sample=False)
    plain = _reference(model, ids, mask, **gen)
    want = _reference(model, ids, mask, assistant_model=helper, **gen)
    pool = _pool(model, rollback_tokens=8)
    cache = pool.new_cache(1)
    got = model.generate(ids, attention_mask=mask, cache=cache, assistant_model=helper, **gen)
    assert torch.equal(got, want) and torch.equal(got, plain)
    assert cache.get_seq_length() == got.shape[1] - 1
    pool.release(cache)
    _all_back(pool)


@needs_5_25
@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
def test_speculative_decoding_with_kept_states_is_token_identical(models, family):
    """An engine's draft-and-verify loop asking for ``recurrent_states_to_keep``:
    every crop, of 0 to k tokens, is served by the kept states alone."""
    model = _model(models, family)
    ids, mask = _prompts(1, 20, seed=1)
    ref = _reference(model, ids, mask, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    pool = _pool(model)  # no rollback entry and no model: nothing to replay with
    cache = pool.new_cache(1)
    assert not cache.is_croppable
    got = _speculative(model, ids, cache, ref, 24, keep=5)
    assert cache.is_croppable
    assert torch.equal(got, ref[:, :44])
    pool.release(cache)
    _all_back(pool)


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
def test_a_crop_past_the_kept_states_replays_or_is_refused(models, family):
    """One kept state does not reach 3 tokens back into a 5-token forward: a cache
    with ``model=`` replays the accepted tokens, one without refuses and changes
    nothing."""
    model = _model(models, family)
    pool = _pool(model, rollback_tokens=8)
    ids, _ = _prompts(1, 24, seed=8)
    a, b, c = pool.new_cache(1, model=model), pool.new_cache(1), pool.new_cache(1)
    with torch.no_grad():
        for cache in (a, b, c):
            forward_with(model, ids[:, :19], cache)
        for cache in (a, c):
            cache.activate_past_recording(recurrent_states_to_keep=1)
            forward_with(model, ids[:, 19:24], cache)
        before = {n: c.rows.state(n).clone() for n in ("conv_state", "recurrent_state")}
        with pytest.raises(kvarena.InvalidValueError, match="recurrent_states_to_keep"):
            c.crop(-3)
        assert c.get_seq_length() == 24
        assert all(torch.equal(c.rows.state(n), t) for n, t in before.items())
        a.crop(-3)
        forward_with(model, ids[:, 19:21], b)
    for name in ("conv_state", "recurrent_state"):
        sa, sb = a.rows.state(name), b.rows.state(name)
        assert torch.allclose(sa, sb, atol=1e-5, rtol=1e-4), (name, (sa - sb).abs().max())
    assert a.get_seq_length() == b.get_seq_length() == 21
    for cache in (a, b, c):
        pool.release(cache)
    _all_back(pool)


def test_recording_refuses_a_nonsense_count(models):
    model = _model(models, "qwen3_next")
    pool = _pool(model)
    cache = pool.new_cache(1)
    for bad in (-1, 2.0, True):
        with pytest.raises(kvarena.InvalidValueError, match="recurrent_states_to_keep"):
            cache.activate_past_recording(recurrent_states_to_keep=bad)
    assert not cache.recording and cache.get_recurrent_states_to_keep() == 0
    pool.release(cache)
    _all_back(pool)


@pytest.mark.parametrize("family", ["mamba2", "qwen3_next"])
def test_linear_layers_count_their_tokens(models, family):
    """Every linear layer counts the tokens it took (a prefill, in-place decode
    steps), so a model with no attention layer still reports its length. Before
    5.25 transformers did not report in-place decode steps: there a hybrid's
    length is its attention layers'."""
    if not HANDS_STATES and family == "mamba2":
        pytest.skip(f"transformers {transformers.__version__} does not report decode steps")
    model = _model(models, family)
    pool = _pool(model)
    ids, mask = _prompts(1, 13, seed=2)
    cache = pool.new_cache(1)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False)
    linear = [x for x in cache.layers if type(x).__name__ == "LinearLayer"]
    assert cache.get_seq_length() == out.shape[1] - 1
    if HANDS_STATES:
        assert linear and all(x.get_seq_length() == out.shape[1] - 1 for x in linear)
    if HANDS_STATES:  # DynamicCache counts linear layers from 5.25 on
        ref = DynamicCache(config=model.config)
        model.generate(ids, attention_mask=mask, cache=ref, max_new_tokens=6, do_sample=False)
        assert int(ref.get_seq_length()) == cache.get_seq_length()
    pool.release(cache)
    _all_back(pool)
