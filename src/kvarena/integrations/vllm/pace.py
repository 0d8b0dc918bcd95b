"""Whether a load is done inside the step that asks for it, from what is measured.

A load vLLM waits for asynchronously costs its request at least one whole
step: the request is scheduled only after the load is reported done, and the
I/O thread that fetches it shares the cores with the engine's own. A load
done in the step that asks for it (vLLM's synchronous path: copied before
that step's forward) costs that step its copy time instead — every request
of the batch waits for it. So:

- while other requests are running, a step's loads are done in it where
  their copies together take at most :data:`STEP_SHARE` of a step: the
  batch's inter-token latency grows by at most that share;
- while none is (the engine idle but for the requests arriving now), where
  they take at most what an asynchronous load has taken from its lookup to
  its word of done: no request decoding waits, and the arriving request is
  served sooner than the other way would serve it.

Loads fetched off the step land (are copied into vLLM's blocks and reported
done) under the same budget: a step copies in at most what is left of its
share after its own in-step loads, at the landing copies' measured bandwidth
(:meth:`LoadPace.land_bytes`), the first always. A store that answers many
loads at once (a stalled one coming back) then hands its requests to vLLM a
few a step, as they would have come, not all of them into one long step.

Every side is measured as the engine runs, never assumed: the step, as the
median time between consecutive busy steps (a step continuing requests of
the step before, so the time between them was work, not waiting for it);
the copy, as a line in bytes (a fixed cost and a bandwidth) fitted to the
host tier's loads the workers report (fetch, checks and copy into vLLM's
blocks, timed whole); a landing, as a line fitted the same way to the
workers' copies of fetched loads; the asynchronous way, as the median wait
of those loads. Until what a rule needs is known, loads go the asynchronous
way, and land one a step.
"""

from __future__ import annotations

import statistics
from collections import deque

STEP_SHARE = 0.1
"""The share of a step the loads done inside it may take while other requests
run: the inter-token latency goal (at most 1.1x with loads) read per step."""

KEPT = 64
"""Steps, loads and waits the estimates are taken over."""

IDLE_S = 1.0
"""An interval longer than this is the engine waiting for work, not a step."""

LOADS_IN_FLIGHT = 64
"""Loads at most not yet reported done, per engine: past it a lookup that would
hit answers "ask again" (vLLM keeps the request waiting and asks next step)
rather than promise a load that would wait behind the others."""


def copy_line(loads: list[tuple[int, float]]) -> tuple[float, float]:
    """``(fixed seconds, seconds per byte)`` of loads ``(bytes, seconds)``: Tukey's
    resistant line (the slope between the medians of the smallest and the
    largest third, the fixed cost the median residual), so one load that met
    a slow moment does not tilt it; where every load had one size, the
    seconds per byte of their median."""
    pts = sorted(loads)
    third = max(1, len(pts) // 3)
    lo, hi = pts[:third], pts[-third:]
    x_lo, x_hi = statistics.median(p[0] for p in lo), statistics.median(p[0] for p in hi)
    if x_hi <= x_lo:
        return 0.0, statistics.median(t for _, t in pts) / statistics.median(n for n, _ in pts)
    slope = (statistics.median(p[1] for p in hi) - statistics.median(p[1] for p in lo)) / (
        x_hi - x_lo
    )
    slope = max(slope, 0.0)
    return max(statistics.median(t - slope * n for n, t in pts), 0.0), slope


class _Copies:
    """One rank's recent copies as ``(bytes, seconds)``, and the line fitted to
    them (:func:`copy_line`, fitted when asked after a new one came)."""

    def __init__(self) -> None:
        self._kept: deque[tuple[int, float]] = deque(maxlen=KEPT)
        self._line: tuple[float, float] | None = None  # None: stale

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._kept.append((nbytes, seconds))
            self._line = None

    def line(self) -> tuple[float, float] | None:
        """``(fixed seconds, seconds per byte)``, None while nothing is measured."""
        if self._line is None and self._kept:
            self._line = copy_line(list(self._kept))
        return self._line


class LoadPace:
    """The engine's step time, the host tier's copy time and the asynchronous
    loads' wait, as measured; and this step's in-step copy time so far."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._steps: deque[float] = deque(maxlen=KEPT)
        self._loads = _Copies()  # host-tier loads done in the step, timed whole
        self._lands = _Copies()  # fetched loads' copies into vLLM's blocks
        self._waits: deque[float] = deque(maxlen=KEPT)
        # the medians of _steps and _waits, None: stale (a lookup asks them, a step adds)
        self._step_s: float | None = None
        self._wait_s: float | None = None
        self._spent = 0.0  # predicted copy seconds of the loads put in this step

    def stepped(self, now: float, *, busy: bool) -> None:
        """A step was scheduled at ``now`` (monotonic seconds); ``busy``: it
        continues requests the step before scheduled."""
        if busy and self._last is not None and 0 < now - self._last <= IDLE_S:
            self._steps.append(now - self._last)
            self._step_s = None
        self._last = now
        self._spent = 0.0

    def loaded(self, nbytes: int, seconds: float) -> None:
        """One rank's load from the host tier took ``seconds`` for ``nbytes``."""
        self._loads.add(nbytes, seconds)

    def landed(self, nbytes: int, seconds: float) -> None:
        """One rank copied a fetched load of ``nbytes`` into vLLM's blocks in ``seconds``."""
        self._lands.add(nbytes, seconds)

    def waited(self, seconds: float) -> None:
        """An asynchronous load was reported done ``seconds`` after its lookup."""
        if seconds > 0:
            self._waits.append(seconds)
            self._wait_s = None

    def step_s(self) -> float | None:
        if self._step_s is None and self._steps:
            self._step_s = statistics.median(self._steps)
        return self._step_s

    def wait_s(self) -> float | None:
        if self._wait_s is None and self._waits:
            self._wait_s = statistics.median(self._waits)
        return self._wait_s

    def copy_s(self, nbytes: int) -> float | None:
        """The predicted seconds of one rank's host load of ``nbytes``."""
        line = self._loads.line()
        if line is None:
            return None
        fixed, per_byte = line
        return fixed + per_byte * nbytes

    def budget(self, *, idle: bool) -> float | None:
        """The copy seconds a step may take for loads done in it: a share of a
        step while others run; while none does, the asynchronous way's wait
        too (whichever is longer)."""
        step = self.step_s()
        share = STEP_SHARE * step if step is not None else None
        if not idle:
            return share
        known = [x for x in (share, self.wait_s()) if x is not None]
        return max(known) if known else None

    def fits(self, nbytes: int, *, idle: bool) -> float | None:
        """The predicted copy seconds of a load of ``nbytes`` where it fits what is
        left of this step's budget, else None (it goes the asynchronous way)."""
        cost, budget = self.copy_s(nbytes), self.budget(idle=idle)
        if cost is None or budget is None or self._spent + cost > budget:
            return None
        return cost

    def spend(self, seconds: float) -> None:
        """A load of predicted ``seconds`` was put in this step."""
        self._spent += seconds

    def land_bytes(self, *, idle: bool) -> int | None:
        """The bytes of fetched loads one rank may copy in this step: what is left
        of the step's budget after the loads put in it, at the landings' measured
        cost (one fixed cost, then their bandwidth). Until both are measured, 0:
        one load a step (the first of a burst is what measures them); None where
        the copies cost nothing per byte (no bound)."""
        budget, line = self.budget(idle=idle), self._lands.line()
        if budget is None or line is None:
            return 0
        fixed, per_byte = line
        if per_byte <= 0:
            return None
        return max(int((budget - self._spent - fixed) / per_byte), 0)
