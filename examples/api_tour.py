"""The README's API tour, runnable: python examples/api_tour.py"""

import math

import torch

import kvarena as kv

# Declare the fields of one entry: name, layers, shape per (layer, entry), dtype,
# fill, extra alignment, checkpoint membership.
fields = [
    kv.EntryField("conv_state", 36, (3, 1024), torch.bfloat16),
    kv.EntryField("recurrent_state", 36, (4, 128, 128), torch.bfloat16),
    kv.EntryField("score_state", 2, (8, 1024), torch.float32, fill=-math.inf, in_checkpoint=False),
]

print(kv.describe(fields))  # offsets, bytes, padding, checkpoint flag
kv.entry_bytes_for(fields)  # one entry's size (multiple of 256)
kv.checkpoint_ranges_for(fields)  # [(offset, nbytes)] a checkpoint carries
kv.layout_fingerprint(fields)  # sha256 of the canonical layout encoding

# Materialize 16 slots, entry-major: entry i is one contiguous slice.
arena = kv.EntryMajorArena(fields, 16, torch.device("cpu"))
conv = arena.view("conv_state")  # [36, 16, 3, 1024] bf16, for kernels
arena.entry(3).copy_(arena.entry(7))  # move request 7's whole state: one copy

# Share a buffer: entries a slot apart, only the top 4 slots are this pool's.
stride = kv.align_up(arena.entry_bytes + 65536)
shared = torch.zeros(15 * stride + arena.entry_bytes, dtype=torch.uint8)
pool = kv.EntryMajorArena(fields, 16, "cpu", buf=shared, slot_stride=stride, live_entries=4)

# Split a state over planes of different row widths, exactly and deterministically.
per_plane, rows = kv.plan_field_planes(fields, [4096, 65536])

# Paged KV, layer-major: each layer of each field contiguous.
kv_fields = [
    kv.EntryField("k", 32, (16, 8, 128), torch.bfloat16),
    kv.EntryField("v", 32, (16, 8, 128), torch.bfloat16),
]
blocks = kv.LayerMajorArena(kv_fields, 1024, "cpu")
k = blocks.view("k")  # [32, 1024, 16, 8, 128], k[l] contiguous
