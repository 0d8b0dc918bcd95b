"""The scheduler's lookup per request at TP 8 with a host, a disk and a Redis tier.

.venv-vllm/bin/python benchmarks/bench_vllm_lookup.py [--requests 200] [--tokens 4096] [--held 20000] [--cluster] [--hybrid [--no-image]]

vLLM's scheduler is one thread: a lookup's time is every request's. The
connector's scheduler side answers ``get_num_new_matched_tokens`` (the
request's keys hashed, every rank's name of every block asked of the
catalogue, the resume point found); its catalogue answers from memory
(:mod:`kvarena.integrations.vllm.catalogue`). Beside it, in the same rounds,
the same lookups answered as the connector answered them before: a ``stat``
per rank's name in the disk directories and one pipelined ``EXISTS`` batch to
a real ``redis-server`` on loopback (the network's cost is not in it). The
tiers hold ``--held`` objects per rank (half on disk, half in the store) of a
shared prefix family, and each request misses past its first half: the
lookup probes every block it could use. ``--cluster``: the store a Redis
Cluster (three primaries, a replica each): the in-memory catalogue lists
every node; the probing path's ``EXISTS`` batch is one pipeline per node.
``--hybrid``: a model with a state group beside the attention one (a Mamba
state in ``align`` mode), the state held at the shared half's end: each
lookup also finds the deepest boundary with a state image. ``--no-image``:
the hybrid's state held nowhere (a KV run, no boundary to resume from: a hit
of none); the first ask walks every boundary of the run, the second none
(what it found is remembered while no image joins the books there).

Each request is looked up twice, as vLLM's scheduler asks a waiting request
step after step: the first ask keys the prompt (once per request: its saves
reuse them), the second is the lookup alone. Requests carry vLLM's own block
hashes, as the engine makes them (``sha256``, its default, at the same block
size); the in-memory side takes the keys of prefixes it met before from them
(:class:`~kvarena.integrations.vllm.key_memo.KeyMemo`), as the connector does,
and hashes the rest. For scale, the time vLLM's hashing of the same prompt
takes (it is done before the scheduler asks).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _host import host
from conftest import redis_binary

from kvarena.integrations.vllm.catalogue import Catalogue
from kvarena.integrations.vllm.groups import classify
from kvarena.integrations.vllm.key_memo import trusted_hashes
from kvarena.integrations.vllm.ranks import rank_dir, rank_names
from kvarena.integrations.vllm.scheduler_side import SchedulerSide
from kvarena.integrations.vllm.settings import ConnectorSettings
from kvarena.prefix.keys import block_keys, key_root
from kvarena.testing.redis_server import RedisCluster, RedisServer
from kvarena.tiers import RedisTier, TierObject
from kvarena.tiers.disk import SUFFIX
from kvarena.tiers.names import ImageKind, object_name
from kvarena.tiers.spec import TierSpec
from kvarena.tiers.stack import first_holders

BS = 16
RANKS = 8
NS = b'{"model":"bench"}'


class ProbingCatalogue(Catalogue):
    """The lookups as they were answered before: the disk by ``stat``, the store by
    one pipelined ``EXISTS`` per lookup, on the scheduler's thread."""

    def __init__(
        self, settings: ConnectorSettings, ranks: int, store: RedisTier, disk: str
    ) -> None:
        super().__init__(settings, ranks)
        self._store, self._dirs = (
            store,
            [os.path.join(rank_dir(disk, r, ranks), "") for r in range(ranks)],
        )

    def locate(self, names: Sequence[str]) -> list[int | None]:
        def probe(kind: str) -> Callable[[list[str]], list[bool]]:
            if kind == "disk":
                return lambda asked: [
                    any(os.path.isfile(f"{d}{n}{SUFFIX}") for d in self._dirs) for n in asked
                ]
            if kind == "redis":
                return self._store.contains_many
            return lambda asked: [n in self._held[kind] for n in asked]

        return first_holders(names, [probe(kind) for kind in self.kinds])


def groups(hybrid: bool):
    specs = [FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)]
    if hybrid:
        specs.append(
            MambaSpec(
                block_size=BS,
                shapes=((3, 1024), (4, 128, 128)),
                dtypes=(torch.bfloat16, torch.bfloat16),
                mamba_cache_mode="align",
            )
        )
    config = KVCacheConfig(
        num_blocks=4096,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
    )
    return classify(config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--held", type=int, default=20000, help="objects per rank in the tiers")
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="the store a Redis Cluster (three primaries, three replicas) instead of one Redis",
    )
    ap.add_argument(
        "--hybrid",
        action="store_true",
        help="a state group beside the attention one, its image held at the shared half's end",
    )
    ap.add_argument(
        "--no-image",
        action="store_true",
        help="with --hybrid: no state image held anywhere (every boundary walked)",
    )
    args = ap.parse_args()
    if args.no_image and not args.hybrid:
        ap.error("--no-image is a hybrid's case: pass --hybrid too")
    prefix = [(i * 7919) % 30000 + 1 for i in range(args.tokens)]
    root = key_root(NS)
    keys = block_keys(root, torch.tensor(prefix[: args.tokens // 2]).numpy(), BS, ())
    with tempfile.TemporaryDirectory() as tmp:
        if args.cluster:  # three primaries, a replica each
            server: Any = RedisCluster(tmp, replicas=1, binary=redis_binary())
        else:
            server = RedisServer(tmp, binary=redis_binary())
        url = server.url if args.cluster else f"redis://127.0.0.1:{server.port}"
        disk = tmp + "/disk"
        spec = TierSpec.parse(url)
        assert spec.url is not None
        store = RedisTier(spec.url, cluster=spec.cluster)
        # the request's first half in the tiers (every rank), the rest filler
        names = [object_name(ImageKind.KV_BLOCK, k) for k in keys]
        if args.hybrid and not args.no_image:
            names.append(object_name(ImageKind.STATE, keys[-1]))
        filler = [object_name(ImageKind.KV_BLOCK, i.to_bytes(16, "big")) for i in range(args.held)]
        held = names + filler
        for i, name in enumerate(held):
            for r, rn in enumerate(rank_names(name, RANKS)):
                if i % 2 == 0:
                    d = Path(rank_dir(disk, r, RANKS))
                    d.mkdir(parents=True, exist_ok=True)
                    (d / f"{rn}{SUFFIX}").touch()
        store.put_many(
            [
                TierObject(rn, (b"x",), 1)
                for i, n in enumerate(held)
                if i % 2
                for rn in rank_names(n, RANKS)
            ]
        )
        settings = ConnectorSettings.parse({"tiers": ["host:1GiB", f"disk:{disk}:1TiB", url]})
        sides = {
            "in memory": SchedulerSide(
                groups=groups(args.hybrid),
                namespace=NS,
                catalogue=Catalogue(settings, RANKS),
                block_size=BS,
                ranks=RANKS,
                memo=trusted_hashes("sha256", BS, BS),
            ),
            "stat + EXISTS": SchedulerSide(
                groups=groups(args.hybrid),
                namespace=NS,
                catalogue=ProbingCatalogue(settings, RANKS, store, disk),
                block_size=BS,
                ranks=RANKS,
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in sides}
        again: dict[str, list[float]] = {k: [] for k in sides}
        hits: dict[str, set[int]] = {k: set() for k in sides}
        init_none_hash(sha256)
        hasher = get_request_block_hasher(BS, sha256)
        vllm_hash: list[float] = []
        for i in range(args.requests):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))  # turn by turn
            for label in order:
                side = sides[label]
                tail = [(i * 31 + j) % 30000 + 1 for j in range(args.tokens // 2)]
                request = Request(
                    f"{label}{i}",
                    prefix[: args.tokens // 2] + tail,
                    SamplingParams(max_tokens=1),
                    None,
                    block_hasher=hasher,
                )
                t0 = time.perf_counter()
                hit, _ = side.matched(request, 0)
                t1 = time.perf_counter()
                side.matched(request, 0)
                t2 = time.perf_counter()
                times[label].append(t1 - t0)
                again[label].append(t2 - t1)
                hits[label].add(hit)
                side.finished(request)
                if label == "in memory":
                    request.block_hashes.clear()
                    t0 = time.perf_counter()
                    hasher(request)
                    vllm_hash.append(time.perf_counter() - t0)
        for side in sides.values():
            side.catalogue.close()
        store.close()
        server.stop()
    probes = RANKS * ((args.tokens - 1) // BS) * (2 if args.hybrid else 1)
    where = "a Redis Cluster of 3 primaries" if args.cluster else "one Redis"
    model = "a hybrid (attention and a state)" if args.hybrid else "attention alone"
    if args.no_image:
        model += ", its state held nowhere"
    print(host())
    print(
        f"TP {RANKS}, {model}, {args.tokens:,}-token prompts (a hit of the first half), "
        f"{args.held:,} objects per rank held in {where}; {probes:,} names a lookup may ask"
    )

    def p(ts: list[float], q: float) -> float:
        ts = sorted(ts)
        return ts[min(len(ts) - 1, int(q * len(ts)))] * 1e6

    head = f"{'catalogue':<16} {'first p50 µs':>13} {'first p99':>10} {'again p50 µs':>13} {'again p99':>10}"
    print(head + f" {'hit tokens':>11}")
    for label, ts in times.items():
        more = again[label]
        print(
            f"{label:<16} {p(ts, 0.5):>13,.0f} {p(ts, 0.99):>10,.0f} {p(more, 0.5):>13,.0f} "
            f"{p(more, 0.99):>10,.0f} {sorted(hits[label])!s:>11}"
        )
    print(
        f"vLLM's own block hashes of the same prompt (sha256): p50 {p(vllm_hash, 0.5):,.0f} µs, "
        f"p99 {p(vllm_hash, 0.99):,.0f} µs"
    )


if __name__ == "__main__":
    main()
