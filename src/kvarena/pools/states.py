"""STATE slot allocation: per-request groups, top-most slots first.

The STATE pool owns slots ``[first, total)`` and grows downward (``first``
decreases) into the PAGE region. Requests take their ``entries_per_req`` slots
(the state plus its speculative rollback copies) from the top, so the lowest
slots, the ones a shrinking pool gives back, are the last to be used.

A batch of requests takes ONE run of consecutive slots, ascending, where the
free slots hold such a run: a kernel then reads the batch's states as one
strided view ``state_view(name)[:, first:first + n]``, which no list of
scattered slots can express. The run is laid out entry by entry (the batch's
live states first, then each rollback copy's), so every entry of the batch
is such a view. Within a request its slots ascend too, so its live state is
the lowest of them and its rollback copies follow it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from ..checks import MAX_ENTRIES, check_count, check_ids, check_request_id
from ..errors import Error, InvalidValueError, UnknownNameError
from .free_ids import FreeIds


class StateAllocationError(Error, RuntimeError):
    """Not enough free slots; carries the numbers."""

    def __init__(self, wanted: int, free: int) -> None:
        self.wanted, self.free = wanted, free
        super().__init__(f"a request needs {wanted} state slots but only {free} are free")


class StateAllocator:
    """Slots ``[first, total)``; each request holds ``entries_per_req`` of them."""

    def __init__(self, total: int, live: int, entries_per_req: int = 1) -> None:
        self._total = check_count(total, "StateAllocator: total", hi=MAX_ENTRIES)
        live = check_count(live, "StateAllocator: live", hi=self._total)
        self._per_req = check_count(entries_per_req, "StateAllocator: entries_per_req", lo=1)
        self._first = self._total - live
        self._free = FreeIds(range(self._first, self._total), highest_first=True)
        self._owner: dict[int, Hashable] = {}
        self._slots: dict[Hashable, list[int]] = {}

    @property
    def total(self) -> int:
        return self._total

    @property
    def first(self) -> int:
        """Lowest slot index the pool owns."""
        return self._first

    @property
    def capacity(self) -> int:
        return self._total - self._first

    @property
    def entries_per_req(self) -> int:
        return self._per_req

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        return len(self._owner)

    @property
    def requests(self) -> list[Hashable]:
        return list(self._slots)

    def slots_of(self, request: Hashable) -> tuple[int, ...]:
        try:
            return tuple(self._slots[request])
        except (KeyError, TypeError):
            raise UnknownNameError(f"no request {request!r} holds state slots") from None

    def held_by(self, request: Hashable) -> tuple[int, ...]:
        """``request``'s slots, or () when it holds none."""
        try:
            return tuple(self._slots.get(request, ()))
        except TypeError:
            return ()

    def owner(self, slot: int) -> Hashable | None:
        """The request holding ``slot``, or None when the slot is free or outside the pool."""
        return self._owner.get(slot)

    def is_free(self, slot: int) -> bool:
        return slot in self._free

    def check_held(self, slots: Any, what: str) -> np.ndarray:
        """``slots`` as an id array if each is in the pool and held by a request, else refuse.

        The answer comes from the allocator's state now: a slot given back to
        PAGE by a boundary move is refused, one gained from it is accepted.
        """
        ids = check_ids(slots, what, lo=self._first, hi=self._total)
        unheld = set(ids.tolist()).difference(self._owner)
        for s in [s for s in ids.tolist() if s in unheld][:1]:
            raise InvalidValueError(
                f"{what}: slot {s} is free; only slots a request holds can be copied"
            )
        return ids

    def allocate(self, request: Hashable) -> tuple[int, ...]:
        """The top-most ``entries_per_req`` free slots for ``request``, ascending
        (consecutive where the free slots allow)."""
        return self.allocate_batch([request])[0]

    def allocate_batch(self, requests: Any) -> list[tuple[int, ...]]:
        """Slots for each of ``requests`` (in order): the top-most run of
        ``len(requests) * entries_per_req`` consecutive free slots, handed out
        ascending, when one exists; otherwise the top-most free slots, each
        request's ascending. All or nothing: refused, nothing taken."""
        if not isinstance(requests, (list, tuple)) or not requests:
            raise InvalidValueError(
                f"allocate_batch: requests must be a non-empty list, got {requests!r}"
            )
        reqs = [check_request_id(r) for r in requests]
        seen: set[Hashable] = set()
        for r in reqs:
            if r in self._slots:
                raise InvalidValueError(f"request {r!r} already holds slots {self._slots[r]}")
            if r in seen:
                raise InvalidValueError(f"allocate_batch: request {r!r} appears twice")
            seen.add(r)
        want = len(reqs) * self._per_req
        if self.num_free < want:
            raise StateAllocationError(want, self.num_free)
        run = None if want == 1 else self._top_run(want)
        if want == 1:
            flat = [self._free.pop()]
        elif run is not None:
            self._free.take_range(run, run + want)
            flat = list(range(run, run + want))
        else:
            flat = sorted(self._free.pop() for _ in range(want))
        out = []
        n = len(reqs)
        for i, r in enumerate(reqs):
            # Entry e of request i at flat[e * n + i]: each entry's slots over the
            # batch form one consecutive run (the live states one view, the
            # rollback copies another), and a request's own slots still ascend.
            slots = [flat[e * n + i] for e in range(self._per_req)]
            self._slots[r] = slots
            for s in slots:
                self._owner[s] = r
            out.append(tuple(slots))
        return out

    def _top_run(self, n: int) -> int | None:
        """The first slot of the highest run of ``n`` consecutive free slots."""
        length, prev = 0, None
        for s in self._free.descending():
            length = length + 1 if prev == s + 1 else 1
            if length == n:
                return s
            prev = s
        return None

    def release(self, request: Hashable) -> tuple[int, ...]:
        slots = self.slots_of(request)
        del self._slots[request]
        for s in slots:
            del self._owner[s]
            self._free.push(s)
        return slots

    def move(self, old: int, new: int) -> None:
        """Hand live slot ``old``'s place in its request to free slot ``new``."""
        if old not in self._owner:
            raise InvalidValueError(f"slot {old} is not live")
        if new not in self._free:
            raise InvalidValueError(f"slot {new} is not free")
        request = self._owner.pop(old)
        self._free.take(new)
        group = self._slots[request]
        group[group.index(old)] = new
        self._owner[new] = request
        self._free.push(old)

    def grow(self, n: int) -> None:
        """Take ``n`` more slots below ``first`` (the caller freed their bytes)."""
        n = check_count(n, "StateAllocator.grow: n", hi=self._first)
        for s in range(self._first - n, self._first):
            self._free.push(s)
        self._first -= n

    def shrink(self, n: int) -> None:
        """Give back the ``n`` lowest slots; every one must be free."""
        n = check_count(n, "StateAllocator.shrink: n", hi=self.capacity)
        released = range(self._first, self._first + n)
        busy = [s for s in released if s not in self._free]
        if busy:
            raise InvalidValueError(f"shrink by {n}: slots {busy[:8]} are live")
        self._free.take_range(self._first, self._first + n)
        self._first += n
