"""The scheduler's book of the tiers: a lookup is answered from memory, never
by a disk or a network on the scheduler's thread. The disk directories are read
once at start, the shared store listed at start and again in the background,
and the workers' reports keep both between; what it lists stale costs a failed
load (vLLM recomputes), which the scheduler tests cover.

Runs in the ``.venv-vllm`` environment; skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kvarena.integrations.vllm.catalogue import Catalogue
from kvarena.integrations.vllm.settings import ConnectorSettings
from kvarena.tiers.names import ImageKind, object_name

NAMES = [object_name(ImageKind.KV_BLOCK, bytes([i]) * 16) for i in range(6)]


def test_the_disk_is_read_at_start_and_kept_by_reports_without_io(tmp_path, monkeypatch):
    disk = tmp_path / "kv"
    for r, names in ((0, NAMES[:2]), (1, NAMES[2:3])):
        (disk / f"tp{r}").mkdir(parents=True)
        for n in names:
            (disk / f"tp{r}" / f"{n}.kvi").write_bytes(b"x")
    (disk / "tp0" / ".kv-partial.123.ab.tmp").write_bytes(b"x")  # a temporary: not an object
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", f"disk:{disk}:1GiB"]})
    catalogue = Catalogue(settings, ranks=2)

    def no_io(*_a, **_k):
        raise AssertionError("a lookup touched the filesystem")

    monkeypatch.setattr(os, "scandir", no_io)
    monkeypatch.setattr(os, "stat", no_io)
    monkeypatch.setattr(os.path, "isfile", no_io)
    assert catalogue.locate(NAMES[:4]) == [1, 1, 1, None]
    catalogue.hosted([NAMES[0]], [])
    catalogue.written([NAMES[3]])  # written through by a worker
    catalogue.reported("disk", [], [NAMES[1]])  # evicted by the disk tier
    assert catalogue.locate(NAMES[:5]) == [0, None, 1, 1, None]
    catalogue.close()


def test_the_store_is_listed_at_start_and_again_and_never_asked_by_a_lookup(redis_server):
    from kvarena.tiers.spec import TierSpec

    url = f"redis://127.0.0.1:{redis_server.port}"
    other = TierSpec.parse(url).open()  # another engine's writes
    from kvarena.tiers import TierObject

    other.put_many([TierObject(n, (b"x",), 1) for n in NAMES[:2]])
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", url]})
    catalogue = Catalogue(settings, rescan_s=3600)  # listings only where the test asks
    try:
        assert catalogue.locate(NAMES[:3]) == [1, 1, None]  # listed at start
        other.put_many([TierObject(NAMES[2], (b"x",), 1)])
        other.delete_many([NAMES[0]])  # its server evicted one
        catalogue.written([NAMES[4]])  # this engine's own write: known at once
        assert catalogue.locate([NAMES[0], NAMES[2], NAMES[4]]) == [1, None, 1]  # stale until...
        catalogue._relist()  # ...the next listing: the store's truth
        assert catalogue.locate([NAMES[0], NAMES[2], NAMES[4]]) == [None, 1, None]
        other.put_many([TierObject(NAMES[4], (b"x",), 1)])
        catalogue._relist()
        assert catalogue.locate([NAMES[0], NAMES[2], NAMES[4]]) == [None, 1, 1]
        redis_server.stop()  # the store gone: lookups still answer, at once, from memory
        assert catalogue.locate([NAMES[2]]) == [1]
        catalogue._relist()  # a failed listing keeps what is known
        assert catalogue.locate([NAMES[2]]) == [1]
    finally:
        catalogue.close()
        other.close()


_MOVES = st.lists(
    st.tuples(st.sampled_from(["put", "evict", "wrote", "dropped"]), st.integers(0, 7)),
    max_size=3,
)
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "evict", "wrote", "dropped", "relist"]),
        st.integers(0, 7),
        _MOVES,  # for a relisting: what happens while it lists, before the scan...
        _MOVES,  # ...and after it
    ),
    max_size=14,
)
_BOTH = [*NAMES[:4], *(object_name(ImageKind.STATE, bytes([i]) * 16) for i in range(4))]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS, chunk=st.integers(1, 3))
def test_a_relisting_brings_the_book_to_the_store_but_for_reports_made_while_it_ran(
    redis_server, ops, chunk
):
    """Against a model: after a listing, a name is in the store's book as the
    listing has it, unless this engine reported it (put or dropped) after the
    listing began, where the last report decides; between listings the reports
    alone change the book. Every name that leaves the book is logged gone,
    every state image that joins it logged joined. Any slice size."""
    from kvarena.tiers import TierObject
    from kvarena.tiers.spec import TierSpec

    url = f"redis://127.0.0.1:{redis_server.port}"
    store = TierSpec.parse(url).open()
    store.client.flushall()
    catalogue = Catalogue(
        ConnectorSettings.parse({"tiers": ["host:1GiB", url]}), rescan_s=3600, list_chunk=chunk
    )
    book: set[str] = set()
    recent: dict[str, bool] = {}  # reported since the listing under way began: held?

    def do(op: str, i: int) -> None:
        name = _BOTH[i]
        if op == "put":  # another engine's write
            store.put_many([TierObject(name, (b"x",), 1)])
        elif op == "evict":  # the store's server evicts
            store.delete_many([name])
        elif op == "wrote":  # this engine's write-through
            store.put_many([TierObject(name, (b"x",), 1)])
            catalogue.written([name])
            book.add(name)
            recent[name] = True
        else:  # a worker found it gone
            catalogue.reported("redis", [], [name])
            book.discard(name)
            recent[name] = False

    real = catalogue._redis.names
    try:
        for op, i, during, after in ops:
            if op != "relist":
                do(op, i)
                continue
            listing: list[set[str]] = []

            def names(duty=None, during=during, after=after, listing=listing):
                recent.clear()
                for o, j in during:
                    do(o, j)
                got = real(duty)
                listing.append(set(got))
                for o, j in after:  # the store and the reports move on after the scan
                    do(o, j)
                return got

            catalogue._redis.names = names
            was, gone0, images0 = set(book), catalogue.removals(), catalogue.images_joined()
            catalogue._relist()
            book = {n for n in listing[0] if n not in recent} | {n for n, h in recent.items() if h}
            gone, _ = catalogue.gone(gone0)
            joined, _ = catalogue.images(images0)
            assert set(gone) >= {n for n in was - book}
            assert set(joined) >= {n for n in book - was if n.startswith("st-")}
            recent.clear()
        assert catalogue.locate(_BOTH) == [1 if n in book else None for n in _BOTH]
    finally:
        catalogue.close()
        store.close()


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True, "4096"])
def test_a_slice_size_that_is_not_a_positive_count_is_refused(chunk):
    from kvarena.errors import InvalidValueError

    with pytest.raises(InvalidValueError, match="list_chunk"):
        Catalogue(ConnectorSettings.parse({"tiers": ["host:1GiB"]}), list_chunk=chunk)


@pytest.mark.parametrize("key", ["rescan_s", "relist_live_s"])
@pytest.mark.parametrize("seconds", [0, -1.0, float("nan"), True, "10"])
def test_a_listing_period_that_is_not_seconds_is_refused(key, seconds):
    from kvarena.errors import InvalidValueError

    with pytest.raises(InvalidValueError, match=key):
        Catalogue(ConnectorSettings.parse({"tiers": ["host:1GiB"]}), **{key: seconds})


def test_the_listing_benchmark_runs_and_keeps_every_stored_name(monkeypatch, capsys):
    """``benchmarks/bench_vllm_catalogue.py``'s small case: every row runs, and
    after listings back to back beside the asks the book holds every name the
    store does, and following, every name another engine saved (the benchmark
    exits non-zero otherwise)."""
    import sys
    from pathlib import Path

    from conftest import redis_binary

    redis_binary()  # skips where redis-server is missing (fails under CI)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "bench_vllm_catalogue", raising=False)
    import bench_vllm_catalogue

    argv = ["bench", "--names", "5000", "--seconds", "0.3", "--writes", "200"]
    monkeypatch.setattr(sys, "argv", argv)
    bench_vllm_catalogue.main()
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[-5:]]
    assert rows == ["no", "one", "slices", "slices,", "following,"]


def test_a_listing_that_fails_part_way_is_logged_and_the_next_finds_every_change(
    redis_server, monkeypatch, caplog
):
    """A fault in the lister's thread (here its comparison raising after taking
    in part of a listing) costs stale answers until the next listing, never the
    lister: the next listing brings the book to the store again, names the
    failed one took in and names that left alike."""
    from kvarena.integrations.vllm import catalogue as module
    from kvarena.tiers import TierObject
    from kvarena.tiers.spec import TierSpec

    url = f"redis://127.0.0.1:{redis_server.port}"
    store = TierSpec.parse(url).open()
    store.put_many([TierObject(n, (b"x",), 1) for n in NAMES[:3]])
    catalogue = Catalogue(ConnectorSettings.parse({"tiers": ["host:1GiB", url]}), rescan_s=3600)
    real = module.compare

    taken: list[int] = []

    def fails(seen, listing, listed, size, pace):
        taken.append(len(listed))
        real(seen, listing, listed[:1], size, pace)  # the first name taken in, then a fault
        raise RuntimeError("a fault part way")

    try:
        store.put_many([TierObject(n, (b"x",), 1) for n in NAMES[3:5]])
        store.delete_many([NAMES[0]])
        monkeypatch.setattr(module, "compare", fails)
        catalogue._stop.set()  # the background lister stopped: the loop runs here,
        catalogue._list_now.set()
        catalogue._lister.join()  # one listing, then stops
        catalogue._stop.clear()
        stops = iter([False, True])
        monkeypatch.setattr(catalogue._list_now, "wait", lambda _s: True)
        monkeypatch.setattr(catalogue._stop, "is_set", lambda: next(stops))
        catalogue._list_loop(0, 0)
        assert taken == [4] and "listing the shared store failed" in caplog.text
        assert catalogue.locate(NAMES[:5]) == [1, 1, 1, None, None]  # stale, as before
        monkeypatch.setattr(module, "compare", real)
        catalogue._relist()
        assert catalogue.locate(NAMES[:6]) == [None, 1, 1, 1, 1, None]
    finally:
        catalogue.close()
        store.close()


def test_a_listing_in_the_background_keeps_to_its_share_of_the_time(monkeypatch):
    """The lister's loop lists at ``LIST_DUTY`` (its comparison and the store's
    ``SCAN`` rest between slices, :class:`~kvarena.tiers.duty.DutyCycle`); a
    listing at start does not rest beyond handing the interpreter over."""
    from kvarena.integrations.vllm import catalogue as module

    settings = ConnectorSettings.parse({"tiers": ["host:1GiB"]})
    catalogue = Catalogue(settings)
    asked: list[float | None] = []
    monkeypatch.setattr(catalogue, "_relist", asked.append)
    stops = iter([False, True])
    monkeypatch.setattr(catalogue._list_now, "wait", lambda _s: True)
    monkeypatch.setattr(catalogue._stop, "is_set", lambda: next(stops))
    catalogue._list_loop(0, 0)
    assert asked == [module.LIST_DUTY] and module.LIST_DUTY == 0.25


def _until(check, what: str, deadline_s: float = 20.0) -> None:
    """Wait for an announcement's effect (they travel asynchronously), never for a time."""
    import time

    end = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.02)


def _heard_and_not_listed(catalogue, other, name: str, monkeypatch) -> None:
    """Another engine saves ``name`` with every listing made impossible: only the
    store's announcement can bring it into the book."""
    from kvarena.tiers import TierObject

    monkeypatch.setattr(catalogue._redis, "names", lambda duty=None: None)
    other.put_many([TierObject(name, (b"x",), 1)])
    _until(lambda: catalogue.locate([name]) == [1], f"{name} heard")


def test_a_store_that_announces_its_changes_is_followed_without_listing_it(redis_server, caplog):
    """With ``notify-keyspace-events`` on, another engine's writes and deletes and
    the server's evictions reach the book as they happen: no listing after the
    first (both listing periods an hour here)."""
    import logging

    import redis

    from kvarena.tiers import TierObject
    from kvarena.tiers.spec import TierSpec

    redis.Redis(port=redis_server.port).config_set("notify-keyspace-events", "K$gxe")
    url = f"redis://127.0.0.1:{redis_server.port}"
    other = TierSpec.parse(url).open()
    other.put_many([TierObject(NAMES[0], (b"x",), 1)])
    caplog.set_level(logging.INFO, "vllm.kvarena")
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", url]})
    catalogue = Catalogue(settings, rescan_s=3600, relist_live_s=3600)
    off = Catalogue(
        ConnectorSettings.parse({"tiers": ["host:1GiB", url], "store_feed": "off"}),
        rescan_s=3600,
    )
    try:
        assert "following the store's announcements" in caplog.text
        assert "store_feed is 'off'; listing it every 3600 s" in caplog.text
        assert off._follower is None and not off._live  # and never tries to subscribe
        assert catalogue.locate(NAMES[:2]) == [1, None] and catalogue._listings == 1
        images = catalogue.images_joined()
        state = object_name(ImageKind.STATE, b"s" * 16)
        other.put_many([TierObject(n, (b"x",), 1) for n in (NAMES[1], state)])
        other.delete_many([NAMES[0]])
        _until(lambda: catalogue.locate([NAMES[0], NAMES[1], state]) == [None, 1, 1], "heard")
        assert catalogue._listings == 1
        # what joined and left is logged as a listing's changes are
        joined, _ = catalogue.images(images)
        gone, _ = catalogue.gone(0)
        assert joined == [state] and gone == [NAMES[0]]
        assert off.locate([NAMES[0], NAMES[1]]) == [1, None]  # not followed: stale till listed
    finally:
        catalogue.close()
        off.close()
        other.close()


@contextmanager
def _beside(redis_server, *, announces):
    """A catalogue listing every 0.2 s (every hour while it follows) beside
    ``redis_server``, whose announcements are set to ``announces`` first (None:
    left as they are); with an admin connection and another engine's tier."""
    import redis

    from kvarena.tiers.spec import TierSpec

    admin = redis.Redis(port=redis_server.port)
    if announces is not None:
        admin.config_set("notify-keyspace-events", announces)
    url = f"redis://127.0.0.1:{redis_server.port}"
    other = TierSpec.parse(url).open()
    catalogue = Catalogue(
        ConnectorSettings.parse({"tiers": ["host:1GiB", url]}), rescan_s=0.2, relist_live_s=3600
    )
    try:
        yield admin, other, catalogue
    finally:
        catalogue.close()
        other.close()
        admin.close()


def test_a_lost_subscription_is_taken_again_and_the_store_listed_again(
    redis_server, caplog, monkeypatch
):
    """A subscription that breaks (here the server drops every subscriber, and
    announces nothing while its configuration is off) loses the changes made
    meanwhile: the lister lists the store at once and at the unfollowed pace
    until the follower subscribes again, which lists it once more."""
    from kvarena.tiers import TierObject

    with _beside(redis_server, announces="KA") as (admin, other, catalogue):
        assert catalogue._live and catalogue._listings == 1
        other.put_many([TierObject(NAMES[4], (b"x",), 1)])
        _until(lambda: catalogue.locate([NAMES[4]]) == [1], "heard")
        admin.config_set("notify-keyspace-events", "")
        other.delete_many([NAMES[4]])  # heard saved, its delete unheard, never listed
        assert admin.client_kill_filter(_type="pubsub") == 1
        _until(lambda: not catalogue._live, "the loss seen")
        other.put_many([TierObject(NAMES[2], (b"x",), 1)])  # announced to nobody
        _until(lambda: catalogue.locate([NAMES[2], NAMES[4]]) == [1, None], "listed again")
        assert "changes went unheard" in caplog.text or "broke" in caplog.text
        listed = catalogue._listings
        admin.config_set("notify-keyspace-events", "KA")
        _until(lambda: catalogue._live and catalogue._listings > listed, "followed again")
        _heard_and_not_listed(catalogue, other, NAMES[3], monkeypatch)


def test_a_flushed_store_is_listed_at_once_and_followed_again(redis_server, monkeypatch):
    """``FLUSHALL`` takes every name and announces none: the feed finds it in the
    server's counts, the store is listed at once (the next listing is an hour
    away here), and what is saved after is followed again."""
    from kvarena.tiers import TierObject, redis_feed

    monkeypatch.setattr(redis_feed, "_CHECK_S", 0.2)
    with _beside(redis_server, announces="KA") as (admin, other, catalogue):
        other.put_many([TierObject(n, (b"x",), 1) for n in NAMES[:3]])
        _until(lambda: catalogue.locate(NAMES[:3]) == [1, 1, 1], "heard")
        listed = catalogue._listings
        admin.flushall()
        _until(lambda: catalogue.locate(NAMES[:3]) == [None, None, None], "listed after the flush")
        assert catalogue._listings > listed
        _until(lambda: catalogue._live, "followed again")
        _heard_and_not_listed(catalogue, other, NAMES[3], monkeypatch)


def test_the_feed_benchmark_runs_and_every_engine_finds_every_sampled_name(monkeypatch, capsys):
    """``benchmarks/bench_store_feed.py``'s small case: every row runs, and every
    sampled name reaches every engine's book, listed or announced (the
    benchmark exits non-zero otherwise); following, no listing after the first."""
    import sys
    from pathlib import Path

    from conftest import redis_binary

    redis_binary()  # skips where redis-server is missing (fails under CI)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "bench_store_feed", raising=False)
    import bench_store_feed

    argv = ["bench", "--names", "2000", "--engines", "2", "--writes", "40", "--seconds", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--rescan-s", "0.3"])
    bench_store_feed.main()
    rows = capsys.readouterr().out.splitlines()[-4:-1]
    assert [r.split()[0] for r in rows] == ["writes", "listing", "following"]
    assert rows[2].split()[-1] == "0"  # no listing while following


def test_a_store_that_starts_announcing_is_followed_from_then_on(redis_server, monkeypatch):
    """An engine started beside a store whose server did not announce tries to
    subscribe again every listing period: once the server announces, it
    follows it."""
    with _beside(redis_server, announces=None) as (admin, other, catalogue):
        assert not catalogue._live and catalogue._follower is not None
        admin.config_set("notify-keyspace-events", "K$gxe")
        _until(lambda: catalogue._live, "subscribed once the server announces")
        _heard_and_not_listed(catalogue, other, NAMES[5], monkeypatch)


def test_names_changed_since_a_listing_are_bounded_by_listing_sooner(redis_server, monkeypatch):
    """What reports and announcements changed since the last listing is kept for
    the next to check; past ``TOUCHED_MAX`` names the store is listed at once,
    which empties it."""
    from kvarena.integrations.vllm import catalogue as module

    monkeypatch.setattr(module, "TOUCHED_MAX", 3)
    url = f"redis://127.0.0.1:{redis_server.port}"
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", url], "store_feed": "off"})
    catalogue = Catalogue(settings, rescan_s=3600, list_chunk=2)
    try:
        # applied in order across slices of two: the first name saved, then deleted
        catalogue.heard([(NAMES[0], True), (NAMES[1], True), (NAMES[0], False), (NAMES[2], True)])
        assert catalogue.locate(NAMES[:3]) == [None, 1, 1]
        assert catalogue._listings == 1 and len(catalogue._touched) == 3  # at the bound
        catalogue.reported("redis", [NAMES[3]], [])
        # the store holds none of them: the listing, at once, checks every one
        _until(
            lambda: catalogue._listings == 2 and catalogue.locate(NAMES[:4]) == [None] * 4,
            "listed at once",
        )
        assert not catalogue._touched
    finally:
        catalogue.close()
