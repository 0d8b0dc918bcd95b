"""Checkpoint and restore a batch of request states, three ways, side by side.

1. kvarena: one planned batch (checkpoint ranges vs PAGE units), one execution.
2. per-layer-per-field: separate ``[layers, slots, *shape]`` tensors per field,
   copied one (layer, field) slice per request into a separate checkpoint pool.
3. memcpy: one contiguous copy of the same total bytes, as 8-byte words
   (``_timing.plain_copy``: the fastest plain copy here).

Prints GB/s (medians), ratios against memcpy and the loop (the median of each
round's ratio, benchmarks/_timing.py), and the ops each issued.

    python benchmarks/bench_checkpoint.py [--requests 64] [--unit-kib 16 256 2048] [--repeats 7]
        [--placement allocated scattered shuffled] [--device cpu]

On CUDA (``--device cuda``) kvarena's batch is one Triton launch where Triton
imports (the torch gathers otherwise; the ``path`` column says which), and the
loop issues one kernel per (request, field, layer).
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Callable

import torch
from _timing import cache_memory, filled, plain_copy, side_by_side

from kvarena import CheckpointSpec, EntryField, ModelCache, UnifiedCache, plan_cache
from kvarena.copy.executor import triton_available
from kvarena.layout import min_slot_stride
from kvarena.models import ServingOptions, model_cache


def _states(model: str, tp: int = 1) -> Callable[[], list[EntryField]]:
    return lambda: list(model_cache(model, ServingOptions(tp=tp)).state_fields)


PLACEMENTS = ("allocated", "scattered", "shuffled")

LAYOUTS: dict[str, Callable[[], list[EntryField]]] = {
    "qwen3-next gdn tp8": _states("qwen3-next-80b-a3b", 8),
    "mamba2-2.7b tp8": _states("mamba2-2.7b", 8),
    "deepseek-v4-flash": _states("deepseek-v4-flash"),
    # Gemma-3-27B's 52 local layers as a 1024-token K/V ring (TP 16: one KV head).
    "gemma-3 swa ring": _states("gemma-3-27b", 16),
}


def bench(
    name: str,
    requests: int,
    unit_bytes: int,
    repeats: int,
    placement: str,
    device: torch.device,
) -> dict:
    fields = LAYOUTS[name]()
    # The real road: a cache whose PAGE blocks are the image units, planned for
    # the source states, the restore targets and every image's units.
    units_per_image = CheckpointSpec.build(fields, unit_bytes).units_per_image
    n_units = requests * units_per_image
    model = ModelCache.from_fields(
        [EntryField("unit", 1, (unit_bytes,), torch.uint8)], fields, block_size=16
    )
    budget = 2 * requests * min_slot_stride(fields) + (n_units + 1) * unit_bytes
    plan = plan_cache(model, budget_bytes=budget, max_seqs=2 * requests, clamp=False)
    cache = UnifiedCache.from_plan(plan, device)
    spec = cache.checkpoint_spec(unit_bytes)
    slots = [cache.allocate_slots(("src", r))[0] for r in range(requests)]
    back = [cache.allocate_slots(("dst", r))[0] for r in range(requests)]
    gen = torch.Generator().manual_seed(0)
    for f in fields:
        v = cache.state_view(f.name)
        for s in slots:
            v[:, s].copy_(torch.randn(v[:, s].shape, generator=gen).to(f.dtype))
    # "allocated": units as the allocator hands them out (lowest first, so an
    # image's units are consecutive blocks: strided families). "scattered":
    # the same blocks in reverse, so no two units continue each other.
    # "shuffled": the same blocks in a random order (a free list after churn).
    order = cache.blocks.allocate(n_units)
    if placement == "scattered":
        order.reverse()
    elif placement == "shuffled":
        random.Random(1).shuffle(order)
    units = [order[c * units_per_image : (c + 1) * units_per_image] for c in range(requests)]
    ops = {"kvarena": 0}
    path = cache.store(spec, slots, units).path

    def kv_store() -> None:
        ops["kvarena"] = cache.store(spec, slots, units).ops

    carried = [f for f in fields if f.in_checkpoint]
    sep_src, sep_dst = {}, {}
    for f in carried:
        rows = cache.state_view(f.name)[:, slots]
        sep_src[f.name] = cache_memory(tuple(rows.shape), rows.dtype, device).copy_(rows)
        sep_dst[f.name] = cache_memory(tuple(rows.shape), rows.dtype, device)

    def loop_store() -> None:
        for r in range(requests):
            for f in carried:
                for layer in range(f.layers):
                    sep_dst[f.name][layer, r].copy_(sep_src[f.name][layer, r])

    nbytes = requests * spec.image_bytes
    flat_a, flat_b = filled(nbytes, 1, device), filled(nbytes, 0, device)

    t = side_by_side(
        {
            "kv": kv_store,
            "restore": lambda: cache.restore(spec, back, units),
            "loop": loop_store,
            "mem": lambda: plain_copy(flat_b, flat_a),
        },
        repeats,
        device,
    )
    # The restored slots hold exactly the carried bytes.
    for f in carried:
        v = cache.state_view(f.name)
        assert torch.equal(v[:, back].view(torch.uint8), v[:, slots].view(torch.uint8)), f.name

    return {
        "name": name,
        "path": path,
        "image_mb": spec.image_bytes / 2**20,
        "units": spec.units_per_image,
        "ops": (ops["kvarena"], requests * sum(f.layers for f in carried)),
        "gbps": {k: nbytes / seconds / 1e9 for k, seconds in t.items()},
        "ratios": (t.speed("kv", "mem"), t.speed("restore", "mem"), t.speed("kv", "loop")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument(
        "--unit-kib", type=int, nargs="+", default=[16, 256, 2048], help="PAGE unit sizes in KiB"
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--placement", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        path = "cpu"
    else:
        path = "triton" if triton_available() else "torch"
    print(
        f"torch {torch.__version__}, {device}, kvarena path {path}, {args.requests} requests, "
        f"units {'/'.join(str(u) for u in args.unit_kib)} KiB, median of {args.repeats}"
    )
    header = (
        f"{'layout':<20} {'units placed':<12} {'unit':>8} {'image MB':>9} {'units':>5} {'ops kv/loop':>13} "
        f"{'store GB/s':>11} {'restore GB/s':>13} {'loop GB/s':>10} {'memcpy GB/s':>12} "
        f"{'store/mem':>10} {'restore/mem':>12} {'store/loop':>11}"
    )
    print(header)
    print("-" * len(header))
    for name in args.layouts:
        for placement, unit in itertools.product(args.placement, args.unit_kib):
            r = bench(name, args.requests, unit * 1024, args.repeats, placement, device)
            assert r["path"] == path, (r["path"], path)
            g = r["gbps"]
            print(
                f"{name:<20} {placement:<12} {unit:>4} KiB {r['image_mb']:>9.2f} {r['units']:>5} "
                f"{r['ops'][0]:>6}/{r['ops'][1]:<6} {g['kv']:>11.2f} {g['restore']:>13.2f} "
                f"{g['loop']:>10.2f} {g['mem']:>12.2f} {r['ratios'][0]:>9.2f}x "
                f"{r['ratios'][1]:>11.2f}x {r['ratios'][2]:>10.2f}x"
            )


if __name__ == "__main__":
    main()
