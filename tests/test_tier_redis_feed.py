"""Following a shared store's changes: keyspace notifications of a real
``redis-server`` (and a Redis Cluster) on loopback.

The rule every test holds a feed to: applied in order, the changes it hands
back bring a book of names to what the server holds under the prefix — every
engine's sets and deletes, the server's expiries and evictions — and a
subscription that breaks is an error the caller sees, never a silent gap.
Announcements travel asynchronously, so a test waits for them (up to a
generous deadline), never for a time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from conftest import redis_binary  # noqa: E402

from kvarena.tiers import redis_feed  # noqa: E402
from kvarena.tiers.redis_feed import (  # noqa: E402
    MAX_CHANGES,
    NEEDED,
    UNANNOUNCED,
    FeedLost,
    StoreFeed,
    announces,
    open_feed,
    unannounced,
)

PREFIX = "kvarena:"
DEADLINE_S = 20.0


def _announcing(client, events: str = "K" + NEEDED) -> None:
    client.config_set("notify-keyspace-events", events)


@contextlib.contextmanager
def _followed(port: int) -> Iterator[tuple[Any, StoreFeed]]:
    """A client of the server on ``port``, made to announce, and a feed of it."""
    client = redis.Redis(port=port)
    _announcing(client)
    feed, why = open_feed(client, PREFIX)
    assert feed is not None, why
    try:
        yield client, feed
    finally:
        feed.close()
        client.close()


def _truth(client, keys) -> dict[str, bool]:
    return {k: bool(client.exists(PREFIX + k)) for k in keys}


def _follow(feed: StoreFeed, book: dict[str, bool], until) -> None:
    """Apply the feed's changes to ``book`` until ``until(book)`` holds."""
    deadline = time.monotonic() + DEADLINE_S
    while not until(book):
        assert time.monotonic() < deadline, f"announcements missing; book {book}"
        for name, held in feed.changes(0.2):
            book[name] = held


@pytest.mark.parametrize(
    ("config", "follows"),
    [
        ("", False),
        ("KEA", True),
        ("KA", True),
        ("K$gxe", True),
        ("Kgx$e", True),
        ("E$gxe", False),  # key-event channels only: not the keyspace ones followed
        ("K$gx", False),  # evictions unannounced
        ("K$ge", False),  # expiries unannounced
        ("Kgxe", False),  # sets unannounced
    ],
)
def test_a_server_is_followed_only_where_it_announces_every_change_needed(config, follows):
    assert announces(config) is follows


def test_a_server_that_does_not_announce_is_not_followed_and_says_why(redis_server):
    client = redis.Redis(port=redis_server.port)
    feed, why = open_feed(client, PREFIX)
    assert feed is None and "notify-keyspace-events" in why and "''" in why
    _announcing(client, "K$g")  # deletes and sets, not expiries nor evictions
    feed, why = open_feed(client, PREFIX)
    assert feed is None and "notify-keyspace-events" in why
    client.close()


def test_every_change_of_the_prefix_is_heard_in_order_and_nothing_else(redis_server):
    with _followed(redis_server.port) as (client, feed):
        client.set(PREFIX + "a", b"1")
        client.set(PREFIX + "b", b"2")
        client.set("other:c", b"3")  # another prefix: not ours
        client.delete(PREFIX + "a")
        client.set(PREFIX + "a", b"4")
        client.unlink(PREFIX + "b")
        client.set(PREFIX + "t", b"5", px=1)  # expires at once
        client.rename(PREFIX + "a", PREFIX + "r")
        client.set(PREFIX + "end", b"6")
        heard: list[tuple[str, bool]] = []
        deadline = time.monotonic() + DEADLINE_S
        while ("end", True) not in heard:
            assert time.monotonic() < deadline, heard
            heard += feed.changes(0.2)
        book: dict[str, bool] = {}
        for name, held in heard:
            book[name] = held
        assert heard[:6] == [
            ("a", True),
            ("b", True),
            ("a", False),
            ("a", True),
            ("b", False),
            ("t", True),
        ]
        assert ("a", False) in heard[6:] and ("r", True) in heard[6:]
        _follow(feed, book, lambda b: b.get("t") is False)  # its expiry, however late
        assert all(not n.startswith("other") for n in book)
        assert book == _truth(client, book)


def test_the_servers_evictions_are_heard(tmp_path):
    from kvarena.testing.redis_server import RedisServer

    with RedisServer(str(tmp_path), binary=redis_binary(), maxmemory="4mb") as server:
        with _followed(server.port) as (client, feed):
            keys = [f"k{i}" for i in range(40)]
            for k in keys:  # 10 MB into 4: the server evicts (allkeys-lru)
                client.set(PREFIX + k, b"x" * (256 << 10))
            book: dict[str, bool] = {}
            _follow(feed, book, lambda b: len(b) == len(keys) and b == _truth(client, keys))
            assert not all(book.values()), "nothing was evicted"


def test_a_broken_subscription_is_an_error_not_a_gap(redis_server):
    with _followed(redis_server.port) as (client, feed):
        assert client.client_kill_filter(_type="pubsub") == 1
        with pytest.raises(FeedLost, match="broke"):  # not taken again unseen
            for _ in range(50):
                feed.changes(0.1)


@pytest.mark.parametrize("command", [("FLUSHALL",), ("FLUSHDB", "ASYNC"), ("SWAPDB", "0", "1")])
def test_what_a_server_removes_unannounced_is_a_lost_feed(redis_server, monkeypatch, command):
    """A flush or swap of a database announces nothing of the keys it takes:
    the feed finds it in the server's counts, within its check's period, and
    raises (its owner subscribes again and lists the store)."""
    monkeypatch.setattr(redis_feed, "_CHECK_S", 0.2)
    with _followed(redis_server.port) as (client, feed):
        client.set(PREFIX + "a", b"1")
        book: dict[str, bool] = {}
        _follow(feed, book, lambda b: b == {"a": True})
        client.execute_command(*command)
        assert not client.exists(PREFIX + "a")  # gone, and nothing announced it
        deadline = time.monotonic() + DEADLINE_S
        with pytest.raises(FeedLost, match="flushed or swapped"):
            while time.monotonic() < deadline:
                assert feed.changes(0.1) == []


def test_a_server_that_refuses_info_is_followed_without_counting_flushes(redis_server):
    """A store whose ACL refuses ``INFO`` (as managed stores may) is still
    followed: its flushes are left to the listings, as the module says."""
    admin = redis.Redis(port=redis_server.port)
    _announcing(admin)
    admin.acl_setuser(
        "feeder", enabled=True, nopass=True, keys=["*"], channels=["*"], commands=["+@all", "-info"]
    )
    client = redis.Redis(port=redis_server.port, username="feeder")
    try:
        assert unannounced(client) is None
        assert unannounced(admin) == {cmd: 0 for cmd in UNANNOUNCED}  # a new server
        admin.execute_command("FLUSHDB")
        assert unannounced(admin) == {"flushall": 0, "flushdb": 1, "swapdb": 0}
        feed, why = open_feed(client, PREFIX)
        assert feed is not None, why
        try:
            admin.set(PREFIX + "b", b"1")
            book: dict[str, bool] = {}
            _follow(feed, book, lambda b: b == {"b": True})
        finally:
            feed.close()
    finally:
        admin.acl_deluser("feeder")
        client.close()
        admin.close()


def test_a_burst_is_handed_back_in_bounded_pieces(redis_server):
    with _followed(redis_server.port) as (client, feed):
        pipe = client.pipeline(transaction=False)
        total = MAX_CHANGES + 500
        for i in range(total):
            pipe.set(f"{PREFIX}{i}", b"")
        pipe.execute()
        sizes: list[int] = []
        deadline = time.monotonic() + DEADLINE_S
        while sum(sizes) < total:
            assert time.monotonic() < deadline, sizes
            sizes.append(len(feed.changes(0.2)))
        assert sum(sizes) == total and max(sizes) <= MAX_CHANGES


def test_a_cluster_is_followed_on_every_primary_and_a_flush_of_one_is_a_lost_feed(
    tmp_path, monkeypatch
):
    from kvarena.testing.redis_server import RedisCluster

    with RedisCluster(str(tmp_path), binary=redis_binary()) as cluster:
        for s in cluster.servers:
            _announcing(redis.Redis(port=s.port))
        from kvarena.tiers.stack import parse_tier

        tier = parse_tier(cluster.url)
        client = tier.client
        feed, why = open_feed(client, PREFIX)
        assert feed is not None, why
        try:
            assert len(feed.nodes) == 3
            keys = [f"k{i}" for i in range(60)]  # spread over every primary's slots
            for k in keys:
                client.set(PREFIX + k, b"1")
            for k in keys[::3]:
                client.delete(PREFIX + k)
            held = {s.port: redis.Redis(port=s.port).dbsize() for s in cluster.servers}
            assert all(held.values()), held  # every primary holds some
            book: dict[str, bool] = {}
            want = {k: k not in keys[::3] for k in keys}
            _follow(feed, book, lambda b: b == want)
            # one primary flushed: its keys go unannounced, its count tells
            monkeypatch.setattr(redis_feed, "_CHECK_S", 0.2)
            redis.Redis(port=cluster.servers[1].port).flushall()
            deadline = time.monotonic() + DEADLINE_S
            with pytest.raises(FeedLost, match="flushed or swapped"):
                while time.monotonic() < deadline:
                    feed.changes(0.1)
        finally:
            feed.close()
            tier.close()


def _promoted(replica: redis.Redis) -> None:
    """Until ``replica`` is a primary: a manual failover gives up after 5 s where
    the replica has not caught up with its primary (a loaded machine), so it is
    asked again; what follows then tests the feed, not the failover."""
    deadline = time.monotonic() + DEADLINE_S
    while replica.info("replication").get("role") != "master":
        assert time.monotonic() < deadline, "the replica was never promoted"
        assert replica.cluster("failover") in (True, b"OK", "OK")
        asked = time.monotonic()
        while time.monotonic() < asked + 6 and replica.info("replication")["role"] != "master":
            time.sleep(0.1)


def test_a_clusters_failover_is_a_lost_feed(tmp_path):
    """A replica promoted by a manual failover (its old primary still up, every
    connection of the feed still open): the feed, asking the cluster for its
    primaries, raises instead of following a node that no longer takes writes."""
    from kvarena.testing.redis_server import RedisCluster
    from kvarena.tiers.stack import parse_tier

    with RedisCluster(str(tmp_path), nodes=3, replicas=1, binary=redis_binary()) as cluster:
        cluster.wait_ok()
        for s in cluster.servers:
            _announcing(redis.Redis(port=s.port))
        tier = parse_tier(cluster.url)
        feed, why = open_feed(tier.client, PREFIX)
        assert feed is not None, why
        try:
            primaries = {s.port for s in cluster.primaries()}
            replica = next(s for s in cluster.servers if s.port not in primaries)
            _promoted(redis.Redis(port=replica.port))
            deadline = time.monotonic() + DEADLINE_S
            with pytest.raises(FeedLost, match="primaries changed"):
                while time.monotonic() < deadline:
                    feed.changes(0.2)
        finally:
            feed.close()
            tier.close()
