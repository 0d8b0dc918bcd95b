"""Following a shared store's changes as they happen: Redis keyspace notifications.

Listing a store a fleet shares (``SCAN``) visits every key it holds: each
engine listing it every few seconds costs the store its whole keyspace per
engine per period, and finds what changed a period late. A server that
announces its keys' changes (``notify-keyspace-events`` holding ``K`` and the
classes ``$ g x e``, or ``KA``) publishes every set, delete, expiry and
eviction of a key on ``__keyspace@<db>__:<key>``; a client subscribed to its
prefix's pattern there hears each change of its objects a round trip after
it, from every engine and from the server's own evictions, and needs a
listing only to start from and to repair.

Pub/sub delivers at most once: a subscriber that falls behind (the server
drops it past ``client-output-buffer-limit pubsub``) or loses its connection
misses what happened meanwhile. So a lost subscription is an error the
follower raises (:class:`FeedLost`), and its owner subscribes again and then
lists the store again: in that order, nothing between is missed.

A server announces nothing of a ``FLUSHALL``, ``FLUSHDB`` or ``SWAPDB`` (its
keys go, or change places, unannounced): the follower reads the server's
count of those commands every few seconds (``INFO commandstats``, at most
:data:`_CHECK_S` late) and a change in it is a lost feed too, so the store
is listed at once. A server that refuses ``INFO`` leaves them to the next
listing; until then a name listed but gone is a failed load, which costs a
recompute.

A Redis Cluster announces a key's changes on the node that holds it: the
feed subscribes on every primary, and asks the cluster for its primaries as
often (a change, a failover, is a lost feed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .base import TierError
from .redis_tier import decoded

REMOVING = frozenset({"del", "expired", "evicted", "rename_from", "move_from"})
"""The events after which a key is gone (``UNLINK`` and ``GETDEL`` announce ``del``);
every other event a key's channel carries leaves it holding a value."""

NEEDED = "$gxe"
"""The event classes a follower needs besides ``K`` (or ``A``, all of them):
strings set (``$``), deletes and renames (``g``), expiries (``x``) and
evictions (``e``). Without one of them a removal would go unheard."""

MAX_CHANGES = 10_000
"""Changes one :meth:`StoreFeed.changes` call hands back at most: the caller applies
them and calls again, so no call holds the interpreter for a burst's length."""

_CHECK_S = 5.0
"""How often the store is asked what its announcements leave out: a cluster's
primaries (compared with those subscribed), and each server's count of flushes."""

UNANNOUNCED = ("flushall", "flushdb", "swapdb")
"""The commands that change keys with no announcement (``INFO commandstats`` counts each)."""


class FeedLost(TierError):
    """The subscription broke: changes since may have gone unheard."""


def announces(config: str) -> bool:
    """Whether a server whose ``notify-keyspace-events`` is ``config`` publishes
    every change a follower needs (:data:`NEEDED` on the keyspace channel)."""
    classes = set(config)
    return "K" in classes and ("A" in classes or set(NEEDED) <= classes)


class StoreFeed:
    """A live subscription to the changes of every key under ``prefix`` on each
    of ``nodes`` (redis-py clients, one per server: the store's, or each
    primary's), made by :func:`open_feed`. ``primaries``: for a cluster, how
    to read its primaries' names now (a change is a lost feed)."""

    def __init__(
        self,
        nodes: dict[str, Any],
        prefix: str,
        db: int,
        primaries: Callable[[], list[str]] | None = None,
    ) -> None:
        self._channel = f"__keyspace@{db}__:{prefix}"
        self._primaries = primaries
        self._checked = time.monotonic()
        self._subs: list[Any] = []
        self._reconnects = 0
        # each server's count of flushes, read before subscribing: a flush
        # between the two is found by the owner's first listing, which follows
        self._clients = dict(nodes)
        self._flushes = {name: unannounced(c) for name, c in nodes.items()}
        try:
            for client in nodes.values():
                sub = client.pubsub()
                self._subs.append(sub)
                sub.psubscribe(self._channel + "*")
                # the server's confirmation: from here on every change is announced to us
                deadline = time.monotonic() + 5.0
                while True:
                    msg = sub.get_message(timeout=0.5)
                    if msg is not None and msg.get("type") == "psubscribe":
                        break
                    if time.monotonic() > deadline:
                        raise FeedLost("the server did not confirm the subscription")
                # redis-py connects a broken subscription again by itself, and
                # subscribes again: what was announced between is lost unseen
                sub.connection.register_connect_callback(self._connected_again)
        except Exception as exc:
            self.close()
            raise FeedLost(f"subscribing failed: {exc}") from None
        self.nodes = sorted(nodes)

    def changes(self, timeout: float) -> list[tuple[str, bool]]:
        """The changes heard since the last call, oldest first: each object's name
        and whether it holds a value after it (at most :data:`MAX_CHANGES`;
        waiting up to ``timeout`` seconds for the first). :class:`FeedLost` when
        the subscription broke."""
        out: list[tuple[str, bool]] = []
        cut = len(self._channel)
        wait = timeout / max(1, len(self._subs))
        try:
            self._check()
            for sub in self._subs:
                if len(out) >= MAX_CHANGES:
                    break
                msg = sub.get_message(timeout=wait if not out else 0.0)
                while msg is not None:
                    if msg.get("type") == "pmessage":
                        name = decoded(msg["channel"])[cut:]
                        out.append((name, decoded(msg["data"]) not in REMOVING))
                    if len(out) >= MAX_CHANGES:  # the rest wait in the socket for the next call
                        break
                    msg = sub.get_message(timeout=0.0)
        except FeedLost:
            raise
        except Exception as exc:  # the connection broke, or a reply made no sense
            raise FeedLost(f"the subscription broke: {exc}") from None
        if self._reconnects:
            raise FeedLost("the subscription broke and was taken again: changes went unheard")
        return out

    def _connected_again(self, _connection: Any) -> None:
        self._reconnects += 1

    def _check(self) -> None:
        """Every :data:`_CHECK_S`: :class:`FeedLost` where a cluster's primaries
        changed, or a server has flushed or swapped a database since."""
        if time.monotonic() - self._checked < _CHECK_S:
            return
        self._checked = time.monotonic()
        if self._primaries is not None:
            now = sorted(self._primaries())
            if now != self.nodes:
                raise FeedLost(f"the cluster's primaries changed ({self.nodes} -> {now})")
        for name, before in self._flushes.items():
            if before is not None and unannounced(self._clients[name], strict=True) != before:
                raise FeedLost(
                    f"the store ({name}) flushed or swapped a database (or its counts were "
                    "reset): what went was not announced"
                )

    def close(self) -> None:
        for sub in self._subs:
            try:
                sub.close()
            except Exception:  # closing a broken connection: nothing left to free
                pass
        self._subs = []


def unannounced(client: Any, *, strict: bool = False) -> dict[str, int] | None:
    """The server's counts of :data:`UNANNOUNCED` commands (``INFO
    commandstats``; a command never called is absent there, counted 0), or None
    where ``INFO`` is refused (a managed store may): its flushes are then left
    to the listings. ``strict``: a failure raises (a feed already counting)."""
    try:
        stats = client.info("commandstats")
    except Exception:
        if strict:
            raise
        return None
    return {cmd: int(stats.get(f"cmdstat_{cmd}", {}).get("calls", 0)) for cmd in UNANNOUNCED}


def open_feed(client: Any, prefix: str) -> tuple[StoreFeed | None, str]:
    """A feed of the store ``client`` reaches (a ``redis.Redis`` or a
    ``redis.RedisCluster``) for keys under ``prefix``, or None and why not: a
    server that does not announce what a follower needs (its
    ``notify-keyspace-events``), one whose configuration cannot be read, or
    one that cannot be reached."""
    try:
        import redis
    except ImportError:
        return None, "redis-py is not installed"
    primaries: Callable[[], list[str]] | None = None
    try:
        if isinstance(client, redis.RedisCluster):
            client.nodes_manager.initialize()  # the primaries as the cluster has them now

            def listed() -> list[str]:
                client.nodes_manager.initialize()  # asked of the cluster, not remembered
                return [n.name for n in client.get_primaries()]

            primaries = listed

            nodes = {n.name: client.get_redis_connection(n) for n in client.get_primaries()}
            db = 0
        else:
            nodes = {"store": client}
            db = int(client.connection_pool.connection_kwargs.get("db", 0) or 0)
        for name, node in nodes.items():
            got = node.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
            config = decoded(got)
            if not announces(config):
                return None, (
                    f"the store ({name}) does not announce its keys' changes "
                    f"(notify-keyspace-events is {config!r}; K{NEEDED} or KA would)"
                )
    except Exception as exc:  # CONFIG refused (a managed store), or unreachable
        return None, f"the store's notify-keyspace-events could not be read ({exc})"
    try:
        return StoreFeed(nodes, prefix, db, primaries), "following the store's announcements"
    except FeedLost as exc:
        return None, str(exc)
