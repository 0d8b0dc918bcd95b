"""What a fleet's engines cost a shared store to know what it holds: listing it
against following its announcements.

.venv-vllm/bin/python benchmarks/bench_store_feed.py [--names 200000] [--engines 4]
    [--writes 200] [--seconds 25] [--rescan-s 10]

Every engine's catalogue must learn what the others save and what the server
evicts (:mod:`kvarena.integrations.vllm.catalogue`). A real ``redis-server``
on loopback holds ``--names`` objects; ``--engines`` catalogues (each an
engine's scheduler) watch it while another engine saves ``--writes`` names a
second for ``--seconds``. Per row:

- ``store CPU``: the server's CPU seconds over the window (``INFO cpu``), per
  second: what keeping the engines informed costs the store, on top of the
  writes themselves (the ``writes alone`` row, no catalogue: the limit);
- ``found p50/p99/max``: how long after its write a name is in every
  engine's book (sampled names, the books polled every millisecond);
- ``listings``: the store's listings over the window, all engines together.

Rows: ``writes alone``; ``listing every 10 s`` (a server without keyspace
notifications: ``RESCAN_S``); ``following announcements``
(``notify-keyspace-events K$gxe``: :mod:`kvarena.tiers.redis_feed`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _host import host
from bench_vllm_catalogue import fill
from conftest import redis_binary

from kvarena.integrations.vllm.catalogue import RESCAN_S, Catalogue
from kvarena.integrations.vllm.settings import ConnectorSettings
from kvarena.testing.redis_server import RedisServer
from kvarena.tiers.names import ImageKind, object_name


def _cpu(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def row(
    url: str,
    client,
    engines: int,
    writes: int,
    seconds: float,
    follow: bool | None,
    first: int,
    rescan_s: float,
):
    """One window: the store's CPU a second, when written names were found, listings
    (the names written numbered from ``first``: no row finds another's)."""
    client.config_set("notify-keyspace-events", "K$gxe" if follow else "")
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", url]})
    books = (
        [Catalogue(settings, rescan_s=rescan_s) for _ in range(engines)]
        if follow is not None
        else []
    )
    listed = sum(c._listings for c in books)
    written: dict[str, float] = {}
    found: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:  # every engine's book polled for the sampled names
        while not stop.is_set():
            for name, at in list(written.items()):
                if name not in found and all(c.locate([name]) == [1] for c in books):
                    found[name] = time.perf_counter() - at
            time.sleep(1e-3)

    watcher = threading.Thread(target=watch, daemon=True)
    if books:
        watcher.start()
    cpu = _cpu(client)
    began = time.perf_counter()
    serial = 0
    keys: list[str] = []
    while time.perf_counter() - began < seconds:
        serial += 1
        name = object_name(ImageKind.KV_BLOCK, (first + serial).to_bytes(16, "big"))
        keys.append("kvarena:" + name)
        client.set(keys[-1], b"x")
        if serial % max(1, writes // 4) == 0:  # four names a second sampled
            written[name] = time.perf_counter()
        time.sleep(max(0.0, began + serial / writes - time.perf_counter()))
    used = (_cpu(client) - cpu) / (time.perf_counter() - began)
    end = time.perf_counter() + 30.0  # the last samples' discovery, however slow
    while books and len(found) < len(written) and time.perf_counter() < end:
        time.sleep(0.05)
    stop.set()
    listings = sum(c._listings for c in books) - listed
    for c in books:
        c.close()
    for i in range(0, len(keys), 10_000):  # the store as it was for the next row
        client.delete(*keys[i : i + 10_000])
    return used, sorted(found.values()), len(written), listings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--names", type=int, default=200_000)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--writes", type=int, default=200, help="names saved a second")
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--rescan-s", type=float, default=RESCAN_S, help="between listings")
    args = ap.parse_args()
    import redis

    print(host())
    print(
        f"{args.names:,} names in one redis-server, {args.engines} engines' catalogues, "
        f"another engine saving {args.writes} names a second for {args.seconds:g} s"
    )
    print(
        f"{'row':<26} {'store CPU':>10} {'found p50':>10} {'p99':>8} {'max':>8} "
        f"{'found':>7} {'listings':>9}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        with RedisServer(tmp, binary=redis_binary(), maxmemory="2gb") as server:
            url = f"redis://127.0.0.1:{server.port}"
            fill(url, args.names)
            client = redis.Redis(port=server.port)
            missed = 0
            for k, (label, follow) in enumerate(
                (
                    ("writes alone", None),
                    (f"listing every {args.rescan_s:g} s", False),
                    ("following announcements", True),
                )
            ):
                used, found, sampled, listings = row(
                    url,
                    client,
                    args.engines,
                    args.writes,
                    args.seconds,
                    follow,
                    (k + 1) << 64,
                    args.rescan_s,
                )
                if follow is not None:
                    missed += sampled - len(found)
                ms = (
                    [f"{statistics.median(found) * 1e3:>9,.1f}ms"]
                    + [
                        f"{x * 1e3:>7,.1f}ms"
                        for x in (found[int(0.99 * (len(found) - 1))], found[-1])
                    ]
                    if found
                    else [f"{'-':>10}", f"{'-':>8}", f"{'-':>8}"]
                )
                print(
                    f"{label:<26} {used:>9.3f}s {' '.join(ms)} "
                    f"{len(found):>3}/{sampled:<3} {listings:>9}"
                )
            client.close()
    print("(store CPU: the server's CPU seconds a second; found: after its write, in every book)")
    if missed:
        sys.exit(f"{missed} sampled names never reached every engine's book")


if __name__ == "__main__":
    main()
