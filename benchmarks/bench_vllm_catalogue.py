"""How long vLLM's scheduler thread waits while the catalogue lists a shared store again.

.venv-vllm/bin/python benchmarks/bench_vllm_catalogue.py [--names 1000000] [--seconds 8]
    [--writes 2000]

The connector's catalogue answers the scheduler's lookups from memory and
lists the shared store again on a thread of its own (every 10 s by default,
:mod:`kvarena.integrations.vllm.catalogue`). The two threads share the
interpreter's lock: whatever the lister does in one call, the scheduler
waits for. Here a real ``redis-server`` on loopback holds ``--names``
objects (a fleet's store), the lister lists it back to back, and the main
thread plays the scheduler: a step's wait on its workers (a 200 µs sleep),
then a waiting request's catalogue work (64 names located, the logs of
removals and joined images read). Per row, the step's time p50/p99/max and
how many steps took 5 ms more than the sleep:

- ``no listing`` — the asks alone: the limit;
- ``one call per listing`` — the lister's set work (the listing made a set,
  compared with the last both ways) one call each, as a plain ``set`` code
  would do it;
- ``slices of 1,024`` — ``LIST_CHUNK``: the interpreter handed back after
  every slice, as a listing at start;
- ``slices, 25% of the time`` — the connector's listing in the background
  (``LIST_DUTY``): after each slice, a sleep three times as long as it took.
- ``following, 2,000 writes/s`` — no listing: the catalogue follows the
  store's announcements (``notify-keyspace-events K$gxe``) of another
  engine's saves, ``--writes`` a second from a process of its own; every
  name it saved must then be in the book.

``relist s``: one listing and its comparison, timed with nothing beside it
(spread over four times its work where the lister works a quarter of the time).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _host import host
from conftest import redis_binary

from kvarena.integrations.vllm.catalogue import LIST_CHUNK, LIST_DUTY, Catalogue
from kvarena.integrations.vllm.settings import ConnectorSettings
from kvarena.testing.redis_server import RedisServer
from kvarena.tiers.names import ImageKind, object_name
from kvarena.tiers.spec import TierSpec

STEP_S = 200e-6
ASKED = 64


def fill(url: str, n: int) -> list[str]:
    """``n`` objects in the store under the tier's prefix, as other engines left them."""
    store = TierSpec.parse(url).open()
    names = [object_name(ImageKind.KV_BLOCK, i.to_bytes(16, "big")) for i in range(n)]
    client = store.client
    for i in range(0, n, 20_000):
        client.mset({store.prefix + name: b"x" for name in names[i : i + 20_000]})
    store.close()
    return names


def steps(catalogue: Catalogue | None, names: list[str], seconds: float) -> list[float]:
    """The scheduler's steps for ``seconds``: each a sleep and one request's asks."""
    asked = names[:: max(1, len(names) // ASKED)][: ASKED // 2] + [f"kv-none{i}" for i in range(32)]
    out: list[float] = []
    gone = images = 0
    end = time.perf_counter() + seconds
    while (t := time.perf_counter()) < end:
        time.sleep(STEP_S)
        if catalogue is not None:
            catalogue.locate(asked)
            _, gone = catalogue.gone(gone)
            _, images = catalogue.images(images)
        out.append(time.perf_counter() - t)
    return out


_WRITER = """
import sys, time, redis
from kvarena.tiers.names import ImageKind, object_name
port, rate, seconds, FIRST = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), 1 << 100
client, began, i = redis.Redis(port=port), time.perf_counter(), 0
while time.perf_counter() - began < seconds:
    i += 1
    name = object_name(ImageKind.KV_BLOCK, (FIRST + i).to_bytes(16, "big"))
    client.set("kvarena:" + name, b"x")
    time.sleep(max(0.0, began + i / rate - time.perf_counter()))
print(i)
"""


def following(url: str, names: list[str], args) -> list[float]:
    """The scheduler's steps while the catalogue follows the store's announcements
    of another engine's saves (a process of its own, ``--writes`` a second);
    every name it saved must then be in the book."""
    import redis

    port = int(url.rsplit(":", 1)[1])
    redis.Redis(port=port).config_set("notify-keyspace-events", "K$gxe")
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", url]})
    catalogue = Catalogue(settings, rescan_s=3600, relist_live_s=3600)
    assert catalogue._live, "the store was not followed"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(port), str(args.writes), str(args.seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    times = steps(catalogue, names, args.seconds)
    saved = int(writer.communicate()[0])
    wrote = [
        object_name(ImageKind.KV_BLOCK, ((1 << 100) + i).to_bytes(16, "big"))
        for i in range(1, saved + 1)
    ]
    end = time.perf_counter() + 30
    while catalogue.locate(wrote).count(None) and time.perf_counter() < end:
        time.sleep(0.05)
    missing = catalogue.locate(wrote).count(None)
    catalogue.close()
    if missing:
        sys.exit(f"following: {missing:,} of {saved:,} names another engine saved not in the book")
    return times


def row(label: str, times: list[float], relist: float | None) -> str:
    q = statistics.quantiles(times, n=100)
    slow = sum(t > STEP_S + 5e-3 for t in times)
    r = f"{relist:>9.2f}" if relist is not None else f"{'':>9}"
    return (
        f"{label:<26} {len(times):>7,} {q[49] * 1e3:>8.2f} {q[98] * 1e3:>8.2f} "
        f"{max(times) * 1e3:>8.1f} {slow:>7,} {r}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--names", type=int, default=1_000_000, help="objects the store holds")
    ap.add_argument("--seconds", type=float, default=8.0, help="the scheduler's run per row")
    ap.add_argument("--writes", type=int, default=2000, help="names another engine saves a second")
    args = ap.parse_args()
    print(host())
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(tmp, binary=redis_binary())
        try:
            url = f"redis://127.0.0.1:{server.port}"
            names = fill(url, args.names)
            settings = ConnectorSettings.parse({"tiers": ["host:1GiB", url]})
            print(
                f"a store of {args.names:,} names on loopback; the scheduler's step: "
                f"{STEP_S * 1e6:.0f} µs asleep, then {ASKED} names located and the logs read"
            )
            print(
                f"{'lister':<26} {'steps':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
                f"{'>5 ms':>7} {'relist s':>9}"
            )
            print(row("no listing", steps(None, names, args.seconds), None))
            for label, chunk, duty in (
                ("one call per listing", args.names + 1, None),
                (f"slices of {LIST_CHUNK:,}", LIST_CHUNK, None),
                (f"slices, {LIST_DUTY:.0%} of the time", LIST_CHUNK, LIST_DUTY),
            ):
                catalogue = Catalogue(settings, rescan_s=3600, list_chunk=chunk)
                t = time.perf_counter()
                catalogue._relist(duty)
                relist = time.perf_counter() - t
                stop = threading.Event()

                def lister(
                    c: Catalogue = catalogue, stop: threading.Event = stop, duty=duty
                ) -> None:
                    while not stop.is_set():
                        c._relist(duty)

                thread = threading.Thread(target=lister, daemon=True)
                thread.start()
                times = steps(catalogue, names, args.seconds)
                stop.set()
                thread.join()
                held = catalogue.locate(names)
                catalogue.close()
                if held != [1] * len(names):  # the book, listed again and again, is the store's
                    missing = held.count(None)
                    sys.exit(f"{label}: {missing:,} of {len(names):,} stored names not in the book")
                print(row(label, times, relist))
            print(row(f"following, {args.writes:,} writes/s", following(url, names, args), None))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
