"""Tiers in order, and the spec strings that name them.

The stack is consulted in order on a device miss (the first tier holding an
object serves it) and written at its top: the device's evictions go to the
first tier, whose evictions go to the next, and so on down. Objects stay in
a tier when they are promoted to the device (the tiers are inclusive), so a
block evicted again costs nothing where it is still held.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from ..errors import InvalidValueError
from ..locking import synchronized
from .base import Tier
from .frames import DEFAULT_FRAME_BYTES
from .image import TierObject
from .spec import TierSpec


def first_holders(
    names: Sequence[str], probes: Sequence[Callable[[list[str]], list[bool]]]
) -> list[int | None]:
    """For each name, the index of the first probe that says it holds it (None:
    none does); each probe asked once, in order, over the names still unplaced.
    The tier walk of a :class:`TierStack` and of an engine's catalogue alike."""
    where: list[int | None] = [None] * len(names)
    left = list(range(len(names)))
    for i, probe in enumerate(probes):
        if not left:
            break
        found = probe([names[j] for j in left])
        rest = []
        for j, hit in zip(left, found, strict=True):
            if hit:
                where[j] = i
            else:
                rest.append(j)
        left = rest
    return where


def first_members(names: Sequence[str], books: Sequence[Container[str]]) -> list[int | None]:
    """:func:`first_holders` over books held in memory (a set or dict of names per
    tier), asked name by name: no probe to call and no list of the names left
    between tiers, where a scheduler's lookup asks a few names at a time."""
    where: list[int | None] = []
    add = where.append
    for name in names:
        for i, book in enumerate(books):
            if name in book:
                add(i)
                break
        else:
            add(None)
    return where


def parse_tier(
    spec: str | TierSpec, *, frame_bytes: int = DEFAULT_FRAME_BYTES, pin_memory: bool = False
) -> Tier:
    """A tier from its spec (the CLI's ``--tier``); opens it."""
    return TierSpec.parse(spec).open(frame_bytes=frame_bytes, pin_memory=pin_memory)


@dataclass(frozen=True, kw_only=True)
class Written:
    """What :meth:`TierStack.write_through` did, by tier label: the names each
    tier evicted to make room and those it did not store (:class:`~.base.Put`),
    the seconds its write took, the bytes it stored."""

    evicted: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, list[str]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)


def tier_labels(kinds: Sequence[str]) -> list[str]:
    """Each tier's label, top first: its kind, numbered from the second of a
    kind on (``host``, ``disk``, ``disk2``). A tier is the object, its level its
    index in the stack, its label what logs, reports, metrics and events say."""
    out: list[str] = []
    for kind in kinds:
        label, n = kind, 2
        while label in out:
            label, n = f"{kind}{n}", n + 1
        out.append(label)
    return out


class TierStack:
    """Tiers consulted in order; written at the top, evictions flowing down."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        tiers = list(tiers)
        for t in tiers:
            if not isinstance(t, Tier):
                raise InvalidValueError(f"a tier stack holds Tier objects, got {t!r}")
        self.tiers = tiers
        self.labels = tier_labels([t.kind for t in tiers])
        # Wall time spent in each tier (probe, fetch, write-back), for reports.
        self.seconds = [0.0] * len(tiers)
        self._lock = threading.RLock()  # see kvarena.locking

    @classmethod
    def from_specs(
        cls,
        specs: Sequence[str | TierSpec],
        *,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        pin_memory: bool = False,
    ) -> TierStack:
        """Tiers opened from spec strings, in order; if one fails, those already
        opened are closed again and the error names the spec."""
        if isinstance(specs, str):
            raise InvalidValueError(f"tier specs must be a list of strings, got {specs!r}")
        opened: list[Tier] = []
        try:
            for spec in specs:
                opened.append(parse_tier(spec, frame_bytes=frame_bytes, pin_memory=pin_memory))
        except BaseException:
            for t in opened:
                t.close()
            raise
        return cls(opened)

    def __len__(self) -> int:
        return len(self.tiers)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    @synchronized
    def locate(self, names: Sequence[str]) -> list[int | None]:
        """For each name, the index of the first tier holding it (None: nowhere);
        one batched call per tier, over the names still unplaced."""

        def timed(i: int, asked: list[str]) -> list[bool]:
            start = time.perf_counter()
            try:
                return self.tiers[i].contains_many(asked)
            finally:
                self.seconds[i] += time.perf_counter() - start

        return first_holders(names, [functools.partial(timed, i) for i in range(len(self.tiers))])

    def fetch(
        self, level: int, names: Sequence[str]
    ) -> list[bytes | bytearray | memoryview | None]:
        """The tier at ``level``'s copies of ``names``. Like :meth:`write_through`,
        it holds the stack's lock for its timing alone, not across the tier's I/O
        (each tier locks itself): a load stuck on a disk or a store off the
        engine's step must not stall the writer, nor a load from another tier."""
        start = time.perf_counter()
        try:
            return self.tiers[level].get_many(names)
        finally:
            with self._lock:
                self.seconds[level] += time.perf_counter() - start

    def drop(self, level: int, names: Sequence[str]) -> None:
        self.tiers[level].delete_many(names)

    @synchronized
    def write_back(self, objects: Sequence[TierObject]) -> None:
        """Store objects at the top; each tier's evictions go to the next one down."""
        batch = list(objects)
        for i, tier in enumerate(self.tiers):
            if not batch:
                break
            start = time.perf_counter()
            below = i + 1 < len(self.tiers) and tier.cascades
            evicted = tier.put_many(batch, want_evicted=below).evicted
            self.seconds[i] += time.perf_counter() - start
            batch = evicted if below else []  # (names alone otherwise: nothing goes down)

    def write_through(self, objects: Sequence[TierObject]) -> Written:
        """Store every object in every tier, top first (a restarted engine finds
        on disk, another engine in the shared store, what this one computed,
        without waiting for an eviction); nothing evicted goes down, since every
        tier below has it already. Returns what each tier evicted, took and wrote.

        Unlike the other calls it does not hold the stack's lock across the
        tiers' I/O (each tier locks itself): a background writer must never make
        a load on the engine's step wait for a whole disk or network write."""
        batch = list(objects)
        out = Written()
        for i, tier in enumerate(self.tiers):
            if not batch:
                break
            start = time.perf_counter()
            batch = tier.stored(batch)  # sealed once for the first tier that needs it
            put = tier.put_many(batch, want_evicted=False)
            took = time.perf_counter() - start
            with self._lock:
                self.seconds[i] += took
            label = self.labels[i]
            out.evicted[label] = [o.name for o in put.evicted]
            out.refused[label] = put.refused
            out.seconds[label] = took
            refused = set(put.refused)
            out.nbytes[label] = sum(o.stored_bytes for o in batch if o.name not in refused)
        return out

    @synchronized
    def close(self) -> None:
        for t in self.tiers:
            t.close()

    @synchronized
    def report(self) -> list[dict[str, object]]:
        return [
            {
                "tier": name,
                "where": t.describe(),
                "objects": len(t),
                "used_bytes": t.used_bytes,
                "capacity_bytes": t.capacity_bytes,
                "disabled": t.disabled,
                "seconds": round(sec, 6),
                **t.metrics.to_dict(),
            }
            for name, t, sec in zip(self.labels, self.tiers, self.seconds, strict=True)
        ]
