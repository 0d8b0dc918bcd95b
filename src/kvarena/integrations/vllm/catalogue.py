"""What the scheduler knows of the tiers, answered from memory.

vLLM's scheduler is one thread: whatever it waits for, every request waits
for. So a lookup does no I/O: the catalogue keeps, per tier, the names it
knows held, and ``locate`` is set membership. Each book is fed from where
that tier's truth lives:

- the host tier lives in the worker's memory: the names the worker reports
  putting and dropping (a step late);
- the disk tier's directory is read once at start (every rank's; a restarted
  engine finds what the last one wrote), then kept by the worker's reports of
  what it wrote through and what the tier evicted or dropped;
- the shared store is listed at start and kept by this engine's own writes
  and, where its server announces its keys' changes, by what it announces
  (:mod:`kvarena.tiers.redis_feed`: every engine's writes and the server's
  evictions, heard a round trip after them, on a thread of their own);
  listed again every ``rescan_s`` seconds on a background thread where it
  does not (other engines write to it, its server evicts), and every
  ``relist_live_s`` where it does, to repair what went unheard.

A listing of a store a fleet shares runs to millions of names, and the
lister shares the interpreter's lock with the scheduler: one set built from
a million fresh strings holds it ~0.2 s, each set difference ~0.1 s. So the
lister never works on a whole listing in one call: it compares each
listing with its last in slices of :data:`LIST_CHUNK` names, letting the
other threads run between them (no set of the whole listing is built, none
freed in one call), and applies to the book only what changed, slice by
slice under the books' lock. In the background it also rests between
slices, and between its ``SCAN``'s batches, three times as long as each
took (:data:`LIST_DUTY`). (The store's replies are parsed by hiredis:
redis-py's own, in Python, held the lock for every reply it parsed.)

A name listed but gone by load time (evicted by another engine, a disk
pruned by hand) is a failed load, which vLLM recomputes, and the lookups skip
it until it is saved again: a stale answer costs a recompute, never a wrong
token, and never a wait on the step.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence

from ...checks import check_count, check_timeout
from ...tiers import RedisTier
from ...tiers.disk import SUFFIX, object_entries
from ...tiers.duty import DutyCycle
from ...tiers.names import ImageKind, object_name
from ...tiers.redis_feed import FeedLost, StoreFeed, open_feed
from ...tiers.stack import first_members
from .listing import compare, slices
from .ranks import rank_dir
from .settings import ConnectorSettings

log = logging.getLogger("vllm.kvarena")

GONE_KEPT = 1 << 20
"""Names removed from the books that a reader may yet ask about (:meth:`Catalogue.gone`)."""

IMAGES_KEPT = 1 << 16
"""State images' names added to the books that a reader may yet ask about
(:meth:`Catalogue.images`): a waiting request is asked again a step later,
when a step's saves have joined; a reader further behind walks again."""

_STATE = object_name(ImageKind.STATE, b"")  # what every state image's name begins with

RESCAN_S = 10.0
"""How long the lister waits between listings of the shared store: what other
engines saved is found within this long plus a listing (paced,
:data:`LIST_DUTY`: 17 s at a million names on the 2-core development machine
in a slow hour), what its server evicted forgotten within it."""

RELIST_LIVE_S = 300.0
"""How long the lister waits between listings while the store's announcements
are followed: a listing then only repairs what went unheard (a flush on a
server that refuses ``INFO``), so the store is listed a thirtieth as often."""

FEED_WAIT_S = 0.5
"""How long the follower waits for an announcement before it looks up (to stop)."""

TOUCHED_MAX = 1 << 18
"""Names changed by reports or announcements since the last listing that the
next one checks; past this many, the store is listed at once (its book's
memory bounded: ~25 MB of names), not at the period's end."""

LIST_CHUNK = 1024
"""Names the lister handles per call before it hands the interpreter back.
Measured with a store of a million names listed back to back
(``benchmarks/bench_vllm_catalogue.py``, 2-core development machine): a
scheduler step's p99 1.1 ms and max 2.7 ms at 1,024 (at 256 the same, the
listing 20% slower; at 2,048 1.6 and 5.1 ms; in one call per listing, max
0.3 s), against 0.3 and 4 ms with no listing."""

LIST_DUTY = 0.25
"""The share of the time a listing in the background works: between slices the
lister sleeps three times as long as the slice took, so that the scheduler
(and, in one process, the forward's Python between torch's calls) finds the
interpreter free three times in four; the store's ``SCAN`` rests so between
batches too (:meth:`~kvarena.tiers.RedisTier.names`), which spreads the
load each engine's listing puts on a store a fleet shares."""


def _disk_names(directory: str) -> set[str]:
    """The object names a disk tier's directory holds now (no file is opened)."""
    try:
        return {e.name[: -len(SUFFIX)] for e in object_entries(directory)}
    except OSError:
        return set()  # unreadable: the worker's own tier will say so


def _after(log: deque[str], total: int, since: int) -> tuple[list[str] | None, int]:
    """The entries of ``log`` (``total`` ever appended) after the first ``since``,
    None where some of them have left it; and ``total``."""
    new = total - since
    if new > len(log):
        return None, total
    return [log[-k] for k in range(new, 0, -1)], total  # near the end: fast


class Catalogue:
    """Which tier holds each name, as the scheduler can know it without asking."""

    def __init__(
        self,
        settings: ConnectorSettings,
        ranks: int = 1,
        *,
        rescan_s: float = RESCAN_S,
        relist_live_s: float = RELIST_LIVE_S,
        list_chunk: int = LIST_CHUNK,
    ) -> None:
        """``ranks``: the engine's tensor-parallel size (each rank's worker writes
        its disk objects into a directory of its own, :func:`.ranks.rank_dir`);
        ``rescan_s`` and ``relist_live_s``: seconds between listings of the store
        without and with its announcements followed; ``list_chunk``: names the
        lister handles a call (:data:`LIST_CHUNK`)."""
        list_chunk = check_count(list_chunk, "catalogue list_chunk", lo=1)
        rescan_s = check_timeout(rescan_s, "catalogue rescan_s")
        relist_live_s = check_timeout(relist_live_s, "catalogue relist_live_s")
        self.kinds: list[str] = [spec.kind for spec in settings.tiers]
        self._held: dict[str, set[str]] = {kind: set() for kind in self.kinds}
        self._lock = threading.Lock()  # the books as the lister changes them, and the logs
        # names this engine reported putting into or dropping from the store since
        # the listing under way began: newer than it, so it does not decide them
        self._touched: set[str] = set()
        self._chunk = list_chunk
        # the lister's own: every name the last listing held, with its number
        self._seen: dict[str, int] = {}
        self._listings = 0
        self._redis: RedisTier | None = None
        self._stop = threading.Event()
        self._lister: threading.Thread | None = None
        self._follower: threading.Thread | None = None
        self._live = False  # the store's announcements are followed now
        self._list_now = threading.Event()  # the follower subscribed again: list now
        # every name removed from a book, in order, and how many ever were
        self._gone: deque[str] = deque(maxlen=GONE_KEPT)
        self._gone_total = 0
        # every state image's name that joined a book, in order, and how many ever did
        self._images: deque[str] = deque(maxlen=IMAGES_KEPT)
        self._images_total = 0
        for spec in settings.tiers:
            if spec.kind == "disk":
                assert spec.directory is not None
                for r in range(ranks):
                    self._held["disk"] |= _disk_names(rank_dir(spec.directory, r, ranks))
            elif spec.kind == "redis":
                self._redis = spec.open()  # type: ignore[assignment]
                assert self._redis is not None
                # subscribed before the first listing: nothing between the two is missed
                feed, why = (
                    open_feed(self._redis.client, self._redis.prefix)
                    if settings.store_feed == "auto"
                    else (None, "store_feed is 'off'")
                )
                self._live = feed is not None
                if feed is None:
                    why += f"; listing it every {rescan_s:g} s"
                log.info("kvarena: the shared store: %s", why)
                self._relist()
                self._lister = threading.Thread(
                    target=self._list_loop,
                    args=(rescan_s, relist_live_s),
                    name="kvarena-catalogue",
                    daemon=True,
                )
                self._lister.start()
                if settings.store_feed == "auto":
                    self._follower = threading.Thread(
                        target=self._follow,
                        args=(feed, rescan_s),
                        name="kvarena-feed",
                        daemon=True,
                    )
                    self._follower.start()

    # -- fed by the workers' reports -----------------------------------------------
    def hosted(self, added: Iterable[str], dropped: Iterable[str]) -> None:
        """Apply a worker's report of its host tier (puts, then drops)."""
        self.reported("host", added, dropped)

    def reported(self, kind: str, added: Iterable[str], dropped: Iterable[str]) -> None:
        """Apply what a worker did to its tier of ``kind``: names put, then dropped."""
        if kind not in self._held:
            return
        added, dropped = list(added), list(dropped)
        with self._lock:
            book = self._held[kind]
            self._joined(n for n in added if n.startswith(_STATE) and n not in book)
            book.update(added)
            for name in dropped:
                if name in book:
                    book.discard(name)
                    self._forget(name)
            if kind == "redis":
                self._touch(added)
                self._touch(dropped)

    def written(self, names: Iterable[str]) -> None:
        """Names a worker wrote through to every tier below the host."""
        names = list(names)
        for kind in ("disk", "redis"):
            self.reported(kind, names, ())

    def heard(self, changes: Iterable[tuple[str, bool]]) -> None:
        """Apply what the store announced, oldest first: each name and whether it
        holds a value after the change. Like this engine's own reports, a change
        announced while a listing runs is newer than it and wins over it, and
        one announced before is checked against it (a later change that went
        unheard, a ``FLUSHALL``)."""
        book, pace = self._held["redis"], DutyCycle(None)
        for part in slices(list(changes), self._chunk):  # the lock let go between slices
            with self._lock:
                for name, held in part:
                    if held:
                        if name not in book:
                            book.add(name)
                            self._joined((name,))
                    elif name in book:
                        book.discard(name)
                        self._forget(name)
                self._touch(name for name, _ in part)
            pace.rest()

    def _touch(self, names: Iterable[str]) -> None:
        """Keep names the store's book changed by report or announcement, for the
        next listing (under the lock); past :data:`TOUCHED_MAX`, list it now."""
        self._touched.update(names)
        if len(self._touched) > TOUCHED_MAX:
            self._list_now.set()

    def _follow(self, feed: StoreFeed | None, retry_s: float) -> None:
        """The follower's loop: hear the store's announcements and apply them.
        Not subscribed (the server does not announce, or the subscription was
        lost: at once after a loss), it tries again every ``retry_s`` seconds,
        the unfollowed listing's period; subscribed again, it has the store
        listed again (what was announced between went unheard)."""
        assert self._redis is not None
        wait = retry_s
        while not self._stop.is_set():
            if feed is None:
                if self._stop.wait(wait):
                    break
                wait = retry_s
                feed, why = open_feed(self._redis.client, self._redis.prefix)
                if feed is None:
                    continue
                log.warning("kvarena: the shared store: %s from now; listing it again", why)
                self._live = True
                self._list_now.set()
            try:
                changes = feed.changes(FEED_WAIT_S)
            except FeedLost as exc:
                log.warning("kvarena: the shared store's announcements: %s", exc)
                feed.close()
                feed, self._live, wait = None, False, 0.0
                self._list_now.set()  # and at the unfollowed pace until subscribed again
                continue
            if changes:
                self.heard(changes)
        if feed is not None:
            feed.close()

    # -- the shared store's listing --------------------------------------------------
    def _relist(self, duty: float | None = None) -> None:
        """List the store and bring its book to the listing, except for the names
        this engine reported while the listing ran (the reports are newer).
        Names reported before it began are checked against it (a write evicted
        since, a dropped name saved again by another engine)."""
        assert self._redis is not None
        with self._lock:
            before, self._touched = self._touched, set()
        listed = self._redis.names(duty)
        if listed is None:  # unreachable: keep what is known (loads that miss recompute)
            with self._lock:
                self._touched |= before  # still to be checked by a listing
            return
        self._listings += 1
        pace = DutyCycle(duty)
        joined, left = compare(self._seen, self._listings, listed, self._chunk, pace)
        self._apply(joined, [*left, *before], pace)

    def _apply(self, joined: list[str], doubtful: list[str], pace: DutyCycle) -> None:
        """Bring the store's book to the last listing for the names that joined it and the
        ``doubtful`` ones (that left it, or that reports changed before it was
        taken), a slice at a time under the lock; names reported since it began
        are left as the reports made them."""
        book, seen, listing = self._held["redis"], self._seen, self._listings
        for part in slices([*joined, *doubtful], self._chunk):
            with self._lock:
                touched, fresh = self._touched, []
                for name in part:
                    if name in touched:
                        continue
                    if seen.get(name) == listing:
                        if name not in book:
                            book.add(name)
                            fresh.append(name)
                    elif name in book:
                        book.discard(name)
                        self._forget(name)
                self._joined(fresh)
            pace.rest()

    def _forget(self, name: str) -> None:
        """Log a name removed from a book (under the lock)."""
        self._gone.append(name)
        self._gone_total += 1

    def _joined(self, names: Iterable[str]) -> None:
        """Log the state images among names new to a book (under the lock)."""
        for name in names:
            if name.startswith(_STATE):
                self._images.append(name)
                self._images_total += 1

    # The counts only grow, and are read without the lock on a lookup's path: a
    # count read is one a moment old, what a reader gets by asking a moment earlier.
    def images_joined(self) -> int:
        """How many state images' names have joined a book so far."""
        return self._images_total

    def images(self, since: int) -> tuple[list[str] | None, int]:
        """The state images' names that joined any book after the first ``since``
        did (None: more than :data:`IMAGES_KEPT` ago, no longer known), and the
        count to ask from next. What a reader that remembers where it found no
        image needs to forget."""
        if since == self._images_total:
            return [], since
        with self._lock:
            return _after(self._images, self._images_total, since)

    def removals(self) -> int:
        """How many names have been removed from the books so far."""
        return self._gone_total

    def gone(self, since: int) -> tuple[list[str] | None, int]:
        """The names removed from any book after the first ``since`` removals (None:
        more than :data:`GONE_KEPT` ago, no longer known), and the count to ask
        from next. What a reader that remembers answers needs to forget."""
        if since == self._gone_total:
            return [], since
        with self._lock:
            return _after(self._gone, self._gone_total, since)

    def _list_loop(self, every: float, live_every: float) -> None:
        while True:
            self._list_now.wait(live_every if self._live else every)
            self._list_now.clear()
            if self._stop.is_set():
                return
            try:
                self._relist(LIST_DUTY)
            except Exception:  # a fault part way: lookups answer from what is known
                log.exception("kvarena: listing the shared store failed; the next starts over")
                self._start_over()

    def _start_over(self) -> None:
        """After a listing that failed part way (its comparison half done, its
        changes half applied): the lister takes the book as its last listing,
        so the next listing finds every change against what lookups answer."""
        with self._lock:
            self._seen = dict.fromkeys(self._held["redis"], 0)  # no listing's number

    # -- lookups ---------------------------------------------------------------------
    def locate(self, names: Sequence[str]) -> list[int | None]:
        """For each name, the first tier (index in the settings' order) that holds
        it, None where none does: set membership, no I/O."""
        return first_members(names, [self._held[kind] for kind in self.kinds])

    def close(self) -> None:
        self._stop.set()
        self._list_now.set()
        for thread in (self._follower, self._lister):
            if thread is not None:
                thread.join()
        if self._redis is not None:
            self._redis.close()
