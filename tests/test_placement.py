"""Where images are kept (``kvarena.prefix.placement``) and the ghosts of evicted KV
(``kvarena.prefix.ghosts``)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from conftest import plan_for
from hypothesis import given
from hypothesis import strategies as st

from kvarena import EntryField
from kvarena.prefix import CheckpointPolicy, PrefixCache
from kvarena.prefix.ghosts import Ghosts
from kvarena.prefix.placement import Placement


@given(
    capacity=st.integers(0, 8),
    batches=st.lists(st.lists(st.integers(0, 12), max_size=6), max_size=12),
)
def test_ghosts_are_the_most_recently_added_keys_up_to_capacity(capacity, batches):
    g = Ghosts(capacity)
    ref: OrderedDict[bytes, None] = OrderedDict()
    for batch in batches:
        keys = [bytes([k]) * 16 for k in batch]
        g.add(keys)
        for k in keys:
            ref[k] = None
            ref.move_to_end(k)
        while len(ref) > capacity:
            ref.popitem(last=False)
        assert len(g) == len(ref)
        assert {bytes([k]) * 16 for k in range(13) if bytes([k]) * 16 in g} == set(ref)


KEYS = [bytes([i]) * 16 for i in range(1, 11)]


def test_the_known_prefix_runs_through_ghosts_and_its_end_is_a_branch_point():
    """A prompt of 10 blocks whose first 4 blocks were computed before and evicted:
    no device KV matched, but the ghosts say the prefix was shared up to block 4,
    so an image is wanted there — and kept by this prompt, which computes through it."""
    pol = CheckpointPolicy(end=True, branch=True)
    with_ghosts = Placement(pol, 16, 100)
    with_ghosts.forgotten(KEYS[:4])
    assert with_ghosts.boundaries(160, KEYS, hit=0, matched=0, limit=9) == [4, 10]
    without = Placement(pol, 16, 0)
    without.forgotten(KEYS[:4])
    assert without.boundaries(160, KEYS, hit=0, matched=0, limit=9) == [10]
    # Device KV first, then ghosts: matched 2 on the device, ghosts of 2..5.
    mixed = Placement(pol, 16, 100)
    mixed.forgotten(KEYS[2:6])
    assert mixed.boundaries(160, KEYS, hit=0, matched=2, limit=9) == [6, 10]
    # A ghost run that does not start where the device's KV ends says nothing.
    gap = Placement(pol, 16, 100)
    gap.forgotten(KEYS[3:6])
    assert gap.boundaries(160, KEYS, hit=0, matched=2, limit=9) == [2, 10]
    # Once kept, the boundary is no longer wanted by the next prompt through it.
    with_ghosts.kept(KEYS[3])
    assert with_ghosts.boundaries(160, KEYS, hit=4, matched=4, limit=9) == [10]


def test_the_known_prefix_feeds_the_learned_grain():
    pl = Placement(CheckpointPolicy(end=True, branch=False, learn=True), 4, 1000)
    keys = [bytes([i, j]) * 8 for i in range(40) for j in range(16)]  # 40 prompts x 16 blocks
    for p in range(40):
        path = keys[p * 16 : (p + 1) * 16]
        pl.forgotten(path[:8])  # each prompt's first 8 blocks (32 tokens) were seen before
        pl.boundaries(64, path, hit=0, matched=0, limit=15)
    assert pl.grain.observed == 40 and pl.grain.grain() == 32


@pytest.mark.parametrize("remember", [True, False])
def test_a_shared_prefix_evicted_between_its_readers_still_gets_its_image(remember):
    """Readers of one 8-block system prompt arrive far apart, with unrelated traffic
    between them that evicts everything: no two readers ever meet on the device.
    The ghosts of the first reader's KV make the second keep an image at the
    prompt's end; the third resumes from it. Without ghosts nobody would."""
    page = [EntryField("k", 2, (4, 8), torch.bfloat16)]
    state = [EntryField("ssm", 2, (2, 16), torch.float32)]
    pc = PrefixCache(
        plan_for(page, state, 1 << 17, 2, block_size=4),
        "cpu",
        policy=CheckpointPolicy(end=True, branch=True),
    )
    if not remember:  # the control: a placement that keeps no ghosts
        pc.placement.ghosts = Ghosts(0)
    rng = np.random.default_rng(3)
    system = rng.integers(0, 1000, 32)  # 8 blocks of 4 tokens

    def run(request, tokens):
        adm = pc.admit(request, tokens)
        for b in adm.checkpoints:
            pc.checkpoint(request, b)
        pc.commit(request, tokens.size)
        pc.finish(request)
        return adm

    def flood(tag):  # unrelated prompts of 15 blocks, the pool's worth and more
        for i in range(pc.pool.capacity // 15 + 2):
            run((tag, i), rng.integers(1000, 2000, 60))

    first = run("first", np.concatenate([system, rng.integers(0, 1000, 6)]))
    assert first.checkpoints == [9]  # its own end only: nothing was shared yet
    flood("a")
    keys = pc.keys(system)
    assert all(pc.pool.blocks_of(k) is None for k in keys)  # evicted ...
    assert all((k in pc.placement.ghosts) == remember for k in keys)  # ... and remembered
    second = run("second", np.concatenate([system, rng.integers(0, 1000, 6)]))
    assert second.hit.tokens == 0 and (8 in second.checkpoints) == remember
    third = run("third", np.concatenate([system, rng.integers(0, 1000, 6)]))
    assert third.hit.tokens == (32 if remember else 0)
    pc.check_books()
