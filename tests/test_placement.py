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
from kvarena.prefix.grain import MIN_OBSERVATIONS, SHARE, SuffixLength
from kvarena.prefix.placement import Placement, learned_interval


@given(
    capacity=st.integers(0, 8),
    batches=st.lists(st.lists(st.integers(0, 12), max_size=6), max_size=12),
)
def test_ghosts_are_the_latest_first_remembered_keys_up_to_capacity(capacity, batches):
    g = Ghosts(capacity)
    ref: OrderedDict[bytes, None] = OrderedDict()
    for batch in batches:
        keys = [bytes([k]) * 16 for k in batch]
        g.add(keys)
        for k in keys:
            ref.setdefault(k, None)  # a key remembered again keeps its place
        while len(ref) > capacity:
            ref.popitem(last=False)
        assert len(g) == len(ref)
        assert {bytes([k]) * 16 for k in range(13) if bytes([k]) * 16 in g} == set(ref)


KEYS = [bytes([i]) * 16 for i in range(1, 11)]


def test_the_known_prefix_runs_through_ghosts_and_its_end_is_a_branch_point():
    """A prompt of 10 blocks whose first 4 blocks were computed before and evicted:
    no device KV matched, but the ghosts say the prefix was shared up to block 4,
    so an image is wanted there — and kept by this prompt, which computes through it."""
    pol = CheckpointPolicy(end=True, branch=True, learn=False)
    with_ghosts = Placement(pol, 16, 50, 1)
    with_ghosts.forgotten(KEYS[:4])
    assert with_ghosts.boundaries(160, KEYS, hit=0, matched=0, limit=9) == [4, 10]
    without = Placement(pol, 16, 0, 1)
    without.forgotten(KEYS[:4])
    assert without.boundaries(160, KEYS, hit=0, matched=0, limit=9) == [10]
    # Device KV first, then ghosts: matched 2 on the device, ghosts of 2..5.
    mixed = Placement(pol, 16, 50, 1)
    mixed.forgotten(KEYS[2:6])
    assert mixed.boundaries(160, KEYS, hit=0, matched=2, limit=9) == [6, 10]
    # A ghost run that does not start where the device's KV ends says nothing.
    gap = Placement(pol, 16, 50, 1)
    gap.forgotten(KEYS[3:6])
    assert gap.boundaries(160, KEYS, hit=0, matched=2, limit=9) == [2, 10]
    # Once kept, the boundary is no longer wanted by the next prompt through it.
    with_ghosts.kept(KEYS[3])
    assert with_ghosts.boundaries(160, KEYS, hit=4, matched=4, limit=9) == [10]


def test_the_known_prefix_feeds_the_learned_grain():
    pl = Placement(CheckpointPolicy(end=True, branch=False, learn=True), 4, 500, 1)
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


@given(
    block=st.sampled_from([4, 16]),
    suffixes=st.lists(st.integers(1, 5000), max_size=120),
)
def test_the_back_off_covers_nearly_every_suffix_seen_on_its_ladder(block, suffixes):
    s = SuffixLength(block)
    for t in suffixes:
        s.observe(t)
    got = s.back_off()
    if len(suffixes) < MIN_OBSERVATIONS:
        assert got == 0
        return
    # Brute force: the least rung (in blocks) at or above SHARE of the suffixes.
    blocks = sorted(-(-t // block) for t in suffixes)
    want = next(r for r in s.rungs if sum(b <= r for b in blocks) >= SHARE * len(blocks))
    assert got == want * block
    assert s.rungs[:6] == [1, 2, 3, 4, 6, 8]


def test_the_learned_interval_is_sixteen_images_of_kv_rounded_up_to_a_power_of_two():
    assert learned_interval(16, 25) == 512 * 16  # Qwen3-Next-80B at TP 8: 8,192 tokens
    assert learned_interval(16, 98) == 2048 * 16  # at TP 1: 32,768 tokens
    assert learned_interval(16, 32) == 512 * 16 and learned_interval(16, 33) == 1024 * 16
    assert learned_interval(544, 1) == 16 * 544  # a multiple of any block size
    p = CheckpointPolicy()  # the default learns; an explicit interval wins
    assert p.boundaries(100_000, 16, 0, 16, 0, 8192) == [512 * k for k in range(1, 13)] + [6250]
    explicit = CheckpointPolicy.parse("end,interval:4096,learn")
    assert explicit.boundaries(10_000, 16, 0, 16, 0, 8192) == [256, 512, 625]


def test_where_prompts_part_anywhere_learn_keeps_an_image_the_learned_suffix_before_the_end():
    p = CheckpointPolicy()
    # Grain = the block (no structure), a back-off of 192 tokens: 1,000 -> 808 tokens.
    assert p.boundaries(1000, 16, 0, 16, 192) == [50, 62]
    # A learned grain above the block replaces both the end and the back-off.
    assert p.boundaries(1000, 16, 0, 512, 192) == [32]
    # Nothing behind the hit: a continuation past the back-off point keeps its end only.
    assert p.boundaries(1000, 16, 55, 16, 192) == [62]
    assert CheckpointPolicy.parse("end,branch").boundaries(1000, 16, 0, 16, 192) == [62]


def test_documents_read_by_many_questions_resume_near_each_document_end():
    """Documents of 40-80 blocks, each read by 6 questions of 1-4 blocks. The
    first reader's own end lies in its question; once the suffixes behind the
    divergences are learned, each first reader also keeps an image that far
    before its end — inside the document — so the second reader resumes there
    instead of at the document's start (the branch rule then serves the rest)."""
    page = [EntryField("k", 2, (4, 8), torch.bfloat16)]
    state = [EntryField("ssm", 2, (2, 16), torch.float32)]
    rng = np.random.default_rng(5)
    second_hits = {}
    for rule in ("end,branch", "end,branch,learn"):
        pc = PrefixCache(
            plan_for(page, state, 1 << 22, 4, block_size=4),
            "cpu",
            policy=CheckpointPolicy.parse(rule),
        )
        docs = [rng.integers(0, 1000, 4 * int(rng.integers(40, 81))) for _ in range(24)]
        seconds = 0
        for d, doc in enumerate(docs):
            for q in range(6):
                prompt = np.concatenate([doc, rng.integers(1000, 2000, int(rng.integers(4, 17)))])
                adm = pc.admit((d, q), prompt)
                for b in adm.checkpoints:
                    pc.checkpoint((d, q), b)
                pc.commit((d, q), prompt.size)
                pc.finish((d, q))
                if q == 1 and d >= 12:  # second readers, once the suffixes are learned
                    assert adm.hit.tokens <= doc.size
                    seconds += adm.hit.tokens
        second_hits[rule] = seconds
        pc.check_books()
    assert second_hits["end,branch"] == 0
    # Each learned second reader resumes within the learned back-off of its document's end.
    assert second_hits["end,branch,learn"] > 0.8 * sum(d.size for d in docs[12:]) - 12 * 4 * 16
