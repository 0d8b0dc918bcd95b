"""Ship a 4k-token request from a prefill process to a decode process over NIXL.

For the Qwen3-Next and DeepSeek-V4-Flash presets: descriptors per request
(kvarena: one per block run and per state slot; a per-layer-per-tensor
registration like today's engines: one per layer per field per block run and
per layer per state field), and the throughput of three transfers of the same
bytes in one run, interleaved: kvarena's descriptors, the per-layer ones, and
one raw descriptor. Loopback, CPU memory, UCX.

    python benchmarks/bench_transfer.py [--tokens 4096] [--rounds 5] [--tp 1]
"""

from __future__ import annotations

import argparse
import os

from kvarena import plan_cache
from kvarena.layout import align_up, min_slot_stride
from kvarena.models import ServingOptions, model_cache
from kvarena.testing.loopback import SideProcess, connect_pair


def bench(preset: str, tokens: int, rounds: int, tp: int, fragmented: bool) -> dict:
    m = model_cache(preset, ServingOptions(tp=tp))
    blocks = -(-tokens // m.block_size)
    block = min_slot_stride(m.page_fields)
    slot = min_slot_stride(m.state_fields)
    total = align_up((3 * blocks + 4) * block + 3 * slot, 1 << 20)
    plan = plan_cache(m, budget_bytes=total, max_seqs=2, clamp=False)
    prefill, decode = SideProcess("prefill", plan), SideProcess("decode", plan)
    try:
        peer, _ = connect_pair(prefill, decode)
        prefill.call("fill", "r", blocks, 1)
        if fragmented:
            decode.call("fragment", blocks)  # no two destination blocks adjacent
        dst = decode.call("expect", "r", blocks, 600.0)
        result = prefill.call("bench", peer, "r", dst, rounds)
    finally:
        prefill.stop()
        decode.stop()
    return {"preset": preset, "blocks": blocks, "fragmented": fragmented, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--presets", nargs="*", default=["qwen3-next-80b-a3b", "deepseek-v4-flash"])
    args = parser.parse_args()
    print(
        f"NIXL loopback, UCX_TLS={os.environ.get('UCX_TLS', '<default>')}, {args.tokens}-token request, median of {args.rounds}"
    )
    header = (
        f"{'preset':<20} {'dst blocks':<11} {'MiB':>7} {'desc kv/layer':>14} {'kvarena GB/s':>13} {'per-layer GB/s':>15} "
        f"{'raw GB/s':>9} {'kv/raw':>7} {'kv/per-layer':>13}"
    )
    print(header)
    print("-" * len(header))
    for preset, fragmented in [(p, f) for p in args.presets for f in (False, True)]:
        r = bench(preset, args.tokens, args.rounds, args.tp, fragmented)
        gbps = {k: r["nbytes"][k] / r["seconds"][k] / 1e9 for k in r["seconds"]}
        d = r["descriptors"]
        print(
            f"{preset:<20} {'scattered' if fragmented else 'one run':<11} {r['nbytes']['kvarena'] / 2**20:>7.1f} {d['kvarena']:>5}/{d['per_layer']:<8} "
            f"{gbps['kvarena']:>13.2f} {gbps['per_layer']:>15.2f} {gbps['raw']:>9.2f} "
            f"{gbps['kvarena'] / gbps['raw']:>6.2f}x {gbps['kvarena'] / gbps['per_layer']:>12.2f}x"
        )


if __name__ == "__main__":
    main()
