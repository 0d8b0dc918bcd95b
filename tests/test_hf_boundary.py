"""The boundary moves under transformers caches in the middle of ``generate``.

A move relocates the caches' blocks (growing STATE) and their slots
(shrinking it) as whole entries; the pool remaps each request's one holding
in place and every live cache remakes its views, so generation goes on
token-identical to ``DynamicCache``, and every block and slot comes back.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList  # noqa: E402

from kvarena.errors import InvalidValueError  # noqa: E402
from kvarena.integrations.transformers import KvarenaPool  # noqa: E402
from kvarena.integrations.transformers.tiny import tiny_model  # noqa: E402

NEW = 8
PROMPT = 21


class _At(LogitsProcessor):
    """Runs ``actions[step]`` between two forwards of ``generate``."""

    def __init__(self, actions):
        self.actions, self.step = actions, 0

    def __call__(self, input_ids, scores):
        action = self.actions.get(self.step)
        self.step += 1
        if action is not None:
            action()
        return scores


def _reference(model, ids):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=DynamicCache(config=model.config),
        max_new_tokens=NEW,
        do_sample=False,
    )


def _held_blocks(cache):
    return [b for t in cache.block_tables for b in t.blocks]


@pytest.fixture(scope="module")
def models():
    return {}


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text", "nemotron_h", "kimi_linear"])
@pytest.mark.parametrize("how", ["new_cache", "prefill"])
def test_moves_both_ways_mid_generate_are_token_identical(models, family, how):
    if family not in models:
        models[family] = tiny_model(family, dtype=torch.float32)
    model = models[family]
    batch = 2 if how == "new_cache" else 1
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (batch, PROMPT), generator=g)
    want = _reference(model, ids)
    pool = KvarenaPool.from_config(
        model.config, dtype=model.dtype, budget_bytes=6 << 20, max_seqs=6
    )
    c = pool.cache
    # Crowd the pools: the filler takes the low blocks and the top slots, so the
    # request's blocks sit at the top of PAGE and its slots at the bottom of STATE.
    room = batch * c.plan.blocks_for(PROMPT + NEW) + 2
    if pool.prefix.spec is not None:
        room += 2 * pool.prefix.spec.units_per_image
    filler = c.blocks.allocate(c.blocks.num_free - room)
    crowd = [("crowd", i) for i in range(c.slots.num_free - batch)]
    for r in crowd:
        c.allocate_slots(r)
    if how == "new_cache":
        cache = pool.new_cache(batch)
        prompt = ids
    else:
        cache = pool.prefill(model, ids)
        prompt = ids
    moves = []

    def grow():
        for b in filler:
            c.blocks.release(b)
        lowest = min(_held_blocks(cache) or [c.num_blocks])
        k = 1
        while c.geometry.blocks_below(c.slots.first - k) > lowest:
            k += 1
        held = set(_held_blocks(cache))
        move = pool.move_boundary(k)
        assert held & set(move.block_remap), "the move relocates the cache's blocks"
        assert set(_held_blocks(cache)).isdisjoint(move.block_remap)
        moves.append(move)

    def shrink():
        for r in crowd:
            c.release_slots(r)
        slots = [s for group in cache.slots for s in group]
        move = pool.move_boundary(-(max(slots) - c.slots.first + 1))
        assert set(slots) <= set(move.slot_remap), "the move relocates the cache's slots"
        assert all(s >= c.slots.first for group in cache.slots for s in group)
        moves.append(move)

    got = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        cache=cache,
        max_new_tokens=NEW,
        do_sample=False,
        logits_processor=LogitsProcessorList([_At({2: grow, 5: shrink})]),
    )
    assert len(moves) == 2
    assert torch.equal(got, want)
    pool.release(cache)
    pool.prefix.check_books()
    assert c.blocks.num_live == 0 and c.slots.num_free == c.slots.capacity
    assert len(c.holdings) == 0 and pool.live_caches == 0


def test_a_move_the_cache_was_not_told_of_is_refused_not_served(models):
    if "qwen3_next" not in models:
        models["qwen3_next"] = tiny_model("qwen3_next", dtype=torch.float32)
    model = models["qwen3_next"]
    pool = KvarenaPool.from_config(
        model.config, dtype=model.dtype, budget_bytes=6 << 20, max_seqs=4
    )
    cache = pool.new_cache(1)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    pool.cache.grow_state(1)  # behind the pool's back
    with pytest.raises(InvalidValueError, match="boundary moved under this KvarenaCache"):
        with torch.no_grad():
            model(input_ids=ids[:, :1], cache=cache, use_cache=True)
    cache.follow()  # what the pool does after its own moves
    pool.release(cache)
    assert pool.cache.blocks.num_live == 0
