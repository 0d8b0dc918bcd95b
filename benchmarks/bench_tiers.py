"""Tier put/get throughput beside the raw operation on the same bytes, and the checksum's cost.

python benchmarks/bench_tiers.py [--sizes 16KiB,256KiB,2MiB,40MiB] [--round-mib 64] [--rounds 3]

For each object size, one round moves about ``--round-mib`` of objects:

- disk put: encode (header + xxh3-64 over the payload) and DiskTier.put_many
  (temporary files, one syncfs for the batch, renames) vs a plain file write
  of the same payloads, with an fsync each (the same durability) and without
  (page cache only: what the tier cannot promise);
- disk get: DiskTier.get_many + decode (the checksum and every header field
  checked) vs a plain open/read of the same bytes;
- redis put/get: RedisTier (one pipeline of SETs / GETs, images) + decode vs
  a plain pipeline of SET / GET of the payloads on the same connection kind,
  against a real redis-server started here on a free localhost port, and the
  same against a Redis Cluster of three primaries with a replica each
  (``cluster`` rows; ``--no-cluster`` leaves it out); then each object put
  and got alone (one round trip each): p50 and p99 milliseconds;
- mooncake put/get: MooncakeTier (images through its one registered staging
  buffer) + decode vs the Mooncake client's own ``put_batch`` / ``get_batch``
  of the payloads, against one ``mooncake_master`` on loopback, TCP
  (``--no-mooncake`` leaves it out); and each object alone;
- host put/get: HostTier (images held unsealed; a get reads them in place with
  ``HostTier.borrow``, checks every header field and copies the payload out once,
  as the connector's loads do) vs one numpy copy of the same bytes;
- disk get twice: from the page cache (just written) and from the disk (each
  file's pages dropped first with posix_fadvise DONTNEED, on both sides);
- checksum: xxh3-64 (the format's), zlib's CRC32 and (where the optional
  ``crc32c`` package is installed) hardware CRC32C over the payloads, and
  the checksum's share of a disk load, cold and warm.

``--trace`` instead replays ../shared/traces/mooncake_synthetic_trace.jsonl
(bookkeeping mode: tier objects are headers that stand for their payloads'
bytes) for Qwen3-Next-80B-A3B at TP 8 with a device budget far below the
trace's history: no tiers, host, host + disk, and the infinite-cache bound,
and prints the fraction of the infinite cache's hit tokens each recovers.

Methods run interleaved, every round (benchmarks/_timing.py), so the ratios
are fair on a noisy machine. Ratios are kvarena / raw: 1.0 is the raw speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import xxhash
from _timing import side_by_side

from kvarena.checks import parse_bytes
from kvarena.layout import aligned_zeros
from kvarena.testing.mooncake_master import MooncakeMaster, find_mooncake_master
from kvarena.testing.redis_server import RedisCluster, RedisServer, find_redis_server
from kvarena.tiers import (
    DiskTier,
    Expected,
    HostTier,
    ImageKind,
    RedisTier,
    decode,
    encode,
    parse_tier,
)
from kvarena.tiers.spec import TierSpec

NS = json.dumps(
    {"bench": "kvarena", "layers": [f"model.layers.{i}.self_attn.attn" for i in range(103)]},
    separators=(",", ":"),
).encode()
"""A namespace of a serving engine's size: every image carries one, and a load
compares it. vLLM's for Qwen3-Next-80B (48 layers in four groups, their specs)
is 3,421 bytes; this one is 3.4 KB too."""
CPU = torch.device("cpu")


def keys(n: int, tag: int) -> list[bytes]:
    return [tag.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(n)]


def objects(payloads: list[bytes], tag: int, *, seal: bool = True) -> list:
    """One KV image per payload, keyed by ``tag`` and its index."""
    return [
        encode(
            kind=ImageKind.KV_BLOCK,
            namespace=NS,
            key=key,
            start=0,
            end=16,
            payload=[p],
            payload_bytes=len(p),
            seal=seal,
        )
        for key, p in zip(keys(len(payloads), tag), payloads, strict=True)
    ]


def images(payloads: list[bytes], tag: int, *, seal: bool = True) -> tuple[list, list[Expected]]:
    """The images and what a load of each must find."""
    exps = [
        Expected(
            kind=ImageKind.KV_BLOCK,
            namespace=NS,
            key=key,
            start=0,
            end=16,
            payload_bytes=len(p),
            elided=False,
        )
        for key, p in zip(keys(len(payloads), tag), payloads, strict=True)
    ]
    return objects(payloads, tag, seal=seal), exps


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        self.n += 1
        return self.n


def bench_disk(payloads: list[bytes], root: Path, rounds: int) -> dict[str, float]:
    tier = DiskTier(root / "tier", 1 << 40)
    raw = root / "raw"
    raw.mkdir()
    tags = Counter()

    def tier_put() -> None:
        objs, _ = images(payloads, tags.next())
        tier.put_many(objs, want_evicted=False)
        tier.delete_many([o.name for o in objs])

    def raw_put(sync: bool) -> None:
        t = tags.next()
        paths = []
        for i, p in enumerate(payloads):
            path = raw / f"{t}-{i}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, p)
            if sync:
                os.fsync(fd)
            os.close(fd)
            paths.append(path)
        for path in paths:
            os.unlink(path)

    put = side_by_side(
        {
            "kvarena": tier_put,
            "raw write+fsync": lambda: raw_put(True),
            "raw write": lambda: raw_put(False),
        },
        rounds,
        CPU,
    )
    # Loads: the same objects, read back and checked; the raw side reads the
    # same bytes from plain files.
    objs, exps = images(payloads, 0)
    tier.put_many(objs, want_evicted=False)
    for i, p in enumerate(payloads):
        (raw / f"r{i}").write_bytes(p)
    names = [o.name for o in objs]

    def tier_get() -> list[memoryview]:
        return [
            decode(data, exp)  # type: ignore[arg-type]
            for data, exp in zip(tier.get_many(names), exps, strict=True)
        ]

    def raw_get() -> list[bytes]:
        out = []  # kept, like a tier's batch: the caller holds the bytes until it copies them
        for i in range(len(payloads)):
            with open(raw / f"r{i}", "rb", buffering=0) as fh:
                out.append(fh.read())
        return out

    def drop_cache(paths: list[Path]) -> None:
        """Evict the files' pages (clean after the syncs), so the next read hits the disk."""
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    tier_files = [Path(tier._path(n)) for n in names]
    raw_files = [raw / f"r{i}" for i in range(len(payloads))]

    def tier_cold() -> list[memoryview]:
        drop_cache(tier_files)
        return tier_get()

    def raw_cold() -> list[bytes]:
        drop_cache(raw_files)
        return raw_get()

    def checksum_only() -> None:
        for p in payloads:
            xxhash.xxh3_64_intdigest(p)

    get = side_by_side(
        {
            "kvarena": tier_get,
            "raw": raw_get,
            "xxh3": checksum_only,
            "kvarena cold": tier_cold,
            "raw cold": raw_cold,
        },
        rounds,
        CPU,
    )
    return {
        "put": put["kvarena"],
        "put_raw_sync": put["raw write+fsync"],
        "put_raw": put["raw write"],
        "get": get["kvarena"],
        "get_raw": get["raw"],
        "xxh3": get["xxh3"],
        "get_cold": get["kvarena cold"],
        "get_raw_cold": get["raw cold"],
    }


def one_at_a_time(tier, objs, exps, payloads, tags, rounds: int) -> dict[str, float]:
    """Each object got (and checked) and put alone, its own round trip: the
    latency of one, p50 and p99 (seconds)."""
    one_get, one_put = [], []
    for _ in range(rounds):
        for obj, exp in zip(objs, exps, strict=True):
            began = time.perf_counter()
            (data,) = tier.get_many([obj.name])
            decode(data, exp)  # type: ignore[arg-type]
            one_get.append(time.perf_counter() - began)
        fresh, _ = images(payloads, tags.next())
        for obj in fresh:
            began = time.perf_counter()
            tier.put_many([obj])
            one_put.append(time.perf_counter() - began)
        tier.delete_many([o.name for o in fresh])
    return {
        "get_p50": float(np.percentile(one_get, 50)),
        "get_p99": float(np.percentile(one_get, 99)),
        "put_p50": float(np.percentile(one_put, 50)),
        "put_p99": float(np.percentile(one_put, 99)),
    }


def bench_redis(payloads: list[bytes], url: str, rounds: int) -> dict[str, float]:
    """One Redis (``redis://``) or a Redis Cluster (``redis+cluster://``): the tier
    against raw pipelines on the same kind of client; and each object put and
    got alone, for the latency of one (p50, p99)."""
    import redis

    spec = TierSpec.parse(url)
    assert spec.url is not None
    tier = RedisTier(spec.url, timeout_s=60, cluster=spec.cluster)
    factory = redis.RedisCluster if spec.cluster else redis.Redis
    client = factory.from_url(spec.url, socket_timeout=60)
    tags = Counter()

    def tier_put() -> None:
        objs, _ = images(payloads, tags.next())
        tier.put_many(objs)
        tier.delete_many([o.name for o in objs])

    def raw_put() -> None:
        t = tags.next()
        pipe = client.pipeline(transaction=False)
        for i, p in enumerate(payloads):
            pipe.set(f"raw:{t}:{i}", p)
        pipe.execute()
        pipe = client.pipeline(transaction=False)
        for i in range(len(payloads)):
            pipe.unlink(f"raw:{t}:{i}")
        pipe.execute()

    put = side_by_side({"kvarena": tier_put, "raw": raw_put}, rounds, CPU)
    objs, exps = images(payloads, 0)
    tier.put_many(objs)
    pipe = client.pipeline(transaction=False)
    for i, p in enumerate(payloads):
        pipe.set(f"rawget:{i}", p)
    pipe.execute()
    names = [o.name for o in objs]

    def tier_get() -> list[memoryview]:
        return [
            decode(data, exp)  # type: ignore[arg-type]
            for data, exp in zip(tier.get_many(names), exps, strict=True)
        ]

    def raw_get() -> None:
        pipe = client.pipeline(transaction=False)
        for i in range(len(payloads)):
            pipe.get(f"rawget:{i}")
        pipe.execute()

    get = side_by_side({"kvarena": tier_get, "raw": raw_get}, rounds, CPU)
    one = one_at_a_time(tier, objs, exps, payloads, tags, rounds)
    client.flushall()
    tier.close()
    client.close()
    return {
        "put": put["kvarena"],
        "put_raw": put["raw"],
        "get": get["kvarena"],
        "get_raw": get["raw"],
        **one,
    }


def bench_mooncake(payloads: list[bytes], url: str, rounds: int) -> dict[str, float]:
    """Mooncake Store over TCP: the tier (images, one staging buffer registered
    once) against the client's own batch calls on raw payloads (``put_batch``,
    ``get_batch``); each object alone for its latency."""
    tier = parse_tier(f"{url}/{2 * len(payloads) * len(payloads[0]) + (256 << 20)}")
    store = tier._store  # the same client: raw calls beside the tier's
    tags = Counter()

    def tier_put() -> None:
        objs, _ = images(payloads, tags.next())
        tier.put_many(objs)
        tier.delete_many([o.name for o in objs])

    def raw_put() -> None:
        t = tags.next()
        keys = [f"raw:{t}:{i}" for i in range(len(payloads))]
        store.put_batch(keys, payloads)
        store.batch_remove(keys, True)

    put = side_by_side({"kvarena": tier_put, "raw": raw_put}, rounds, CPU)
    objs, exps = images(payloads, 0)
    tier.put_many(objs)
    raw_keys = [f"rawget:{i}" for i in range(len(payloads))]
    store.put_batch(raw_keys, payloads)
    names = [o.name for o in objs]

    def tier_get() -> list[memoryview]:
        return [
            decode(data, exp)  # type: ignore[arg-type]
            for data, exp in zip(tier.get_many(names), exps, strict=True)
        ]

    get = side_by_side({"kvarena": tier_get, "raw": lambda: store.get_batch(raw_keys)}, rounds, CPU)
    one = one_at_a_time(tier, objs, exps, payloads, tags, rounds)
    tier.delete_many(names)
    store.batch_remove(raw_keys, True)
    tier.close()
    return {
        "put": put["kvarena"],
        "put_raw": put["raw"],
        "get": get["kvarena"],
        "get_raw": get["raw"],
        **one,
    }


def bench_host(payloads: list[bytes], rounds: int) -> dict[str, float]:
    size = len(payloads[0])
    total = len(payloads) * size
    frame = images(payloads[:1], 0)[0][0].logical_bytes
    tier = HostTier(frame * len(payloads), frame_bytes=frame)
    # The raw copy's destination is memory of the tier's kind (an anonymous
    # mapping advised to huge pages): a plain np.empty takes 4 KiB pages here and
    # copies into it measured 0.65x as fast, which would flatter the tier.
    dst = aligned_zeros(total, 4096, CPU).numpy()
    srcs = [np.frombuffer(p, dtype=np.uint8) for p in payloads]
    tags = Counter()
    # The host tier's own path: images held unsealed (this process's memory),
    # loaded trusted (no checksum pass); every header field is still checked.
    objs, exps = images(payloads, 0, seal=False)

    def tier_put() -> None:
        objs_t = objects(payloads, tags.next(), seal=False)
        tier.put_many(objs_t, want_evicted=False)
        tier.delete_many([o.name for o in objs_t])

    def raw_copy() -> None:
        for i, s in enumerate(srcs):
            dst[i * size : (i + 1) * size] = s

    put = side_by_side({"kvarena": tier_put, "raw": raw_copy}, rounds, CPU)
    tier.put_many(objs, want_evicted=False)
    names = [o.name for o in objs]

    def tier_get() -> None:
        # The loaders' path: read in place, every header field checked, copied out once.
        with tier.borrow(names) as views:
            for i, (data, exp) in enumerate(zip(views, exps, strict=True)):
                payload = decode(data, exp, trusted=True)  # type: ignore[arg-type]
                dst[i * size : (i + 1) * size] = np.frombuffer(payload, dtype=np.uint8)

    # The raw get copies the very bytes the tier holds, from where it holds them
    # (nothing writes the tier meanwhile), with no lookup and no check: the same
    # source memory as the tier's get, so the ratio is the tier's work alone.
    with tier.borrow(names) as views:
        held = [
            np.frombuffer(decode(v, e, trusted=True), np.uint8)  # type: ignore[arg-type]
            for v, e in zip(views, exps, strict=True)
        ]

    def raw_get() -> None:
        for i, s in enumerate(held):
            dst[i * size : (i + 1) * size] = s

    get = side_by_side({"kvarena": tier_get, "raw": raw_get}, rounds, CPU)
    return {
        "put": put["kvarena"],
        "put_raw": put["raw"],
        "get": get["kvarena"],
        "get_raw": get["raw"],
        # Paired: each round's kvarena / raw, then the median (a copy's speed here
        # swings 8-19 GB/s from minute to minute; both halves of a round share it).
        "put_ratio": put.speed("kvarena", "raw"),
        "get_ratio": get.speed("kvarena", "raw"),
    }


def checksums(payloads: list[bytes], rounds: int) -> dict[str, float]:
    methods = {
        "xxh3-64": lambda: [xxhash.xxh3_64_intdigest(p) for p in payloads],
        "crc32": lambda: [zlib.crc32(p) for p in payloads],
    }
    try:  # CRC32C with the CPU's instruction, where the optional package is installed
        import crc32c  # type: ignore[import-not-found]

        methods["crc32c"] = lambda: [crc32c.crc32c(p) for p in payloads]
    except ImportError:
        pass
    return side_by_side(methods, rounds, CPU)


TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def trace_recovery(args: argparse.Namespace, work: Path) -> None:
    from kvarena import ServingOptions, model_cache
    from kvarena.prefix import CheckpointPolicy
    from kvarena.replay import ReplayConfig, infinite_bound, load_trace, replay

    trace = load_trace(TRACE, limit=args.limit)
    m = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=8))
    inf = infinite_bound(trace, m.block_size).metrics["hit_tokens"]
    base = ReplayConfig(
        budget_bytes=parse_bytes(args.device),
        max_seqs=64,
        policy=CheckpointPolicy.parse("end:512,interval:8192,branch"),
    )
    setups = [
        ("device only", ()),
        (f"+ host {args.host}", (f"host:{args.host}",)),
        (
            f"+ host {args.host} + disk {args.disk}",
            (f"host:{args.host}", f"disk:{work}/disk:{args.disk}"),
        ),
    ]
    print(f"Qwen3-Next-80B-A3B TP 8, device {args.device}, {len(trace):,} requests")
    print(f"{'setup':<34} {'hit tokens':>12} {'of infinite':>11} {'from tiers':>12} {'wall s':>7}")
    for label, tiers in setups:
        r = replay(m, trace, dataclasses.replace(base, tiers=tiers), label=label)
        from_tiers = sum(r.metrics.get("tier_hit_tokens", {}).values())
        print(
            f"{label:<34} {r.hit_tokens:>12,} {r.hit_tokens / inf:>10.1%} {from_tiers:>12,} "
            f"{r.wall_seconds:>7.1f}"
        )
        for row in r.tiers:
            print(
                f"    {row['tier']:<8} hit tokens {row['hit_tokens']:>12,}  puts {row['puts']:>9,}  "
                f"objects {row['objects']:>9,}  {row['seconds']:.1f} s"
            )
    print(f"{'infinite cache':<34} {inf:>12,} {1:>10.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="store_true", help="the shared-trace recovery run instead")
    ap.add_argument("--device", default="16GiB", help="--trace: the device budget")
    ap.add_argument("--host", default="16GiB", help="--trace: the host tier")
    ap.add_argument("--disk", default="1TiB", help="--trace: the disk tier (headers on disk)")
    ap.add_argument("--limit", type=int, default=None, help="--trace: the first N requests")
    ap.add_argument("--sizes", default="16KiB,256KiB,2MiB,40MiB")
    ap.add_argument("--round-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the disk tier writes (default: a temp dir)")
    ap.add_argument(
        "--cluster",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also a Redis Cluster (three primaries, three replicas) beside the one Redis",
    )
    ap.add_argument(
        "--mooncake",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also Mooncake Store (one master on this machine, TCP)",
    )
    args = ap.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvarena-bench-tiers-", dir=args.dir))
    if args.trace:
        try:
            trace_recovery(args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    redis = RedisServer(str(work), maxmemory="4gb") if find_redis_server() else None
    cluster = None
    if redis is None:
        print("redis-server not found: the Redis rows are skipped", file=sys.stderr)
    elif args.cluster:  # three primaries, each with a replica, on this machine
        cluster = RedisCluster(str(work / "cluster"), replicas=1)
    mooncake = None
    if args.mooncake and find_mooncake_master() is not None:
        mooncake = MooncakeMaster(work / "mooncake_master.log")
    elif args.mooncake:
        print("Mooncake is not installed: its rows are skipped", file=sys.stderr)
    rng = np.random.default_rng(0)
    print(
        f"{args.round_mib} MiB per round, median of {args.rounds} interleaved rounds; "
        "GB/s, and kvarena / raw (1.00 = the raw operation's speed)"
    )
    header = f"{'object':>8} {'path':<12} {'kvarena':>8} {'raw':>8} {'ratio':>6}  raw is"
    print(header)
    try:
        for size in sizes:
            count = max(2, (args.round_mib << 20) // size)
            payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(count)]
            total = count * size
            label = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"

            def row(
                path: str,
                ours: float,
                raw: float,
                what: str,
                ratio: float | None = None,
                label: str = label,
                total: int = total,
            ) -> None:
                gb = total / 1e9
                ratio = raw / ours if ratio is None else ratio
                print(
                    f"{label:>8} {path:<12} {gb / ours:8.2f} {gb / raw:8.2f} {ratio:6.2f}  {what}"
                )

            root = work / f"disk-{size}"
            root.mkdir()
            d = bench_disk(payloads, root, args.rounds)
            shutil.rmtree(root, ignore_errors=True)
            row("disk put", d["put"], d["put_raw_sync"], "write + fsync per file")
            row("disk put", d["put"], d["put_raw"], "write, no fsync (not durable)")
            row("disk get", d["get"], d["get_raw"], "open + read, from the page cache")
            row("disk get", d["get_cold"], d["get_raw_cold"], "open + read, from the disk")
            for name, store in (("redis", redis), ("cluster", cluster), ("mooncake", mooncake)):
                if store is None:
                    continue
                if name == "mooncake":
                    r = bench_mooncake(payloads, store.url, args.rounds)
                    row(f"{name} put", r["put"], r["put_raw"], "put_batch of the payloads")
                    row(f"{name} get", r["get"], r["get_raw"], "get_batch of the payloads")
                else:
                    r = bench_redis(payloads, store.url, args.rounds)
                    row(f"{name} put", r["put"], r["put_raw"], "pipelined SET")
                    row(f"{name} get", r["get"], r["get_raw"], "pipelined GET")
                print(
                    f"{label:>8} {name + ' one':<12} ms p50/p99: get "
                    f"{r['get_p50'] * 1e3:.2f}/{r['get_p99'] * 1e3:.2f}, put "
                    f"{r['put_p50'] * 1e3:.2f}/{r['put_p99'] * 1e3:.2f}"
                )
            h = bench_host(payloads, args.rounds)
            row("host put", h["put"], h["put_raw"], "numpy copy (paired)", h["put_ratio"])
            row("host get", h["get"], h["get_raw"], "numpy copy (paired)", h["get_ratio"])
            c = checksums(payloads, args.rounds)
            speeds = ", ".join(f"{k} {total / v / 1e9:.1f}" for k, v in c.items())
            print(
                f"{label:>8} {'checksum':<12} GB/s: {speeds}; xxh3 is "
                f"{100 * d['xxh3'] / d['get_cold']:.1f}% of a load from the disk, "
                f"{100 * d['xxh3'] / d['get']:.1f}% from the page cache"
            )
    finally:
        for store in (redis, cluster, mooncake):
            if store is not None:
                store.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
