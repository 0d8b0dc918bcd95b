"""The connector's copies per request in vLLM's layer-major and block-major layouts.

.venv-vllm/bin/python benchmarks/bench_vllm_layout.py [--tokens 4096] [--rounds 15] [--device cpu]

vLLM's own code (``get_kv_cache_config_from_groups``, ``allocate_kv_cache``)
allocates the cache of Qwen3-Next-80B-A3B at TP 8 as vLLM lays it out for one
rank: 12 full-attention layers (one KV head of 256, bfloat16) and 36 Gated
DeltaNet layers (a 1,024-channel conv window and 4 heads of 128x128 state,
bfloat16; 137,216 B a layer), in four KV cache groups of 12 layers, pages
unified at 144-token blocks (each state page padded to the 147,456 B of an
attention page, as vLLM's page unification does). Per layout, the
connector's save of one request (its full KV blocks and one state at its
last boundary) and the load of the same objects back, as the connector does
them: ``batches`` (one described batch per storage and object kind; a load
joins a storage's kinds into one batch for the copy engine), ``ranges`` (the contiguous byte ranges those batches are once
the engine coalesces them), and the load's time as a speed beside a copy of
the same bytes as one contiguous range from host memory into the cache's
(the physical limit), the two alternating round by round. The load reads the
objects where a host tier holds them (lent in place by their offsets in its
allocation, as ``fetch_checked`` lends them), so no staging copy is in it. A
save's time is not shown: it gathers into a new host buffer (handed to the
writer thread), and what the allocator hands back for it (pages touched
before, or a fresh mapping) moves it more than the layout does. The images' bytes are the same in every layout
(``tests/test_vllm_layouts.py``).

On vLLM's CPU platform the engine itself runs ``LBHNC`` only (its attention
backend declares no other); the block-major rows are vLLM's allocation of
the layout a CUDA backend may take, copied on this device.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _host import host
from _timing import side_by_side
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvarena.integrations.vllm.groups import classify
from kvarena.integrations.vllm.tensors import CachePages, cache_pages
from kvarena.spans import coalesce
from kvarena.tiers import HostTier, TierObject

BLOCK = 144
ATTN = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)


def gdn(padded: bool) -> MambaSpec:
    return MambaSpec(
        block_size=BLOCK,
        shapes=((3, 1024), (4, 128, 128)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode="align",
        page_size_padded=ATTN.page_size_bytes if padded else None,
    )


def allocate(layout: str, blocks: int, padded: bool, device: torch.device) -> CachePages:
    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = layout
    groups = [KVCacheGroupSpec([f"model.layers.{4 * i + 3}.self_attn" for i in range(12)], ATTN)]
    for g in range(3):
        names = [f"model.layers.{4 * i + g}.linear_attn" for i in range(12)]
        groups.append(KVCacheGroupSpec(names, gdn(padded)))
    per_block = 12 * ATTN.page_size_bytes
    kc = get_kv_cache_config_from_groups(cfg, groups, per_block * blocks)
    caches = allocate_kv_cache(kc, device, KVCacheLayout[layout])
    for t in caches.values():
        t.view(torch.uint8).random_(0, 256)
    return cache_pages(caches, classify(kc), num_blocks=kc.num_blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="the request's prompt tokens")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    full = args.tokens // BLOCK
    blocks = 2 * full + 8
    print(host())
    print(
        f"Qwen3-Next-80B-A3B TP 8 as vLLM lays it out: a {args.tokens:,}-token request = "
        f"{full} KV blocks of {BLOCK} tokens x 12 layers + 1 state x 36 layers; {device}"
    )
    head = (
        f"{'layout':<28} {'batches':>8} {'ranges':>7} {'bytes':>12} "
        f"{'load µs':>9} {'memcpy µs':>9} {'load speed':>11}"
    )
    print(head)
    for layout, padded in (("LBHNC", True), ("BLHNC", True), ("BLHNC", False)):
        label = f"{layout}{' (states padded)' if padded else ' (states unpadded)'}"
        print(f"{label:<28} " + measure(layout, padded, blocks, full, device, args.rounds))


def measure(
    layout: str, padded: bool, blocks: int, full: int, device: torch.device, rounds: int
) -> str:
    """One layout's row: batches, ranges and bytes of a request's load, and its
    time beside a memcpy of the same bytes."""
    pages = allocate(layout, blocks, padded, device)
    kv = [[b] for b in range(3, 3 + full)]  # the request's blocks (attention group)
    state = [[blocks - 2, blocks - 3, blocks - 4]]  # its state at the last boundary, per group
    saved = {
        "kv": pages.gather("kv", kv)[0].numpy(),
        "state": pages.gather("state", state)[0].numpy(),
    }
    size = pages.payload
    nbytes = size["kv"] * full + size["state"]
    # the objects where a host tier holds them, lent in place as a load reads them
    host = HostTier(2 * nbytes + (1 << 20), frame_bytes=size["kv"])
    names = {"kv": [f"kv{j}" for j in range(full)], "state": ["st"]}
    for kind, rows in saved.items():
        n = size[kind]
        host.put_many(
            [
                TierObject(name, (rows[j * n : (j + 1) * n].tobytes(),), n)
                for j, name in enumerate(names[kind])
            ]
        )

    def load() -> None:
        with host.lend(names["kv"] + names["state"]) as lent:
            views, starts = [x[0] for x in lent], [x[1] for x in lent]  # type: ignore[index]
            parts = {
                "kv": (kv, views[:full], starts[:full]),
                "state": (state, views[full:], starts[full:]),
            }
            pages.place(parts, host.buffer)

    # The limit: the same bytes as one range, from the host tier's allocation into
    # the cache's own (the pages the load reads and writes: a fresh buffer's
    # pages would move at their own speed, measured 0.77-0.96x apart run to run).
    src = host.buffer[:nbytes]
    cache = pages.spans("kv")[0].storage[:nbytes]
    t = side_by_side({"load": load, "memcpy": lambda: cache.copy_(src)}, rounds, device)
    batches = 0
    n_ranges = 0
    for kind, ids in (("kv", kv), ("state", state)):
        at = np.arange(len(ids), dtype=np.int64) * size[kind]
        for _, batch in pages.batches(kind, np.asarray(ids), at):
            batches += 1
            n_ranges += coalesce(batch.src, batch.dst, batch.length)[0].size
    return (
        f"{batches:>8,} {n_ranges:>7,} {nbytes:>12,} "
        f"{t['load'] * 1e6:>9,.0f} {t['memcpy'] * 1e6:>9,.0f} {t.speed('load', 'memcpy'):>10.2f}x"
    )


if __name__ == "__main__":
    main()
