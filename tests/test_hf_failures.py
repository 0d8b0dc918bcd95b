"""The transformers pool when things go wrong: a forward that raises leaves nothing
committed that was not written, a released cache refuses every use, and bad input is
refused before any book changes."""

from __future__ import annotations

import pytest
import torch
from test_hf import NEW, _all_back, _model, _pool, _prompts, _reference

import kvarena
from kvarena.integrations.transformers.layout import PAGED

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models():
    return {}  # tiny models built once per module (test_hf's cache of them)


class Boom(RuntimeError):
    pass


def _layers(model):
    return model.model.layers


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_a_forward_that_raises_commits_only_what_every_layer_wrote(models, family):
    model = _model(models, family)
    pool = _pool(model, budget_bytes=16 << 20)
    prompt, _ = _prompts(1, 70, seed=21)
    cache = pool.prefill(model, prompt)
    before = cache.block_tables[0].tokens if cache.block_tables else 0
    # Raise before the last paged layer runs: every layer before it wrote.
    paged = [i for i, kind in enumerate(pool.layout.kinds) if kind == PAGED]
    last = _layers(model)[paged[-1]]

    def boom(*args, **kwargs):
        raise Boom("a layer failed")

    handle = last.register_forward_pre_hook(boom)
    try:
        with pytest.raises(Boom):
            model.generate(prompt, cache=cache, max_new_tokens=NEW, do_sample=False)
    finally:
        handle.remove()
    if cache.block_tables:  # the tables still say what the last whole forward wrote
        assert cache.block_tables[0].tokens == before
    pool.release(cache)
    # The same prompt again: whatever it reuses was written by every layer.
    again = pool.prefill(model, prompt)
    assert again.get_seq_length() <= max(before, 0) or again.get_seq_length() % 16 == 0
    got = model.generate(prompt, cache=again, max_new_tokens=NEW, do_sample=False)
    pool.release(again)
    want = _reference(model, prompt, torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got, want)
    _all_back(pool)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_a_released_cache_refuses_every_use(models, family):
    model = _model(models, family)
    pool = _pool(model)
    ids, mask = _prompts(1, 20, seed=5)
    old = pool.new_cache(1)
    model.generate(ids, attention_mask=mask, cache=old, max_new_tokens=3, do_sample=False)
    pool.release(old)
    other = pool.new_cache(1)  # may take the same slot and blocks
    out = model.generate(ids, attention_mask=mask, cache=other, max_new_tokens=NEW, do_sample=False)
    step = out[:, -1:]
    for use in (
        lambda: model(input_ids=step, cache=old, use_cache=True),
        lambda: old.get_seq_length(),
        lambda: old.reorder_cache(torch.tensor([0])),
        lambda: old.crop(-1),
        lambda: old.reset(),
        *(
            (lambda layer=layer: layer.update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1)))
            for layer in old.layers
            if type(layer).__name__ == "PagedLayer"
        ),
        *(
            (lambda layer=layer: layer.update_conv_state(torch.zeros(1, 1, 1)))
            for layer in old.layers
            if hasattr(layer, "update_conv_state")
        ),
    ):
        with pytest.raises(kvarena.InvalidValueError, match="released to its pool"):
            use()
    # The cache that holds the slot now is untouched: it goes on as transformers' own.
    more = model.generate(
        out, attention_mask=torch.ones_like(out), cache=other, max_new_tokens=3, do_sample=False
    )
    pool.release(other)
    want = _reference(model, ids, mask, max_new_tokens=NEW + 3, do_sample=False)
    assert torch.equal(more, want)
    _all_back(pool)


@pytest.mark.parametrize(
    "beam_idx",
    [
        [0, 1],
        torch.tensor([[0, 1]]),
        torch.tensor([0.0, 1.0]),
        torch.tensor([True, False]),
        torch.tensor([0, 2]),
        torch.tensor([0]),
        torch.tensor([-1, 0]),
        torch.tensor([0, 1], device="meta"),
    ],
)
def test_reorder_cache_refuses_what_is_not_a_row_selection(models, beam_idx):
    model = _model(models, "qwen3_next")
    pool = _pool(model)
    ids, mask = _prompts(2, 20, seed=6)
    cache = pool.new_cache(2)
    model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2, do_sample=False)
    books = (
        [list(t.blocks) for t in cache.block_tables],
        [t.tokens for t in cache.block_tables],
        pool.cache.blocks.num_free,
        cache.slots,
        pool.cache.state_view("recurrent_state").clone(),
    )
    with pytest.raises(kvarena.InvalidValueError, match="beam_idx"):
        cache.reorder_cache(beam_idx)
    after = (
        [list(t.blocks) for t in cache.block_tables],
        [t.tokens for t in cache.block_tables],
        pool.cache.blocks.num_free,
        cache.slots,
        pool.cache.state_view("recurrent_state"),
    )
    assert books[:4] == after[:4] and torch.equal(books[4], after[4])
    pool.release(cache)
    _all_back(pool)


@pytest.mark.parametrize("bad", [10**6, -1])
def test_prefill_refuses_ids_beyond_the_vocabulary(models, bad):
    model = _model(models, "llama")
    pool = _pool(model)
    ids, _ = _prompts(1, 20, seed=7)
    ids[0, 5] = bad
    lookups = pool.prefix.metrics.lookups
    for call in (pool.prefill, pool.prefill_remote):
        with pytest.raises(kvarena.InvalidValueError, match=f"token id {bad} is outside"):
            call(model, ids)
    assert pool.prefix.metrics.lookups == lookups
    _all_back(pool)
