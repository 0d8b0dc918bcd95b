"""Checkpoint images in PAGE units, and one allocation with a movable boundary.

python examples/checkpoint_and_pools.py
"""

import math

import torch

import kvarena as kv

state_fields = [
    kv.EntryField("conv_state", 36, (3, 1024), torch.bfloat16),
    kv.EntryField("recurrent_state", 36, (4, 128, 128), torch.bfloat16),
    kv.EntryField("score_state", 2, (8, 1024), torch.float32, fill=-math.inf, in_checkpoint=False),
]
page_fields = [
    kv.EntryField("k", 12, (16, 1, 256), torch.bfloat16),
    kv.EntryField("v", 12, (16, 1, 256), torch.bfloat16),
]

# Size the pools from a budget: the STATE floor first, PAGE takes the rest.
plan = kv.plan_pools(
    [
        kv.EntryClass(
            kv.PoolKind.PAGE, "attention", kv.entry_bytes_for(page_fields), tokens_per_entry=16
        ),
        kv.EntryClass(
            kv.PoolKind.STATE, "gdn", kv.entry_bytes_for(state_fields), entries_per_req=2
        ),
    ],
    budget_bytes=256 << 20,
    max_num_seqs=8,
)
print(
    plan.of("attention").entries,
    "blocks,",
    plan.token_capacity,
    "tokens,",
    plan.of("gdn").entries,
    "slots",
)

# One buffer: blocks from the bottom, state slots from the top.
cache = kv.UnifiedCache(
    page_fields, state_fields, 256 << 20, "cpu", state_slots=plan.of("gdn").entries,
    entries_per_req=2, tokens_per_block=16,
)  # fmt: skip
k_cache = cache.page_view("k")  # [12, max_blocks, 16, 1, 256], valid across moves
blocks = cache.blocks.allocate(4)
slots = cache.allocate_state("req-0")  # the state and one rollback copy, top-most
move = cache.grow_state(4)  # more requests in flight: STATE takes PAGE's top
assert not move.block_remap  # the top blocks were free, nothing had to move

# Checkpoint the request's state into PAGE-sized units, restore it elsewhere.
spec = kv.CheckpointSpec.build(state_fields, unit_bytes=cache.block_stride)
units = cache.blocks.allocate(spec.units_per_image)
pages = kv.PageUnits(cache.buf, cache.block_stride, cache.block_stride, cache.num_blocks)
kv.store(spec, cache.state, [slots[0]], pages, [units])
other = cache.allocate_state("req-1")
kv.restore(spec, pages, [units], cache.state, [other[0]])
assert torch.equal(
    cache.state_view("recurrent_state")[:, other[0]],
    cache.state_view("recurrent_state")[:, slots[0]],
)
