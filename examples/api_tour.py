"""The README's API tour, runnable: python examples/api_tour.py"""

import math

import torch

import kvarena as kv
from kvarena import layout

# --- The road: model -> plan (sizes only) -> cache (memory) ---------------------
model = kv.model_cache("qwen3-next-80b-a3b", kv.ServingOptions(tp=8, spec_tokens=1))
plan = kv.plan_cache(model, budget_bytes=512 << 20, max_seqs=4)
cache = kv.UnifiedCache.from_plan(plan, "cpu")
assert (cache.num_blocks, cache.num_slots) == (plan.blocks, plan.state_slots)

k_cache = cache.page_view("k")  # [12, max_blocks, 16, 2, 256]: what paged attention takes
ssm = cache.state_view("recurrent_state")  # [36, total_slots, 4, 128, 128]
blocks = cache.blocks.allocate(8)  # a request's KV blocks (refcounted)
slots = cache.allocate_slots("req-0")  # its state and its rollback copy: 2 slots

spec = cache.checkpoint_spec()  # the state's image, in units of one block stride
units = cache.blocks.allocate(spec.units_per_image)
cache.store(spec, [slots[0]], [units])  # one batch: many slots, many unit lists
move = cache.grow_state(2)  # more requests in flight: STATE takes PAGE's top
units = [move.block_remap.get(u, u) for u in units]  # ids that moved, follow them
cache.restore(spec, [cache.allocate_slots("req-1")[0]], [units])

# --- A hand-written layout walks the same road ---------------------------------
fields = [
    kv.EntryField("conv_state", 36, (3, 1024), torch.bfloat16),
    kv.EntryField("recurrent_state", 36, (4, 128, 128), torch.bfloat16),
    kv.EntryField("score_state", 2, (8, 1024), torch.float32, fill=-math.inf, in_checkpoint=False),
]
page = [kv.EntryField("kv", 12, (16, 576), torch.bfloat16)]
mine = kv.ModelCache.from_fields(page, fields, block_size=16, entries_per_req=1)
print(kv.describe(fields))  # offsets, bytes, padding, checkpoint flag
print(kv.plan_cache(mine, budget_bytes=1 << 30, max_seqs=16).to_dict())

# --- The layout core underneath (kvarena.layout) -------------------------------
layout.entry_bytes_for(fields)  # one entry's size (multiple of 256)
layout.checkpoint_ranges_for(fields)  # [(offset, nbytes)] a checkpoint carries
kv.layout_fingerprint(fields)  # sha256 of the canonical layout encoding

# Materialize 16 slots, entry-major: entry i is one contiguous slice.
arena = layout.EntryMajorArena(fields, 16, torch.device("cpu"))
conv = arena.view("conv_state")  # [36, 16, 3, 1024] bf16, for kernels
arena.entry(3).copy_(arena.entry(7))  # move request 7's whole state: one copy

# Share a buffer: entries a slot apart, only the top 4 slots are this pool's.
stride = layout.align_up(arena.entry_bytes + 65536)
shared = torch.zeros(15 * stride + arena.entry_bytes, dtype=torch.uint8)
pool = layout.EntryMajorArena(fields, 16, "cpu", buf=shared, slot_stride=stride, live_entries=4)

# Split a state over planes of different row widths, exactly and deterministically.
per_plane, rows = layout.plan_field_planes(fields, [4096, 65536])

# Paged KV, layer-major: each layer of each field contiguous.
kv_fields = [
    kv.EntryField("k", 32, (16, 8, 128), torch.bfloat16),
    kv.EntryField("v", 32, (16, 8, 128), torch.bfloat16),
]
paged = layout.LayerMajorArena(kv_fields, 1024, "cpu")
k = paged.view("k")  # [32, 1024, 16, 8, 128], k[l] contiguous
