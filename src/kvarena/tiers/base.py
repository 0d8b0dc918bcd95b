"""The interface every tier below the device speaks, and the books they share.

A tier stores named, opaque objects (images, see :mod:`.image`): batched
put/get/contains/delete, a capacity in bytes and least-recently-used eviction.
A put that needs room evicts the oldest objects and hands them back, so the
stack above can write them to the next tier down (host -> disk -> shared
store). Nothing here interprets the bytes: checking what comes back is the
loader's job, with the image's header.

Tiers fail like the things they stand on — a disk fills up, a store goes
away — and serving must go on: an I/O failure is a miss (get/contains) or a
dropped write (put), counted, with ONE warning until the tier works again; a
full disk disables the tier's writes with a message, and reads go on.
"""

from __future__ import annotations

import abc
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..errors import Error
from ..locking import synchronized
from .image import TierObject, seal


class TierError(Error, RuntimeError):
    """A tier that cannot be opened or used as asked (bad directory, unreachable URL)."""


class TierWarning(UserWarning):
    """A tier failed mid-run; serving goes on (lookups miss, writes are dropped)."""


@dataclass(kw_only=True)
class TierMetrics:
    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    get_bytes: int = 0
    hits: int = 0  # gets that found the object
    misses: int = 0
    deletes: int = 0
    evictions: int = 0  # objects evicted for room (handed to the next tier down)
    skipped: int = 0  # puts not taken: too large, already held, or writes disabled
    failures: int = 0  # I/O errors survived (each a miss or a dropped write)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Put:
    """What a put did, for its caller to apply: the objects it evicted to make
    room, oldest first (for the next tier down), and the names of the objects
    it did not store (larger than the tier, its writes disabled, a write or a
    server that failed). A caller that keeps a book of what a tier holds
    learns a name only where the tier took it: a book that believed a refused
    write would promise loads that can only fail."""

    evicted: list[TierObject] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


class Tier(abc.ABC):
    """One storage level: named objects, a byte capacity, LRU."""

    kind: str = "tier"

    def __init__(self) -> None:
        self.metrics = TierMetrics()
        self.disabled: str | None = None  # why writes stopped, if they did
        self._warned = False
        self._lock = threading.RLock()  # one per tier: see kvarena.locking

    # -- the interface -------------------------------------------------------------
    @abc.abstractmethod
    def put_many(self, objects: Sequence[TierObject], *, want_evicted: bool = True) -> Put:
        """Store each object (an existing name is refreshed, not rewritten); return
        the objects evicted to make room, oldest first, for the next tier down,
        and the names not stored. With ``want_evicted`` False nothing below
        takes the evicted, so none is read back: they come as names and
        logical sizes alone (no parts), for a caller that keeps a book of what
        the tier holds."""

    @abc.abstractmethod
    def get_many(self, names: Sequence[str]) -> list[bytes | bytearray | memoryview | None]:
        """Each object's stored bytes, or None; a hit refreshes it in the LRU."""

    @abc.abstractmethod
    def contains_many(self, names: Sequence[str]) -> list[bool]:
        """Whether each object is held now (touches nothing)."""

    @abc.abstractmethod
    def delete_many(self, names: Sequence[str]) -> int:
        """Delete each object held; the count deleted."""

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """The logical bytes this tier holds at most (0: the server decides)."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Logical bytes held now."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def describe(self) -> str:
        """One line: the kind and where (``disk /var/cache/kv, 64 GiB``)."""

    def close(self) -> None:  # noqa: B027 (a no-op unless the tier holds something open)
        """Release what the tier holds open (files, sockets); objects stay where durable."""

    @property
    def trusted(self) -> bool:
        """Whether this tier's bytes live in this process's own memory, where
        nothing else can change them: its objects are loaded without
        recomputing checksums (and may be held unsealed)."""
        return False

    def stored(self, objects: Sequence[TierObject]) -> list[TierObject]:
        """The objects as this tier keeps them: the seal rule, owned here. A tier
        outside this process's memory takes only sealed objects (anyone can
        change a file or a store's value); sealing is idempotent, so an object
        sealed for one such tier passes the next as it is."""
        return list(objects) if self.trusted else [seal(o) for o in objects]

    @property
    def cascades(self) -> bool:
        """Whether this tier's evictions should go to the next tier down (a shared
        store evicts on its server and cannot hand anything back)."""
        return True

    # -- failure handling shared by every tier ------------------------------------
    def _failed(self, op: str, exc: BaseException) -> None:
        self.metrics.failures += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                TierWarning(
                    f"{self.describe()}: {op} failed ({type(exc).__name__}: {exc}); "
                    "lookups miss and serving continues (warned once until it recovers)"
                ),
                stacklevel=3,
            )

    def _worked(self) -> None:
        self._warned = False

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            warnings.warn(
                TierWarning(f"{self.describe()}: writes disabled: {why}; serving continues"),
                stacklevel=3,
            )


class IndexedTier(Tier):
    """A tier that keeps its own index: name -> logical bytes, in LRU order."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        self._capacity = capacity_bytes
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    @synchronized
    def used_bytes(self) -> int:
        return self._used

    @synchronized
    def __len__(self) -> int:
        return len(self._index)

    @synchronized
    def contains_many(self, names: Sequence[str]) -> list[bool]:
        index = self._index
        return [n in index for n in names]

    @synchronized
    def names(self) -> list[str]:
        """Held objects, least recently used first."""
        return list(self._index)

    def _refused(self, objects: Sequence[TierObject], evicted: Sequence[TierObject]) -> list[str]:
        """The names of ``objects`` a put just made (under the tier's lock) left
        unheld: not in the index, and not among those it evicted again (a batch
        larger than the room evicts its own first members: those are evictions)."""
        gone = {o.name for o in evicted}
        index = self._index
        return [o.name for o in objects if o.name not in index and o.name not in gone]

    def _admit(self, obj: TierObject) -> bool:
        """Whether ``obj`` should be written: not held already (held: refreshed),
        not larger than the whole tier, writes not disabled."""
        if obj.name in self._index:
            self._index.move_to_end(obj.name)
            self.metrics.skipped += 1
            return False
        if obj.logical_bytes > self._capacity or self.disabled is not None:
            self.metrics.skipped += 1
            return False
        return True

    def _victims(self, need: int) -> list[str]:
        """The oldest names whose removal leaves ``need`` logical bytes of room."""
        room = self._capacity - self._used
        out = []
        for name, size in self._index.items():
            if room >= need:
                break
            out.append(name)
            room += size
        return out

    def _added(self, name: str, logical: int) -> None:
        self._index[name] = logical
        self._used += logical
        self.metrics.puts += 1
        self.metrics.put_bytes += logical

    def _removed(self, name: str) -> None:
        self._used -= self._index.pop(name)

    def _hit(self, name: str) -> None:
        # what a get moves is counted as puts are, by logical size: an elided
        # image (a bookkeeping replay) weighs the payload its header declares
        self._index.move_to_end(name)
        self.metrics.hits += 1
        self.metrics.get_bytes += self._index[name]

    @abc.abstractmethod
    def _fetch(self, name: str) -> bytes | memoryview | None:
        """One held object's bytes (a copy the caller owns), None if it vanished."""

    @abc.abstractmethod
    def _drop(self, name: str) -> None:
        """Forget one held object and free its room."""

    @synchronized
    def get_many(self, names: Sequence[str]) -> list[bytes | bytearray | memoryview | None]:
        out: list[bytes | bytearray | memoryview | None] = []
        for name in names:
            self.metrics.gets += 1
            data = self._fetch(name) if name in self._index else None
            if data is None:
                if name in self._index:  # removed behind our back: forget it
                    self._removed(name)
                self.metrics.misses += 1
            else:
                self._hit(name)
            out.append(data)
        return out

    @synchronized
    def delete_many(self, names: Sequence[str]) -> int:
        n = 0
        for name in names:
            if name in self._index:
                self._drop(name)
                n += 1
        self.metrics.deletes += n
        return n
