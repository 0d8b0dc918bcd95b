"""Prefill -> decode handoffs: kvarena's READs against per-layer descriptors, one raw
transfer, and vLLM's own NixlConnector.

.venv-vllm/bin/python benchmarks/bench_vllm_pd.py [--tokens 4096] [--rounds 15] [--prompts 8]

Part 1, the layout: Qwen3-Next-80B-A3B at TP 8 as vLLM lays out one rank's
cache (``bench_vllm_layout.allocate``), a prefill cache and a decode cache in
one process, each registered with a NIXL agent of its own (UCX over
loopback). One request's handoff (its KV blocks of 12 attention layers and
its state of 36 Gated DeltaNet layers) is READ three ways, round by round
in a shuffled order: with kvarena's paired descriptors (spans merged where
they continue each other on both sides, :mod:`kvarena.integrations.vllm.pd_table`),
with one descriptor per layer's page span (what a per-layer describer posts),
and as one raw READ of the same byte count from one contiguous buffer (the
limit). Per row: descriptors, bytes, median time, and speed beside the raw
READ.

Part 2, the engines: the tiny Llama and Qwen3-Next, a prefill and a decode
engine each in a process of its own, with kvarena's connector and with
vLLM's ``NixlConnector`` (``kv_buffer_device="cpu"``: it runs here; for the
hybrid it asks ``VLLM_SSM_CONV_STATE_LAYOUT=DS``). Each
prompt is prefilled, then sent to the decode engine with one token to
generate: the decode side's time to first token, transfer included, median
over the prompts; and, for kvarena, descriptors, bytes and seconds per pull
as its decode workers report them. ``kvarena+tiers``: a decode engine with a
disk tier of its own that once computed each prompt's first three quarters
(its device cache emptied since), so it loads those from its tier and reads
only the rest. vLLM alone computing the whole prompt gives the same measure
without a handoff.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("UCX_MODULES", "^ib")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import side_by_side
from bench_vllm_layout import BLOCK, allocate

from kvarena.integrations.vllm.pd_table import SpanTable, pair
from kvarena.transfer.endpoint import nixl_api


def nixl_shim() -> None:
    """vLLM's NixlConnector imports the ``nixl`` package, a shim that picks
    ``nixl_cu12`` or ``nixl_cu13`` and pulls both in; kvarena installs
    ``nixl_cu12`` alone, so the benchmark's engine processes name it ``nixl``."""
    import nixl_cu12
    import nixl_cu12._api
    import nixl_cu12._bindings

    sys.modules.setdefault("nixl", nixl_cu12)
    sys.modules.setdefault("nixl._api", nixl_cu12._api)
    sys.modules.setdefault("nixl._bindings", nixl_cu12._bindings)


# -- part 1 ------------------------------------------------------------------------
def layout_part(tokens: int, rounds: int, layout: str) -> None:
    nixl_agent, nixl_agent_config = nixl_api()
    full = tokens // BLOCK
    blocks = 2 * full + 8
    there = allocate(layout, blocks, True, torch.device("cpu"))
    here = allocate(layout, blocks, True, torch.device("cpu"))
    remote, local = SpanTable.of(there), SpanTable.of(here)
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False)
    a = nixl_agent(f"bench-prefill-{layout}", config)
    b = nixl_agent(f"bench-decode-{layout}", config)
    a.register_memory(remote.regions(), "DRAM")
    b.register_memory(local.regions(), "DRAM")
    kv_r = np.array([[b_] for b_ in range(3, 3 + full)])
    kv_l = np.array([[b_] for b_ in range(full + 4, 2 * full + 4)])
    st_r, st_l = np.array([[blocks - 2, blocks - 3, blocks - 4]]), np.array([[1, 2, full + 3]])
    merged = [pair(local, remote, "kv", kv_l, kv_r), pair(local, remote, "state", st_l, st_r)]
    ours = np.concatenate([m for m, _ in merged])
    peer = np.concatenate([p for _, p in merged])
    per_layer_l, per_layer_r = [], []
    for kind, lb, rb in (("kv", kv_l, kv_r), ("state", st_l, st_r)):
        la, ln = local.addresses(kind, lb)
        ra, _ = remote.addresses(kind, rb)
        per_layer_l.append(np.stack([la, ln, np.zeros_like(ln)], axis=1))
        per_layer_r.append(np.stack([ra, ln, np.zeros_like(ln)], axis=1))
    pl_l, pl_r = np.concatenate(per_layer_l), np.concatenate(per_layer_r)
    nbytes = int(ours[:, 1].sum())
    raw_src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
    raw_dst = torch.empty(nbytes, dtype=torch.uint8)
    a.register_memory([raw_src])
    b.register_memory([raw_dst])
    name = b.add_remote_agent(a.get_agent_metadata())
    raw = (
        np.array([[raw_dst.data_ptr(), nbytes, 0]]),
        np.array([[raw_src.data_ptr(), nbytes, 0]]),
    )

    def read(rows: tuple[np.ndarray, np.ndarray]):
        def run() -> None:
            h = b.initialize_xfer(
                "READ", b.get_xfer_descs(rows[0], "DRAM"), b.get_xfer_descs(rows[1], "DRAM"), name
            )
            state = b.transfer(h)
            while state == "PROC":
                a.get_new_notifs()  # the target's worker, driven
                state = b.check_xfer_state(h)
            assert state == "DONE", state
            b.release_xfer_handle(h)

        return run

    ways = {"kvarena": (ours, peer), "per-layer": (pl_l, pl_r), "raw": raw}
    t = side_by_side({k: read(v) for k, v in ways.items()}, rounds, torch.device("cpu"))
    # the READ moved exactly the prefill's bytes into the decode's blocks
    for kind, lb, rb in (("kv", kv_l, kv_r), ("state", st_l, st_r)):
        got = here.gather(kind, lb.tolist())[0]
        assert torch.equal(got, there.gather(kind, rb.tolist())[0]), kind
    print(
        f"\nQwen3-Next-80B-A3B TP 8, {layout}: a {tokens:,}-token request = "
        f"{full} KV blocks x 12 layers + 1 state x 36 layers, {nbytes / 1e6:.1f} MB; "
        "NIXL READ over UCX loopback"
    )
    print(f"{'READ':<12} {'descriptors':>11} {'bytes':>12} {'ms':>8} {'GB/s':>7} {'vs raw':>7}")
    for k, (rows, _) in ways.items():
        s = t[k]
        print(
            f"{k:<12} {len(rows):>11,} {int(rows[:, 1].sum()):>12,} {s * 1e3:>8.2f} "
            f"{int(rows[:, 1].sum()) / s / 1e9:>7.2f} {t.speed(k, 'raw'):>6.2f}x"
        )


# -- part 2 ------------------------------------------------------------------------
def engines_part(n_prompts: int) -> None:
    from vllm.config import KVTransferConfig

    from kvarena.integrations.transformers.tiny import save_tiny
    from kvarena.integrations.vllm import kv_transfer_config
    from kvarena.testing.vllm_engine import engine_args
    from kvarena.testing.vllm_pair import EngineProcess, cold, pd_books

    root = tempfile.mkdtemp(prefix="bench-pd-")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(1024)] for _ in range(n_prompts)]
    print(f"\n{n_prompts} prompts of 1,024 tokens; decode engine's time to first token (median)")
    print(
        f"{'model':<11} {'connector':<15} {'TTFT ms':>8} {'desc/req':>9} {'KB/req':>8} {'pull ms':>8}"
    )
    for kind, block in (("llama", 32), ("qwen3_next", None)):
        model = save_tiny(kind, root)
        base = {"distributed_executor_backend": "uni", "block_size": block}

        def ttft(engine, params) -> float:
            times = []
            for p, kv in zip(prompts, params, strict=True):
                began = time.perf_counter()
                engine.generate([p], [kv], max_tokens=1)
                times.append(time.perf_counter() - began)
            return statistics.median(times) * 1e3

        alone = EngineProcess(engine_args(model, **base, enable_prefix_caching=False))
        try:
            print(f"{kind:<11} {'(vLLM alone)':<15} {ttft(alone, [None] * n_prompts):>8.1f}")
        finally:
            alone.stop()
        for name in ("kvarena", "kvarena+tiers", "NixlConnector"):
            if name.startswith("kvarena"):
                tiers = [f"disk:{root}/tiers-{kind}:1GiB"] if name.endswith("tiers") else []
                configs = [
                    kv_transfer_config([], role="kv_producer"),
                    kv_transfer_config(tiers, role="kv_consumer"),
                ]
                setup, env = None, [{}, {}]
            else:
                configs = [
                    KVTransferConfig(
                        kv_connector="NixlConnector",
                        kv_role=r,
                        kv_buffer_device="cpu",
                        kv_load_failure_policy="recompute",
                    )
                    for r in ("kv_producer", "kv_consumer")
                ]
                setup = nixl_shim
                # its hybrid transfer reads the conv state in the DS layout only
                env = [
                    {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(p), "VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
                    for p in (15601, 15701)
                ]
            engines = [
                EngineProcess(engine_args(model, **base, kv_transfer_config=c), env=e, setup=setup)
                for c, e in zip(configs, env, strict=True)
            ]
            try:
                producer, consumer = engines
                if name.endswith("tiers"):  # its tiers hold each prompt's first 3/4
                    consumer.generate([p[: len(p) * 3 // 4] for p in prompts], max_tokens=1)
                    consumer.call(cold)
                answers = producer.generate(
                    prompts, [{"do_remote_decode": True}] * n_prompts, max_tokens=1
                )
                params = [
                    {k: v for k, v in a.params.items() if k != "remote_prefill_cached_tokens"}
                    for a in answers
                ]
                ms = ttft(consumer, params)
                row = f"{kind:<11} {name:<15} {ms:>8.1f}"
                if name.startswith("kvarena"):
                    pulls = consumer.call(pd_books)["pulls"]
                    row += (
                        f" {statistics.median(p['descriptors'] for p in pulls):>9.0f}"
                        f" {statistics.median(p['nbytes'] for p in pulls) / 1024:>8.0f}"
                        f" {statistics.median(p['seconds'] for p in pulls) * 1e3:>8.2f}"
                    )
                print(row)
            finally:
                for e in engines:
                    e.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="the 80B request's prompt tokens")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per engine pair")
    parser.add_argument("--no-engines", action="store_true", help="part 1 alone")
    args = parser.parse_args()
    for layout in ("LBHNC", "BLHNC"):  # vLLM's CPU layout; the block-major one
        layout_part(args.tokens, args.rounds, layout)
    if not args.no_engines:
        engines_part(args.prompts)


if __name__ == "__main__":
    main()
