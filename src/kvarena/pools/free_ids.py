"""A set of free ids that hands out the lowest (or highest) first.

Both allocators keep their free ids this way: a heap for the order, a set for
membership. Taking a specific id (a relocation target, a range given up to
the other pool) removes it from the set only; the heap drops such stale
entries lazily when they surface, so every operation stays O(log n).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class FreeIds:
    """Free ids, popped lowest first (``highest_first=False``) or highest first."""

    def __init__(self, ids: Iterable[int] = (), *, highest_first: bool = False) -> None:
        self._sign = -1 if highest_first else 1
        self._set: set[int] = set(ids)
        self._heap: list[int] = [self._sign * i for i in self._set]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._set)

    def __contains__(self, i: object) -> bool:
        return i in self._set

    def push(self, i: int) -> None:
        self._set.add(i)
        heapq.heappush(self._heap, self._sign * i)

    def pop(self) -> int:
        """The lowest (or highest) free id, taken out of the set."""
        while True:
            i = self._sign * heapq.heappop(self._heap)
            if i in self._set:  # skip ids taken out of the set since they were pushed
                self._set.remove(i)
                return i

    def take(self, i: int) -> None:
        """Take one specific free id (the caller checked it is free)."""
        self._set.remove(i)

    def take_range(self, lo: int, hi: int) -> None:
        """Take every id in ``[lo, hi)`` (the caller checked they are all free)."""
        self._set.difference_update(range(lo, hi))

    def descending(self) -> list[int]:
        """Every free id, highest first."""
        return sorted(self._set, reverse=True)

    def below(self, limit: int) -> list[int]:
        """Free ids under ``limit``, lowest first."""
        return sorted(i for i in self._set if i < limit)
