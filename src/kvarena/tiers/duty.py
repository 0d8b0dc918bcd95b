"""Background work that keeps to a share of the time.

A thread that lists a shared store shares the interpreter — and on a small
host the cores — with an engine's scheduler and its forward passes. Work
done in pieces can rest between them: a piece that took ``t`` seconds is
followed by a sleep of ``t (1 / duty - 1)``, so the work takes at most
``duty`` of the time. Without a duty the rest is ``sleep(0)``, which still
hands the interpreter to a waiting thread at once.
"""

from __future__ import annotations

import time

from ..errors import InvalidValueError


class DutyCycle:
    """Rests between pieces of work (:meth:`rest`) that keep it to ``duty`` of
    the time (None: only hand the interpreter over)."""

    def __init__(self, duty: float | None) -> None:
        if duty is not None and (
            isinstance(duty, bool) or not isinstance(duty, (int, float)) or not 0 < duty <= 1
        ):
            raise InvalidValueError(f"duty={duty!r}: a share of the time in (0, 1], or None")
        self._rest = 1 / duty - 1 if duty else 0.0
        self._since = time.perf_counter()

    def rest(self) -> None:
        """End a piece of work: sleep its share, then start timing the next."""
        worked = time.perf_counter() - self._since
        time.sleep(worked * self._rest)  # sleep(0) releases the interpreter's lock too
        self._since = time.perf_counter()
