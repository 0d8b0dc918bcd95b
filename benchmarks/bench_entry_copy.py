"""Copy N request states from one set of slots to another, three ways, side by side.

1. kvarena: every entry as one span, the N spans one described batch
   (``execute_batch``: the road ``UnifiedCache.copy_slots`` and ``fork_slots``
   take; entries evenly spaced on both sides move as one strided copy).
2. per-layer-per-field: separate ``[layers, slots, *shape]`` tensors per field,
   as engines allocate today, copied one (layer, field) slice per request.
3. memcpy: one contiguous copy of the same total bytes, as 8-byte words (the
   ceiling, ``_timing.plain_copy``).

Prints GB/s (medians), ratios against memcpy and the loop (the median of each
round's ratio, benchmarks/_timing.py) and the number of copy ops issued.

    python benchmarks/bench_entry_copy.py [--requests 8] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from _timing import cache_memory, filled, plain_copy, side_by_side

from kvarena.copy import CopyBatch, execute_batch
from kvarena.layout import EntryMajorArena, entry_bytes_for
from kvarena.models import model_cache

LAYOUTS = ("qwen3-next-80b-a3b", "mamba2-2.7b", "deepseek-v4-flash")


def bench_layout(name: str, requests: int, repeats: int, device: torch.device) -> dict:
    fields = list(model_cache(name).state_fields)
    slots = 2 * requests
    src = list(range(requests))
    dst = list(range(requests, slots))
    nbytes = requests * entry_bytes_for(fields)

    arena = EntryMajorArena(fields, slots, device)
    for f in fields:
        arena.view(f.name)[:, :requests].copy_(
            torch.randn(arena.view(f.name)[:, :requests].shape, device=device).to(f.dtype)
        )

    stride = arena.slot_stride
    batch = CopyBatch(
        np.array(src) * stride, np.array(dst) * stride, np.full(requests, arena.entry_bytes)
    )
    ops = execute_batch(batch, arena.buf, arena.buf).ops

    def kvarena_copy() -> None:
        execute_batch(batch, arena.buf, arena.buf)

    # Engines' layout: one allocation per field, [layers, slots, *shape].
    separate = {f.name: cache_memory((f.layers, slots, *f.shape), f.dtype, device) for f in fields}
    for f in fields:
        separate[f.name].copy_(arena.view(f.name))

    def per_layer_copy() -> None:
        for s, d in zip(src, dst, strict=True):
            for f in fields:
                t = separate[f.name]
                for layer in range(f.layers):
                    t[layer, d].copy_(t[layer, s])

    flat_src, flat_dst = filled(nbytes, 1, device), filled(nbytes, 0, device)

    def memcpy() -> None:
        plain_copy(flat_dst, flat_src)

    t = side_by_side(
        {"kvarena": kvarena_copy, "loop": per_layer_copy, "memcpy": memcpy}, repeats, device
    )

    # The copies must be right, not only fast.
    for f in fields:
        v = arena.view(f.name)
        assert torch.equal(v[:, dst], v[:, src]), f.name
        assert torch.equal(separate[f.name][:, dst], separate[f.name][:, src]), f.name

    return {
        "layout": name,
        "entry_bytes": entry_bytes_for(fields),
        "requests": requests,
        "kvarena_ops": ops,
        "loop_ops": requests * sum(f.layers for f in fields),
        "gbps": {k: nbytes / seconds / 1e9 for k, seconds in t.items()},
        "vs_memcpy": t.speed("kvarena", "memcpy"),
        "vs_loop": t.speed("kvarena", "loop"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        f"torch {torch.__version__}, device {device}, {args.requests} requests, median of {args.repeats}"
    )
    header = f"{'layout':<20} {'entry MB':>9} {'ops kv/loop':>12} {'kvarena GB/s':>13} {'loop GB/s':>10} {'memcpy GB/s':>12} {'kv/memcpy':>10} {'kv/loop':>8}"
    print(header)
    print("-" * len(header))
    for name in args.layouts:
        r = bench_layout(name, args.requests, args.repeats, device)
        g = r["gbps"]
        print(
            f"{name:<20} {r['entry_bytes'] / 2**20:>9.2f} {r['kvarena_ops']:>5}/{r['loop_ops']:<6} "
            f"{g['kvarena']:>13.2f} {g['loop']:>10.2f} {g['memcpy']:>12.2f} "
            f"{r['vs_memcpy']:>9.2f}x {r['vs_loop']:>7.2f}x"
        )


if __name__ == "__main__":
    main()
