"""Loads that would stall the engine's step, fetched off it.

vLLM puts every request of a batch behind the slowest thing inside a step, and
a load from the disk or a shared store is slow beside a forward. So a load
whose objects are not all in the host tier is handed to I/O threads: they
fetch and check the objects (copies, never views: nothing is held across
steps), and a later step's ``start_load_kv`` copies the finished ones into
vLLM's tensors, before that step's forward, and reports them finished. The
request waits meanwhile (vLLM's asynchronous-load path), the others decode.

Loads fetched together land paced: a step copies in at most the bytes its
plan allows (:attr:`~.records.StepPlan.land_bytes`, the share of a step the
scheduler measures), the first finished always, the rest in later steps, in
the order they were asked. A store that answers many loads at once (a stalled
one coming back) would otherwise have every one of them copied, and every
one of those requests computing its first token, in the same step.

A load past its deadline is given up: reported failed, so vLLM recomputes its
blocks; what its thread fetches afterwards is dropped.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .records import Load

IO_THREADS = 2
"""Fetches at once per worker: a disk read and a store's round trip overlap,
without a thread per request."""


@dataclass(frozen=True, kw_only=True)
class _InFlight:
    job: Load
    future: concurrent.futures.Future[Any]
    deadline: float


class LoadQueue:
    """The loads in flight on one worker: submitted in one step, collected in a
    later one. ``fetch`` is what a thread runs for a load (its result is handed
    back as it is); ``deadline_s`` how long a load may take."""

    def __init__(
        self, fetch: Callable[[Load], Any], *, deadline_s: float, threads: int = IO_THREADS
    ) -> None:
        self._fetch = fetch
        self.deadline_s = deadline_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="kvarena-load"
        )
        self._flight: list[_InFlight] = []

    def __len__(self) -> int:
        return len(self._flight)

    def submit(self, job: Load) -> None:
        future = self._pool.submit(self._fetch, job)
        self._flight.append(
            _InFlight(job=job, future=future, deadline=time.monotonic() + self.deadline_s)
        )

    def collect(
        self,
        now: float | None = None,
        *,
        budget: int | None = None,
        weigh: Callable[[Any], int] | None = None,
    ) -> tuple[list[tuple[Load, Any]], list[Load]]:
        """The loads whose fetch finished (with its result), and those past their
        deadline at ``now`` (default: the monotonic clock's now), given up; both
        leave the queue. ``budget``: the bytes the finished ones may weigh
        together (``weigh``: a result's bytes), in the order they were
        submitted; the first always goes, a finished load past the budget (and
        every finished one after it) stays for a later call, whatever its
        deadline: its bytes are here."""
        done: list[tuple[Load, Any]] = []
        late: list[Load] = []
        left: list[_InFlight] = []
        now = time.monotonic() if now is None else now
        taken, full = 0, False
        for f in self._flight:
            if f.future.done():
                result = f.future.result()
                size = weigh(result) if weigh is not None else 0
                full = full or (budget is not None and bool(done) and taken + size > budget)
                if full:
                    left.append(f)
                    continue
                taken += size
                done.append((f.job, result))
            elif now > f.deadline:
                f.future.cancel()  # if it has not started; a running fetch finishes unseen
                late.append(f.job)
            else:
                left.append(f)
        self._flight = left
        return done, late

    def wait(self, timeout: float | None = None) -> None:
        """Until every load in flight has finished fetching (for tests and shutdown)."""
        concurrent.futures.wait([f.future for f in self._flight], timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
