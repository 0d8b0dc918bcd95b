"""What the connector did, counted once for the whole engine.

An operator reads one number per thing whatever the tensor-parallel size: a
prefix object is one object though every rank saves its shard of it, a load
is one load though every rank reads its part. So workers report their parts
(:class:`~.records.WorkerReport`) and the scheduler counts here, in the one
process that sees every rank:

- bytes add up over ranks (each rank moves its own shard: the sum is what
  moved);
- a load's or a write's seconds are its slowest rank's (the step waits for
  that one), observed once every rank has reported its part;
- an object is saved when every rank saved its shard, skipped when any rank
  skipped it, failed (with why) when any rank could not use its shard;
- what the tiers hold is the sum of every rank's latest report.

:meth:`Telemetry.take` hands the counts since the last call to vLLM's
connector stats (:mod:`.metrics`), which puts them on ``/metrics``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .records import Timed, WorkerReport

PENDING = 4096
"""Parts awaited at most (loads, writes and objects some rank has not reported
yet); past it the oldest is counted as it stands (a rank that never reports
must not grow the scheduler's memory)."""

FAILURE_ORDER = ("corrupt", "error", "foreign", "timeout", "missing")
"""Every reason a rank gives for a prefix object a load could not use
(:attr:`~.records.Timed.failures`), the one a failure counts under first when
ranks disagree: a corrupt shard is what an operator must hear about, even if
another rank's was only missing; a fetch that raised (``error``) is a defect
to report; a load past its deadline (``timeout``) is given up on every rank
that had not fetched it."""


class _Part:
    """One load's or write's parts so far: the ranks heard, the slowest seconds
    by tier label, the failures by prefix object."""

    def __init__(self) -> None:
        self.ranks: set[int] = set()
        self.seconds: dict[str, float] = {}
        self.failures: dict[str, str] = {}

    def add(self, t: Timed) -> None:
        self.ranks.add(t.rank)
        for label, sec in t.seconds.items():
            self.seconds[label] = max(sec, self.seconds.get(label, 0.0))
        for name, why in t.failures.items():
            was = self.failures.get(name)
            if was is None or FAILURE_ORDER.index(why) < FAILURE_ORDER.index(was):
                self.failures[name] = why


class Telemetry:
    """The scheduler's book of the connector's counts (see the module text)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._counts: dict[str, Any] = {}
        self._pending: OrderedDict[tuple[str, str], _Part] = OrderedDict()
        # shards saved so far by prefix object (the scheduler plans each save
        # once, so every rank reports each name once)
        self._objects: OrderedDict[str, int] = OrderedDict()
        self._skipped: OrderedDict[str, None] = OrderedDict()  # counted once already
        self._held: dict[tuple[int, str], tuple[int, int]] = {}
        self._held_changed = False
        # totals since start, for tests and benchmarks that read them directly
        self.lookups = 0
        self.hit_tokens = 0
        self.hit_tokens_by_tier: dict[str, int] = {}

    # -- the scheduler's own counts -----------------------------------------------
    def _add(self, key: str, n: int | float, label: str | None = None) -> None:
        if label is None:
            self._counts[key] = self._counts.get(key, 0) + n
        else:
            book = self._counts.setdefault(key, {})
            book[label] = book.get(label, 0) + n

    def looked_up(self) -> None:
        self.lookups += 1
        self._add("lookups", 1)

    def hit(self, tier: str, tokens: int) -> None:
        """``tokens`` promised to a request, by the deepest tier its load reads."""
        self.hit_tokens += tokens
        self.hit_tokens_by_tier[tier] = self.hit_tokens_by_tier.get(tier, 0) + tokens
        self._add("hit_tokens", tokens, tier)

    # -- the workers' parts -------------------------------------------------------
    def reported(self, report: WorkerReport) -> list[str]:
        """Count a report's parts; the prefix objects every rank has now saved."""
        completed: list[str] = []
        for kind, parts in (("load", report.loads), ("save", report.writes)):
            for t in parts:
                for label, n in t.nbytes.items():
                    self._add(f"{kind}_bytes", n, label)
                part = self._pending.setdefault((kind, t.key), _Part())
                part.add(t)
                if len(part.ranks) >= self.ranks:
                    self._observe(kind, self._pending.pop((kind, t.key)))
        for name in report.saved:
            shards = self._objects.get(name, 0) + 1
            if shards >= self.ranks:
                self._objects.pop(name, None)
                self._add("objects_saved", 1)
                completed.append(name)
            else:
                self._objects[name] = shards
        for name in report.skipped:
            if name not in self._skipped:
                self._skipped[name] = None
                self._add("saves_skipped", 1)
        for h in report.held:
            self._held[(h.rank, h.label)] = (h.nbytes, h.objects)
            self._held_changed = True
        self._bound()
        return completed

    def _observe(self, kind: str, part: _Part) -> None:
        for label, sec in part.seconds.items():
            self._counts.setdefault(f"{kind}_seconds", {}).setdefault(label, []).append(sec)
        for why in part.failures.values():
            self._add("load_failures", 1, why)

    def _bound(self) -> None:
        while len(self._pending) > PENDING:
            (kind, _), part = self._pending.popitem(last=False)
            self._observe(kind, part)
        while len(self._objects) > PENDING:
            self._objects.popitem(last=False)
        while len(self._skipped) > PENDING:
            self._skipped.popitem(last=False)

    # -- handing over ---------------------------------------------------------------
    def take(self) -> dict[str, Any]:
        """The counts since the last call (empty if nothing happened): what
        :class:`~.metrics.KvarenaStats` carries to vLLM's stats loggers."""
        out, self._counts = self._counts, {}
        if self._held_changed:
            held_bytes: dict[str, int] = {}
            held_objects: dict[str, int] = {}
            for (_, label), (nbytes, objects) in self._held.items():
                held_bytes[label] = held_bytes.get(label, 0) + nbytes
                held_objects[label] = held_objects.get(label, 0) + objects
            out["held_bytes"], out["held_objects"] = held_bytes, held_objects
            self._held_changed = False
        return out
