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

# One road: declarations -> plan (sizes only) -> cache (memory). Each request
# holds its state and one speculative rollback copy.
model = kv.ModelCache.from_fields(page_fields, state_fields, block_size=16, entries_per_req=2)
plan = kv.plan_cache(model, budget_bytes=256 << 20, max_seqs=8)
print(plan.blocks, "blocks,", plan.token_capacity, "tokens,", plan.state_slots, "slots")

# One buffer: blocks from the bottom, state slots from the top, exactly as planned.
cache = kv.UnifiedCache.from_plan(plan, "cpu")
assert (cache.num_blocks, cache.num_slots) == (plan.blocks, plan.state_slots)
k_cache = cache.page_view("k")  # [12, max_blocks, 16, 1, 256], valid across moves
blocks = cache.blocks.allocate(4)
slots = cache.allocate_slots("req-0")  # the state and one rollback copy, top-most
move = cache.grow_state(4)  # more requests in flight: STATE takes PAGE's top
assert not move.block_remap  # the top blocks were free, nothing had to move

# Checkpoint the request's state into PAGE blocks, restore it into another request.
spec = cache.checkpoint_spec()  # units of one block stride each
units = cache.blocks.allocate(spec.units_per_image)
cache.store(spec, [slots[0]], [units])
other = cache.allocate_slots("req-1")
cache.restore(spec, [other[0]], [units])
assert torch.equal(
    cache.state_view("recurrent_state")[:, other[0]],
    cache.state_view("recurrent_state")[:, slots[0]],
)
