"""A worker's writer: a step's gathered saves, checksummed and written through
every tier on one background thread.

A save never waits for a disk or a network: the step only gathers its bytes
into a host buffer (:meth:`~.tensors.CachePages.gather`) and queues them here.
What waits is bounded (``backlog`` bytes): a step's saves that would pass the
bound are skipped before anything is gathered (:meth:`SaveQueue.admit`), so a
writer slower than the forward costs misses later, never host memory. Every
object is written through to every tier, so a restarted engine finds it on
disk and another engine in the store.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ...tiers import ImageKind, TierObject, TierStack
from ...tiers.base import IndexedTier
from ...tiers.checked import Expectations
from ...tiers.names import object_name
from .ranks import own_copy
from .records import BlockCopy, Held, News, Timed
from .tensors import CachePages

log = logging.getLogger("vllm.kvarena")


@dataclass(frozen=True, kw_only=True)
class Save:
    """One object to write: its kind, this rank's copy (key, index, a partial
    block's tokens), its gathered payload (ready once ``ready``, a CUDA event,
    has passed), and its prefix object's name (what the scheduler knows it by)."""

    kind: ImageKind
    copy: BlockCopy
    payload: memoryview
    prefix: str
    ready: torch.cuda.Event | None = None  # on CUDA: when ``payload`` holds the bytes


def gathered(
    pages: CachePages, kind: ImageKind, copies: Sequence[BlockCopy], *, rank: int, ranks: int
) -> list[Save]:
    """The planned objects' bytes, one batch per storage into one host buffer
    (:meth:`~.tensors.CachePages.gather`), as rank ``rank``'s objects, each with
    its prefix object's name (what the scheduler knows it by)."""
    word = "kv" if kind is ImageKind.KV_BLOCK else "state"
    host, ready = pages.gather(word, [c.blocks for c in copies])
    stage = memoryview(host.numpy())  # type: ignore[arg-type]
    size = pages.payload[word]
    return [
        Save(
            kind=kind,
            copy=own_copy(c, rank, ranks),
            payload=stage[j * size : (j + 1) * size],
            prefix=object_name(kind, c.key),
            ready=ready,
        )
        for j, c in enumerate(copies)
    ]


@dataclass(frozen=True, kw_only=True)
class _Batch:
    saves: list[Save]
    nbytes: int  # payload bytes reserved in the backlog


def _refused(
    refused: Mapping[str, Sequence[str]], objects: Sequence[TierObject], saves: Sequence[Save]
) -> list[tuple[str, str, str]]:
    """Each name a tier refused, with the tier's label and its save's prefix
    (most batches have none: the name → prefix map is made only for those)."""
    if not any(refused.values()):
        return []
    prefix_of = {o.name: s.prefix for o, s in zip(objects, saves, strict=True)}
    return [(label, name, prefix_of[name]) for label, names in refused.items() for name in names]


class SaveQueue:
    """What a worker gathered and the tiers do not hold yet, and the thread that
    writes it."""

    def __init__(
        self, *, tiers: TierStack, expect: Expectations, rank: int, news: News, backlog: int
    ) -> None:
        """``news``: where what was written is reported; ``backlog``: the most
        payload bytes gathered and not yet written."""
        self.tiers, self.expect, self.rank, self.news = tiers, expect, rank, news
        self.limit = backlog
        self._lock = threading.Lock()  # guards the counts below
        self.backlog = 0  # payload bytes gathered, not yet in the tiers
        self._waiting = 0  # objects gathered, not yet in the tiers
        self._drained = threading.Condition(self._lock)  # _waiting fell to 0
        self.objects_saved = 0
        self.saves_skipped = 0  # objects not saved because the backlog was full
        self._skipping = False  # in a run of skipped steps (one warning a run)
        self._jobs: queue.Queue[_Batch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvarena-save", daemon=True)
        self._thread.start()

    def admit(self, nbytes: int, names: list[str]) -> bool:
        """Reserve ``nbytes`` for a step's saves (the prefix objects ``names``), or
        refuse them whole (reported skipped) where they would pass the bound."""
        with self._lock:
            waiting = self.backlog
            full = waiting + nbytes > self.limit
            if not full:
                self.backlog += nbytes
        if not full:
            self._skipping = False
            return True
        # Skipped whole, before any copy: a lookup finds none of it (the
        # scheduler learns of an object only once a tier holds it).
        self.saves_skipped += len(names)
        self.news.add(skipped=names)
        if not self._skipping:
            log.warning(
                "kvarena: saves skipped: %d bytes wait for the tiers and %d more would "
                "pass save_backlog (%d); the tiers are slower than the forward",
                waiting,
                nbytes,
                self.limit,
            )
        self._skipping = True
        return False

    def submit(self, saves: list[Save], nbytes: int) -> None:
        """Queue an admitted step's saves."""
        with self._lock:
            self._waiting += len(saves)
        self._jobs.put(_Batch(saves=saves, nbytes=nbytes))

    def _loop(self) -> None:
        while True:
            batch = self._jobs.get()
            try:
                if batch is None:
                    return
                self._write(batch)
            except Exception:  # a failed save is a future miss, never a failed request
                log.exception("kvarena: a save failed")
            finally:
                if batch is not None:
                    with self._lock:
                        self.backlog -= batch.nbytes
                        self._waiting -= len(batch.saves)
                        self._drained.notify_all()
                self._jobs.task_done()

    def _write(self, batch: _Batch) -> None:
        saves = batch.saves
        for event in {id(s.ready): s.ready for s in saves if s.ready is not None}.values():
            event.synchronize()  # the side stream's copy into pinned memory has landed
        objects = [
            self.expect.encode(s.kind, s.copy.key, s.copy.index, [s.payload], s.copy.tokens)
            for s in saves
        ]
        written = self.tiers.write_through(objects)
        names = [o.name for o in objects]
        tiers = list(zip(self.tiers.labels, self.tiers.tiers, strict=True))
        hosted = [label for label, t in tiers if t.kind == "host"]
        timed = Timed(
            key=saves[0].prefix, rank=self.rank, seconds=written.seconds, nbytes=written.nbytes
        )
        held = [
            Held(rank=self.rank, label=label, nbytes=t.used_bytes, objects=len(t))
            for label, t in tiers
            if isinstance(t, IndexedTier)  # known here; a shared store's is the server's
        ]
        for label in hosted:  # the host tier's evictions come back as names alone
            self.news.add(host_added=names, host_dropped=written.evicted.get(label, []))
        self.news.add(
            saved=[s.prefix for s in saves],
            writes=[timed],
            held=held,
            written=names,
            # applied after ``written`` and ``host_added``: a refused name is not held
            refused=_refused(written.refused, objects, saves),
            dropped=[
                (label, name)
                for label, gone in written.evicted.items()
                if label not in hosted
                for name in gone
            ],
        )
        self.objects_saved += len(objects)

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every queued save is in the tiers, or ``timeout`` seconds;
        the objects still waiting (0: all written)."""
        with self._drained:
            self._drained.wait_for(lambda: self._waiting == 0, timeout)
            return self._waiting

    def close(self, timeout: float) -> int:
        """Write what is queued (at most ``timeout`` seconds), then stop the
        writer; the objects that could not be written (each a later miss),
        logged as an error, never dropped silently. The tiers are the caller's
        to close, once this returns 0 (else the writer may still be in one)."""
        with self._lock:
            waiting = self._waiting
        left = self.flush(timeout)
        if waiting:
            log.info("kvarena: shutdown: %d queued saves written", waiting - left)
        if left:
            log.error(
                "kvarena: shutdown: %d saves not written within %.0f s (the tiers are "
                "slower than the engine stopping): they are lost, later misses",
                left,
                timeout,
            )
            return left
        self._jobs.put(None)
        self._thread.join()
        return 0
