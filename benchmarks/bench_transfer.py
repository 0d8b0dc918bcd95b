"""Ship a 4k-token request from a prefill process to a decode process over NIXL.

For the Qwen3-Next and DeepSeek-V4-Flash presets: descriptors per request
(kvarena: one per block run and per state slot; a per-layer-per-tensor
registration like today's engines: one per layer per field per block run and
per layer per state field), and the throughput of three transfers of the same
bytes in one run, interleaved: kvarena's descriptors, the per-layer ones, and
one raw descriptor. Loopback, CPU memory, UCX.

A load table follows: ``--load-requests`` requests of ``--load-tokens``
tokens (Qwen3-Next-80B-A3B at TP 8: about 11 MB each, KV and state), shipped
with 1, 4 and 8 WRITEs in flight (``PrefillSender.post``/``check``): requests
per second, GB/s, and p50/p99 latency from post to completion; every request
is then checked byte for byte on the decode side.

    python benchmarks/bench_transfer.py [--tokens 4096] [--rounds 5] [--tp 1] [--load-requests 64]
"""

from __future__ import annotations

import argparse
import os

from kvarena import plan_cache
from kvarena.layout import align_up, min_slot_stride
from kvarena.models import ServingOptions, model_cache
from kvarena.transfer.local_pair import SideProcess, connect_pair


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


def load(requests: int, tokens: int, levels: list[int]) -> list[dict]:
    m = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=8))
    blocks = -(-tokens // m.block_size)
    block = min_slot_stride(m.page_fields)
    slot = min_slot_stride(m.state_fields)
    total = align_up(requests * (blocks * block + slot) + 4 * block + slot, 1 << 20)
    plan = plan_cache(m, budget_bytes=total, max_seqs=requests, clamp=False)
    prefill, decode = SideProcess("prefill", plan), SideProcess("decode", plan)
    rows = []
    try:
        peer, prefill_name = connect_pair(prefill, decode)
        names = [f"L{i}" for i in range(requests)]
        digests = {
            n: prefill.call("fill", n, blocks, 1000 * i)["digests"] for i, n in enumerate(names)
        }
        for in_flight in levels:
            dsts = {n: decode.call("expect", n, blocks, 600.0, prefill_name) for n in names}
            r = prefill.call("load", peer, dsts, in_flight)
            got = decode.call("wait_all", names, 600.0)
            exact = all(g == digests[n] for g, n in zip(got, names, strict=True))
            for n in names:
                decode.call("finish", n)
            lat = sorted(r["latencies"])
            rows.append(
                {
                    "in_flight": in_flight,
                    "requests_per_s": r["requests"] / r["seconds"],
                    "gbps": r["nbytes"] / r["seconds"] / 1e9,
                    "p50_ms": 1e3 * lat[len(lat) // 2],
                    "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                    "mb": r["nbytes"] / r["requests"] / 1e6,
                    "exact": exact,
                }
            )
    finally:
        prefill.stop()
        decode.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--presets", nargs="*", default=["qwen3-next-80b-a3b", "deepseek-v4-flash"])
    parser.add_argument("--load-requests", type=int, default=64)
    parser.add_argument("--load-tokens", type=int, default=512)
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

    print()
    print(
        f"load: {args.load_requests} requests of {args.load_tokens} tokens, qwen3-next-80b-a3b TP 8"
    )
    print(
        f"{'in flight':>9} {'MB/request':>10} {'requests/s':>11} {'GB/s':>6} {'p50 ms':>7} {'p99 ms':>7} {'byte-exact':>10}"
    )
    for row in load(args.load_requests, args.load_tokens, [1, 4, 8]):
        print(
            f"{row['in_flight']:>9} {row['mb']:>10.1f} {row['requests_per_s']:>11.1f} {row['gbps']:>6.2f} "
            f"{row['p50_ms']:>7.1f} {row['p99_ms']:>7.1f} {row['exact']!s:>10}"
        )


if __name__ == "__main__":
    main()
