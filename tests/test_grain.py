"""The divergence grain (``kvarena.prefix.grain``) and the ``learn`` policy rule."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvarena.prefix import CheckpointPolicy
from kvarena.prefix.grain import MIN_OBSERVATIONS, SHARE, DivergenceGrain


@given(
    block=st.sampled_from([16, 32, 64]),
    points=st.lists(st.integers(1, 4096), min_size=0, max_size=200),
)
def test_the_grain_is_the_largest_ladder_step_dividing_nearly_every_point(block, points):
    g = DivergenceGrain(block)
    tokens = [p * block for p in points]
    for t in tokens:
        g.observe(t)
    got = g.grain()
    if len(tokens) < MIN_OBSERVATIONS:
        assert got == block
        return
    # Brute force over the ladder: the largest step dividing at least SHARE of them.
    want, step = block, block
    while step <= 1 << 16:
        if sum(t % step == 0 for t in tokens) >= SHARE * len(tokens):
            want = step
        step *= 2
    assert got == want


def test_a_trace_of_512_token_pieces_learns_512_and_a_few_odd_points_do_not_break_it():
    rng = np.random.default_rng(1)
    g = DivergenceGrain(16)
    for _ in range(95):
        g.observe(int(rng.integers(1, 40)) * 512)
    for _ in range(5):
        g.observe(int(rng.integers(1, 600)) * 16 + 16)
    assert g.grain() >= 512
    free = DivergenceGrain(16)
    for _ in range(100):
        free.observe(int(rng.integers(1, 2000)) * 16)
    assert free.grain() == 16  # divergence anywhere: the block itself


def test_learn_parses_describes_and_keeps_its_boundary():
    p = CheckpointPolicy.parse("end,branch,learn")
    assert p.learn and p.describe() == "end,branch,learn"
    assert CheckpointPolicy.parse(p.describe()) == p
    # 1,300 tokens at a learned grain of 512: an image at 1,024 tokens (block 64 of 16).
    assert p.boundaries(1300, 16, 0, 512) == [64]  # the learned grain replaces the end
    assert p.boundaries(1300, 16, 0, 16) == [81]  # grain = block: just the end rule
    assert 64 not in CheckpointPolicy.parse("end,branch").boundaries(1300, 16, 0, 512)
    assert CheckpointPolicy(end=False, branch=False, learn=True).learn


def test_a_prefix_cache_with_learn_keeps_images_where_later_turns_diverge():
    """Multi-turn prompts built of 16-token pieces whose last piece changes at the
    next turn (as a Mooncake trace's hash blocks do): the plain end rule keeps
    each image inside the piece the next turn changes and never hits; ``learn``
    finds the 16-token grain from the divergences and hits every later turn."""
    import torch
    from conftest import plan_for

    from kvarena import EntryField
    from kvarena.prefix import PrefixCache

    page = [EntryField("k", 2, (4, 8), torch.bfloat16)]
    state = [EntryField("ssm", 2, (2, 16), torch.float32)]
    hits = {}
    for rule in ("end", "end,learn"):
        pc = PrefixCache(
            plan_for(page, state, 1 << 20, 4, block_size=4),
            "cpu",
            policy=CheckpointPolicy.parse(rule),
        )
        rng = np.random.default_rng(0)
        total = 0
        for conv in range(24):
            pieces: list[np.ndarray] = []
            for turn in range(4):
                if pieces:
                    pieces[-1] = rng.integers(0, 1000, 16)  # the last piece changes
                pieces += [rng.integers(0, 1000, 16), rng.integers(0, 1000, 10)]
                prompt = np.concatenate(pieces)
                request = (conv, turn)
                adm = pc.admit(request, prompt)
                total += adm.hit.tokens if conv >= 16 else 0
                for b in adm.checkpoints:
                    pc.checkpoint(request, b)
                pc.commit(request, prompt.size)
                pc.finish(request)
        hits[rule] = total
        if rule == "end,learn":
            assert pc.placement.grain.grain() == 16
    assert hits["end"] == 0 and hits["end,learn"] > 0
