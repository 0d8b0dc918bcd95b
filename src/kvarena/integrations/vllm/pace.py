"""Whether a load is done inside the step that asks for it, from what is measured.

A load vLLM waits for asynchronously costs its request one whole step: the
request is scheduled only after the load is reported done. A load done in the
step that asks for it (vLLM's synchronous path: copied before that step's
forward) costs that step its copy time instead — every request of the batch
waits for it. So a load is done in the step where its copy takes at most
:data:`STEP_SHARE` of a step: the batch's inter-token latency grows by at most
that share, and the request saves a step.

Both sides are measured as the engine runs, never assumed: the step, as the
median time between the scheduler's last :data:`KEPT` steps; the copy, as the
bytes per second of the host tier's loads the workers report (fetch, checks
and copy into vLLM's blocks). Until both are known, every load goes the
asynchronous way.
"""

from __future__ import annotations

import statistics
from collections import deque

STEP_SHARE = 0.1
"""The share of a step a load done inside it may take: the inter-token latency
goal (at most 1.1x with loads) read as a bound per step."""

KEPT = 64
"""Step intervals and loads the medians are taken over."""

IDLE_S = 1.0
"""An interval longer than this is the engine waiting for work, not a step."""


class LoadPace:
    """The engine's step time and the host tier's load rate, as measured."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._steps: deque[float] = deque(maxlen=KEPT)
        self._rates: deque[float] = deque(maxlen=KEPT)  # bytes per second, one rank

    def stepped(self, now: float) -> None:
        """A step was scheduled at ``now`` (monotonic seconds)."""
        if self._last is not None and 0 < now - self._last <= IDLE_S:
            self._steps.append(now - self._last)
        self._last = now

    def loaded(self, nbytes: int, seconds: float) -> None:
        """One rank's load from the host tier took ``seconds`` for ``nbytes``."""
        if nbytes > 0 and seconds > 0:
            self._rates.append(nbytes / seconds)

    def step_s(self) -> float | None:
        return statistics.median(self._steps) if self._steps else None

    def rate(self) -> float | None:
        return statistics.median(self._rates) if self._rates else None

    def in_step(self, nbytes: int) -> bool:
        """Whether a load of ``nbytes`` (one rank's) copies within the step's share."""
        step, rate = self.step_s(), self.rate()
        if step is None or rate is None:
            return False
        return nbytes / rate <= STEP_SHARE * step
