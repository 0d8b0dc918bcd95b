"""STATE slot allocation: per-request groups, top-most slots first.

The STATE pool owns slots ``[first, total)`` and grows downward (``first``
decreases) into the PAGE region. Requests take their ``entries_per_req`` slots
(the state plus its speculative rollback copies) from the top, so the lowest
slots, the ones a shrinking pool gives back, are the last to be used.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable


class StateAllocationError(RuntimeError):
    """Not enough free slots; carries the numbers."""

    def __init__(self, wanted: int, free: int) -> None:
        self.wanted, self.free = wanted, free
        super().__init__(f"a request needs {wanted} state slots but only {free} are free")


class StateAllocator:
    """Slots ``[first, total)``; each request holds ``entries_per_req`` of them."""

    def __init__(self, total: int, live: int, entries_per_req: int = 1) -> None:
        for what, v, lo in (
            ("total", total, 0),
            ("live", live, 0),
            ("entries_per_req", entries_per_req, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"StateAllocator: {what} must be an int >= {lo}, got {v!r}")
        if live > total:
            raise ValueError(f"StateAllocator: live {live} exceeds total {total}")
        self._total = total
        self._first = total - live
        self._per_req = entries_per_req
        self._free: list[int] = [-s for s in range(total - 1, self._first - 1, -1)]  # max-heap
        heapq.heapify(self._free)
        self._free_set: set[int] = set(range(self._first, total))
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
        return len(self._free_set)

    @property
    def num_live(self) -> int:
        return len(self._owner)

    @property
    def requests(self) -> list[Hashable]:
        return list(self._slots)

    def slots_of(self, request: Hashable) -> tuple[int, ...]:
        try:
            return tuple(self._slots[request])
        except KeyError:
            raise KeyError(f"no request {request!r} holds state slots") from None

    def owner(self, slot: int) -> Hashable | None:
        return self._owner.get(slot)

    def is_free(self, slot: int) -> bool:
        return slot in self._free_set

    def _pop_top(self) -> int:
        while True:
            slot = -heapq.heappop(self._free)
            if slot in self._free_set:
                self._free_set.remove(slot)
                return slot

    def allocate(self, request: Hashable) -> tuple[int, ...]:
        """The top-most ``entries_per_req`` free slots for ``request``."""
        if request in self._slots:
            raise ValueError(f"request {request!r} already holds slots {self._slots[request]}")
        if self.num_free < self._per_req:
            raise StateAllocationError(self._per_req, self.num_free)
        slots = [self._pop_top() for _ in range(self._per_req)]
        self._slots[request] = slots
        for s in slots:
            self._owner[s] = request
        return tuple(slots)

    def free(self, request: Hashable) -> tuple[int, ...]:
        try:
            slots = self._slots.pop(request)
        except KeyError:
            raise KeyError(f"no request {request!r} holds state slots") from None
        for s in slots:
            del self._owner[s]
            self._push(s)
        return tuple(slots)

    def _push(self, slot: int) -> None:
        self._free_set.add(slot)
        heapq.heappush(self._free, -slot)

    def move(self, old: int, new: int) -> None:
        """Hand live slot ``old``'s place in its request to free slot ``new``."""
        request = self._owner.get(old)
        if request is None:
            raise ValueError(f"slot {old} is not live")
        if new not in self._free_set:
            raise ValueError(f"slot {new} is not free")
        self._free_set.remove(new)
        group = self._slots[request]
        group[group.index(old)] = new
        del self._owner[old]
        self._owner[new] = request
        self._push(old)

    def grow(self, n: int) -> None:
        """Take ``n`` more slots below ``first`` (the caller freed their bytes)."""
        if n < 0 or n > self._first:
            raise ValueError(f"grow: n={n} must be in 0..{self._first}")
        for s in range(self._first - n, self._first):
            self._push(s)
        self._first -= n

    def shrink(self, n: int) -> None:
        """Give back the ``n`` lowest slots; every one must be free."""
        if n < 0 or n > self.capacity:
            raise ValueError(f"shrink: n={n} must be in 0..{self.capacity}")
        released = range(self._first, self._first + n)
        busy = [s for s in released if s not in self._free_set]
        if busy:
            raise ValueError(f"shrink by {n}: slots {busy[:8]} are live")
        self._free_set.difference_update(released)
        self._first += n
