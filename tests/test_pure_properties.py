"""Property tests for the pure planning functions added with the one road and the prefix cache."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvarena.pools import PoolGeometry
from kvarena.prefix import CheckpointPolicy
from kvarena.prefix.keys import block_keys

ALIGNS = st.sampled_from([256, 512, 1024])


@given(
    total=st.integers(0, 1 << 22),
    block_units=st.integers(0, 64),
    slot_units=st.integers(0, 64),
    align=ALIGNS,
    data=st.data(),
)
def test_pool_geometry_keeps_both_pools_inside_and_apart(
    total, block_units, slot_units, align, data
):
    g = PoolGeometry(
        total_bytes=total,
        block_stride=block_units * 256,
        slot_stride=slot_units * align,
        state_alignment=align,
    )
    assert 0 <= g.slot_base and g.top <= total and g.top % align == 0
    assert g.slot_base + g.total_slots * g.slot_stride == g.top
    first = data.draw(st.integers(0, g.total_slots))
    boundary = g.boundary(first)
    assert boundary % align == 0 or g.slot_stride == 0
    blocks = g.blocks_below(first)
    if g.block_stride:
        # Every block lies below the STATE pool, and one more would not fit.
        assert blocks * g.block_stride <= boundary < (blocks + 1) * g.block_stride
    else:
        assert blocks == 0
    # Giving STATE one more slot never adds blocks.
    if first:
        assert g.blocks_below(first - 1) <= blocks
    assert g.max_blocks == g.blocks_below(g.total_slots) >= blocks


@given(
    prompt=st.integers(1, 20_000),
    hit=st.integers(0, 1300),
    end=st.booleans(),
    align=st.sampled_from([0, 16, 512]),
    interval=st.sampled_from([0, 64, 4096]),
)
def test_policy_boundaries_lie_past_the_hit_inside_the_prompt(prompt, hit, end, align, interval):
    bs = 16
    hit = min(hit, prompt // bs)
    if not (end or align or interval):
        end = True
    p = CheckpointPolicy(end=end, end_align_tokens=align, interval_tokens=interval, branch=False)
    bounds = p.boundaries(prompt, bs, hit)
    assert bounds == sorted(set(bounds))
    assert all(hit < b <= prompt // bs for b in bounds)
    # The spec, token by token: the prompt's last block boundary, its last multiple
    # of `align` tokens, every multiple of `interval` tokens; only past the hit.
    want = set()
    for tok in range(bs, prompt + 1, bs):
        if (
            (end and tok == prompt // bs * bs)
            or (align and tok == prompt // align * align)
            or (interval and tok % interval == 0)
        ):
            want.add(tok // bs)
    assert set(bounds) == {b for b in want if b > hit}


@given(
    tokens=st.lists(st.integers(0, 1000), min_size=0, max_size=80),
    bs=st.sampled_from([1, 4, 16]),
    at=st.integers(0, 79),
)
def test_block_keys_chain_over_prefixes(tokens, bs, at):
    root = b"r" * 16
    arr = np.asarray(tokens, dtype=np.int64)
    keys = block_keys(root, arr, bs)
    assert len(keys) == len(tokens) // bs
    for k in range(len(keys) + 1):  # a prefix's keys are the prefix of the keys
        assert block_keys(root, arr[: k * bs], bs) == keys[:k]
    if at < len(tokens):
        changed = arr.copy()
        changed[at] += 1
        other = block_keys(root, changed, bs)
        i = at // bs  # blocks before the change keep their keys, the rest all differ
        assert other[:i] == keys[:i]
        assert all(a != b for a, b in zip(other[i:], keys[i:], strict=True))
    if keys:  # another namespace root: no key in common
        assert not set(block_keys(b"s" * 16, arr, bs)) & set(keys)
