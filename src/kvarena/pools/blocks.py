"""PAGE block allocation: reference counts, lowest ids first, LRU eviction.

Blocks are handed out lowest id first so that the top of the PAGE region
stays free: the STATE pool grows down into it, and a free block there costs
nothing to give up. A block whose last reference is released while it holds
a prefix-cached key becomes *evictable* instead of free: it keeps its bytes
for a future prefix hit, and is reclaimed in least-recently-used order, with
a callback so the prefix cache can forget its key.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable


class BlockAllocationError(RuntimeError):
    """Not enough free or evictable blocks; carries the numbers."""

    def __init__(self, wanted: int, free: int, evictable: int) -> None:
        self.wanted, self.free, self.evictable = wanted, free, evictable
        super().__init__(
            f"wanted {wanted} blocks but only {free} are free and {evictable} evictable"
        )


class BlockAllocator:
    """Blocks ``[0, capacity)``: O(log n) alloc/free, refcounts, LRU evictables.

    States of a block id: free (in the heap), live (refcount > 0), or
    evictable (refcount 0, cached, in the LRU). ``free + live + evictable ==
    capacity`` always.
    """

    def __init__(self, capacity: int, on_evict: Callable[[int], None] | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"BlockAllocator: capacity must be an int >= 0, got {capacity!r}")
        self._capacity = capacity
        self._free: list[int] = list(range(capacity))  # a heap; sorted is a valid heap
        self._free_set: set[int] = set(self._free)
        self._refs: dict[int, int] = {}
        self._cached: set[int] = set()
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._on_evict = on_evict

    # -- queries -------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free_set)

    @property
    def num_live(self) -> int:
        return len(self._refs)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def is_free(self, block: int) -> bool:
        return block in self._free_set

    def is_evictable(self, block: int) -> bool:
        return block in self._lru

    def live_blocks(self) -> list[int]:
        return sorted(self._refs)

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, least recently used first."""
        return list(self._lru)

    def _check_id(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self._capacity:
            raise ValueError(f"block id {block!r} out of range; legal: 0..{self._capacity - 1}")

    # -- allocation ----------------------------------------------------------
    def _pop_free(self) -> int:
        while True:
            block = heapq.heappop(self._free)
            if block in self._free_set:  # lazily skip ids taken out of the heap's set
                self._free_set.remove(block)
                return block

    def allocate(self, n: int = 1) -> list[int]:
        """``n`` blocks, refcount 1, lowest free ids first, evicting LRU if needed.

        Refused before any change when free + evictable < n.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate: n must be an int >= 0, got {n!r}")
        if n > self.num_free + self.num_evictable:
            raise BlockAllocationError(n, self.num_free, self.num_evictable)
        while self.num_free < n:
            self._evict_one()
        blocks = [self._pop_free() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def retain(self, block: int) -> None:
        """One more reference (a prefix hit); revives an evictable block."""
        self._check_id(block)
        if block in self._lru:
            del self._lru[block]
            self._refs[block] = 1
        elif block in self._refs:
            self._refs[block] += 1
        else:
            raise ValueError(f"block {block} is free; allocate it instead of retaining it")

    def release(self, block: int) -> None:
        """Drop one reference; at zero a cached block becomes evictable, else free."""
        self._check_id(block)
        refs = self._refs.get(block)
        if refs is None:
            raise ValueError(f"block {block} is not live (free or evictable); nothing to release")
        if refs > 1:
            self._refs[block] = refs - 1
            return
        del self._refs[block]
        if block in self._cached:
            self._lru[block] = None
        else:
            self._push_free(block)

    def set_cached(self, block: int, cached: bool = True) -> None:
        """Mark a live block as holding a prefix-cached key (or not)."""
        self._check_id(block)
        if block not in self._refs:
            raise ValueError(f"block {block} is not live; only live blocks can be marked cached")
        if cached:
            self._cached.add(block)
        else:
            self._cached.discard(block)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def touch(self, block: int) -> None:
        """Mark an evictable block as recently used."""
        if block in self._lru:
            self._lru.move_to_end(block)

    def _push_free(self, block: int) -> None:
        self._free_set.add(block)
        heapq.heappush(self._free, block)

    def _evict_one(self) -> int:
        block, _ = self._lru.popitem(last=False)
        self._cached.discard(block)
        self._push_free(block)
        if self._on_evict is not None:
            self._on_evict(block)
        return block

    def evict(self, block: int) -> None:
        """Evict one specific evictable block now."""
        if block not in self._lru:
            raise ValueError(f"block {block} is not evictable")
        del self._lru[block]
        self._cached.discard(block)
        self._push_free(block)
        if self._on_evict is not None:
            self._on_evict(block)

    # -- moving the boundary -------------------------------------------------
    def move(self, old: int, new: int) -> None:
        """Give live block ``old``'s references and cached mark to free block ``new``.

        The caller copies the bytes; ``old`` becomes free.
        """
        self._check_id(old)
        self._check_id(new)
        if old not in self._refs:
            raise ValueError(f"block {old} is not live; only live blocks move")
        if new not in self._free_set:
            raise ValueError(f"block {new} is not free")
        self._free_set.remove(new)
        self._refs[new] = self._refs.pop(old)
        if old in self._cached:
            self._cached.discard(old)
            self._cached.add(new)
        self._push_free(old)

    def shrink(self, capacity: int) -> None:
        """Drop ids ``>= capacity``; every one of them must be free."""
        if not 0 <= capacity <= self._capacity:
            raise ValueError(f"shrink: capacity {capacity} must be in 0..{self._capacity}")
        blocked = [b for b in range(capacity, self._capacity) if b not in self._free_set]
        if blocked:
            raise ValueError(f"shrink to {capacity}: blocks {blocked[:8]} are not free")
        self._free_set.difference_update(range(capacity, self._capacity))
        self._capacity = capacity

    def grow(self, capacity: int) -> None:
        """Add ids ``[old capacity, capacity)`` as free."""
        if capacity < self._capacity:
            raise ValueError(f"grow: capacity {capacity} is below the current {self._capacity}")
        for b in range(self._capacity, capacity):
            self._push_free(b)
        self._capacity = capacity

    def free_blocks_below(self, limit: int) -> list[int]:
        """Free block ids under ``limit``, lowest first."""
        return sorted(b for b in self._free_set if b < limit)
