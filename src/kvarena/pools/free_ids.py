"""A set of free ids that hands out the lowest (or highest) first.

Both allocators keep their free ids this way: a heap for the order, a set for
membership. Taking a specific id (a relocation target, a range given up to
the other pool) removes it from the set only; the heap drops such stale
entries lazily when they surface, so every operation stays O(log n).

A boundary move hands back or takes thousands of ids at once; the ``*_many``
and range operations do that with set operations (loops in C) and one
``heapify`` instead of a Python loop of heap pushes.
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

    def push_many(self, ids: list[int]) -> None:
        """Push every id of ``ids`` (none of them free yet)."""
        if not ids:
            return
        self._set.update(ids)
        signed = [self._sign * i for i in ids] if self._sign < 0 else ids
        # k pushes cost k log n; one heapify costs n: take the cheaper.
        if len(ids) * max(1, len(self._heap).bit_length()) > len(self._heap) + len(ids):
            self._heap.extend(signed)
            heapq.heapify(self._heap)
        else:
            for i in signed:
                heapq.heappush(self._heap, i)

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

    def take_many(self, ids: list[int]) -> None:
        """Take these specific free ids (the caller checked they are free)."""
        self._set.difference_update(ids)
        self._compact()

    def take_range(self, lo: int, hi: int) -> None:
        """Take every id in ``[lo, hi)`` (the caller checked they are all free)."""
        self._set.difference_update(range(lo, hi))
        self._compact()

    def _compact(self) -> None:
        # Taken ids stay in the heap until they surface; once they outnumber
        # the free ones, rebuild it so it never grows past twice the set.
        if len(self._heap) > 2 * len(self._set) + 64:
            self._heap = list(self._set) if self._sign > 0 else [-i for i in self._set]
            heapq.heapify(self._heap)

    def in_range(self, lo: int, hi: int) -> list[int]:
        """Free ids in ``[lo, hi)``, lowest first."""
        if hi - lo <= len(self._set):
            return sorted(self._set.intersection(range(lo, hi)))
        return sorted(i for i in self._set if lo <= i < hi)

    def lowest_below(self, limit: int, k: int) -> list[int]:
        """The ``k`` lowest free ids under ``limit`` (fewer if there are not as
        many), lowest first, without taking them.

        Walks the heap from its root, smallest first, so the cost follows ``k``
        (and the stale entries met on the way), not the number of free ids: a
        boundary move that relocates a few blocks in a cache of 200,000 pays
        for a few.
        """
        if k <= 0:
            return []
        if self._sign < 0:  # a highest-first heap cannot answer the walk
            return self.in_range(0, limit)[:k]
        heap, free = self._heap, self._set
        found: list[int] = []
        seen: set[int] = set()
        frontier = [(heap[0], 0)] if heap else []
        while frontier and len(found) < k:
            value, i = heapq.heappop(frontier)
            if value >= limit:
                break  # every entry left in the frontier is at least as large
            if value in free and value not in seen:  # stale or repeated entries are skipped
                seen.add(value)
                found.append(value)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
        return found

    def descending(self) -> list[int]:
        """Every free id, highest first."""
        return sorted(self._set, reverse=True)
