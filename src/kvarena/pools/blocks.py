"""PAGE block allocation: reference counts, lowest ids first, LRU eviction.

Blocks are handed out lowest id first so that the top of the PAGE region
stays free: the STATE pool grows down into it, and a free block there costs
nothing to give up. A block whose last reference is released while it holds
a prefix-cached key becomes *evictable* instead of free: it keeps its bytes
for a future prefix hit, and is reclaimed in least-recently-used order, with
a callback so the prefix cache can forget its key.

A second hook, ``before_evict``, sees each batch of victims BEFORE anything
changes, while their bytes are still theirs: the place to write them to a
lower tier. It runs before the operation's first change, so if it raises the
operation is refused whole (nothing evicted, nothing allocated).

The ``on_evict`` callback runs after the operation that evicted has completed, never in
the middle of it: an ``on_evict`` that raises cannot leave an allocation or a
boundary move half done. The operation completes, every callback runs, and
then the callbacks' failures are raised together as
:class:`EvictionCallbackError`, which carries the operation's result.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ..checks import MAX_ENTRIES, check_count, check_ids, check_int
from ..errors import Error, InvalidValueError
from .free_ids import FreeIds


class BlockAllocationError(Error, RuntimeError):
    """Not enough free or evictable blocks; carries the numbers."""

    def __init__(self, wanted: int, free: int, evictable: int) -> None:
        self.wanted, self.free, self.evictable = wanted, free, evictable
        super().__init__(
            f"wanted {wanted} blocks but only {free} are free and {evictable} evictable"
        )


class EvictionCallbackError(Error, RuntimeError):
    """``on_evict`` raised. The operation that evicted had completed first: its
    result (the blocks allocated, the boundary move) is ``.result``, and
    ``.errors`` pairs each evicted block whose callback raised with the error."""

    def __init__(self, result: Any, errors: list[tuple[int, Exception]]) -> None:
        self.result, self.errors = result, errors
        first = errors[0]
        super().__init__(
            f"on_evict raised for {len(errors)} evicted block(s) (first: block {first[0]}: "
            f"{type(first[1]).__name__}: {first[1]}); the operation completed, its result is "
            "on .result"
        )


FREE, LIVE, EVICTABLE = 0, 1, 2
"""The kinds of block a :class:`BlockAllocator` records in its kind array."""


class BlockAllocator:
    """Blocks ``[0, capacity)``: O(log n) alloc/free, refcounts, LRU evictables.

    States of a block id: free, live (refcount > 0), or evictable (refcount 0,
    cached, in the LRU). ``free + live + evictable == capacity`` always.

    Each block's kind and reference count live in two numpy arrays indexed by
    block id (beside the LRU and the free heap, which keep the orders):
    checking the tens of thousands of ids a checkpoint or a boundary move
    names is one gather, and moving their references one assignment, not a
    Python loop over dicts and sets.
    """

    def __init__(
        self,
        capacity: int,
        on_evict: Callable[[int], None] | None = None,
        *,
        before_evict: Callable[[list[int]], None] | None = None,
    ) -> None:
        self._capacity = check_count(capacity, "BlockAllocator: capacity", hi=MAX_ENTRIES)
        self._free = FreeIds(range(self._capacity))
        self._kind = np.zeros(self._capacity, dtype=np.int8)  # FREE / LIVE / EVICTABLE
        self._refs = np.zeros(self._capacity, dtype=np.int64)  # 0 unless LIVE
        self._num_live = 0
        self._cached: set[int] = set()
        self._lru: OrderedDict[int, None] = OrderedDict()
        if on_evict is not None and not callable(on_evict):
            raise InvalidValueError(f"on_evict must be callable, got {on_evict!r}")
        self._on_evict = on_evict
        if before_evict is not None and not callable(before_evict):
            raise InvalidValueError(f"before_evict must be callable, got {before_evict!r}")
        self._before_evict = before_evict
        self._evicted: list[int] = []  # evicted by the operation in progress
        self._holds = 0  # > 0 while an enclosing operation defers the callbacks

    # -- queries -------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        return self._num_live

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def refcount(self, block: int) -> int:
        if isinstance(block, (int, np.integer)) and 0 <= block < self._capacity:
            return int(self._refs[block])
        return 0

    def is_free(self, block: int) -> bool:
        return block in self._free

    def is_evictable(self, block: int) -> bool:
        return block in self._lru

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def live_blocks(self) -> list[int]:
        return np.flatnonzero(self._kind == LIVE).tolist()

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, least recently used first."""
        return list(self._lru)

    def partition(self, lo: int, hi: int) -> tuple[list[int], list[int], list[int]]:
        """(free, evictable, live) block ids in ``[lo, hi)``, each lowest first:
        what a boundary move over that range drops, evicts and relocates."""
        lo, hi = max(0, lo), min(hi, self._capacity)
        if lo >= hi:
            return [], [], []
        kinds = self._kind[lo:hi]

        def of(kind: int) -> list[int]:
            return (np.flatnonzero(kinds == kind) + lo).tolist()

        return of(FREE), of(EVICTABLE), of(LIVE)

    def free_blocks_below(self, limit: int, k: int | None = None) -> list[int]:
        """Free block ids under ``limit``, lowest first; only the ``k`` lowest if given.

        A few of many free blocks come from a walk of the free heap (its cost
        follows ``k``); otherwise one scan of the kind array, vectorized: a
        walk step costs about ten times a sorted id (804 of 2,500 free: 0.6 ms
        walking vs 0.2 sorting the free set in Python, 0.02 scanning).
        """
        if k is not None and 8 * k < self.num_free:
            return self._free.lowest_below(limit, k)
        found = np.flatnonzero(self._kind[: max(0, limit)] == FREE)
        return (found if k is None else found[: max(0, k)]).tolist()

    def _check_id(self, block: Any) -> int:
        return check_int(block, "block id", lo=0, hi=self._capacity - 1)

    def check_held(self, blocks: Any, what: str, *, writing: bool) -> np.ndarray:
        """``blocks`` as an id array if each is in the pool and held, else refuse.

        Writing needs a live block (someone holds a reference, so no one else
        is handed it); reading also accepts an evictable one, which keeps its
        bytes until it is evicted. The answer comes from the allocator's state
        now, so it stays true across boundary moves.
        """
        ids = check_ids(blocks, what, lo=0, hi=self._capacity)
        kinds = self._kind[ids]
        unheld = kinds != LIVE if writing else kinds == FREE
        if unheld.any():
            b = int(ids[int(np.argmax(unheld))])  # the first one named
            state = "evictable" if b in self._lru else "free"
            need = "live (allocated)" if writing else "live or evictable"
            raise InvalidValueError(f"{what}: block {b} is {state}; it must be {need}")
        return ids

    # -- allocation ----------------------------------------------------------
    def allocate(self, n: int = 1) -> list[int]:
        """``n`` blocks, refcount 1, lowest free ids first, evicting LRU if needed.

        Refused before any change when free + evictable < n.
        """
        n = check_count(n, "allocate: n")
        if n > self.num_free + self.num_evictable:
            raise BlockAllocationError(n, self.num_free, self.num_evictable)
        short = n - self.num_free
        if short > 0:
            self.evict_many(list(itertools.islice(self._lru, short)), notify=False)
        blocks = [self._free.pop() for _ in range(n)]
        self._refs[blocks] = 1
        self._kind[blocks] = LIVE
        self._num_live += n
        self.notify_evicted(blocks)
        return blocks

    def retain(self, block: int) -> None:
        """One more reference (a prefix hit); revives an evictable block."""
        block = self._check_id(block)
        kind = self._kind[block]
        if kind == EVICTABLE:
            del self._lru[block]
            self._refs[block] = 1
            self._kind[block] = LIVE
            self._num_live += 1
        elif kind == LIVE:
            self._refs[block] += 1
        else:
            raise InvalidValueError(f"block {block} is free; allocate it instead of retaining it")

    def pin(self, blocks: Any, what: str) -> list[int]:
        """One more reference on each of ``blocks``, all or nothing: every id is
        checked live first, so a refused pin leaves every refcount as it was."""
        ids = self.check_held(blocks, what, writing=True)
        np.add.at(self._refs, ids, 1)  # a block named twice takes two references
        return ids.tolist()

    def release(self, block: int) -> None:
        """Drop one reference; at zero a cached block becomes evictable, else free."""
        block = self._check_id(block)
        if self._kind[block] != LIVE:
            raise InvalidValueError(
                f"block {block} is not live (free or evictable); nothing to release"
            )
        self._refs[block] -= 1
        if self._refs[block]:
            return
        self._num_live -= 1
        if block in self._cached:
            self._lru[block] = None
            self._kind[block] = EVICTABLE
        else:
            self._free.push(block)
            self._kind[block] = FREE

    def set_cached(self, block: int, cached: bool = True) -> None:
        """Mark a live block as holding a prefix-cached key (or not)."""
        block = self._check_id(block)
        if self._kind[block] != LIVE:
            raise InvalidValueError(
                f"block {block} is not live; only live blocks can be marked cached"
            )
        if cached:
            self._cached.add(block)
        else:
            self._cached.discard(block)

    def refresh(self, block: int) -> None:
        """Move an evictable block to the most-recently-used end of the LRU.

        (Not a reference: vLLM's ``touch`` takes one; this only reorders.)
        """
        block = self._check_id(block)
        if block not in self._lru:
            raise InvalidValueError(f"block {block} is not evictable; only evictable blocks age")
        self._lru.move_to_end(block)

    def _evict(self, block: int) -> None:
        """The state change of an eviction; its callback waits for the operation to end."""
        del self._lru[block]
        self._cached.discard(block)
        self._free.push(block)
        self._kind[block] = FREE
        self._evicted.append(block)

    @contextmanager
    def deferred_callbacks(self) -> Iterator[None]:
        """Hold ``on_evict`` callbacks while a larger operation (a boundary move)
        completes; it calls :meth:`notify_evicted` with its result afterwards."""
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1

    def notify_evicted(self, result: Any) -> None:
        """Run ``on_evict`` for each block the completed operation evicted.

        Every callback runs even if one raises; failures are then raised as one
        :class:`EvictionCallbackError` carrying ``result``.
        """
        if self._holds:
            return  # the enclosing operation notifies when it completes
        evicted, self._evicted = self._evicted, []
        if self._on_evict is None:
            return
        errors: list[tuple[int, Exception]] = []
        for b in evicted:
            try:
                self._on_evict(b)
            except Exception as exc:  # collected: the operation already completed
                errors.append((b, exc))
        if errors:
            raise EvictionCallbackError(result, errors)

    def evict(self, block: int) -> None:
        """Evict one specific evictable block now."""
        self.evict_many([block])

    def evict_many(self, blocks: list[int], *, notify: bool = True) -> None:
        """Evict these evictable blocks now: all checked first, ``before_evict``
        sees them together while their bytes are intact, then each is evicted."""
        ids = [self._check_id(b) for b in blocks]
        bad = [b for b in ids if b not in self._lru]
        if bad or len(set(ids)) != len(ids):
            raise InvalidValueError(
                f"evict: blocks must be distinct and evictable, got {ids[:8]}"
                + (f" (block {bad[0]} is not evictable)" if bad else "")
            )
        if ids and self._before_evict is not None:
            self._before_evict(ids)
        for b in ids:
            self._evict(b)
        if notify:
            self.notify_evicted(None)

    # -- moving the boundary -------------------------------------------------
    def move_many(self, moves: Any) -> None:
        """Give each live ``old`` block's references and cached mark to free block
        ``new`` (the caller copies the bytes; ``old`` becomes free). ``moves``:
        ``(old, new)`` pairs, as a list or a ``[k, 2]`` integer array. Checked
        whole first: every source live, every target free and named once."""
        if isinstance(moves, (np.ndarray, torch.Tensor)):
            flat: Any = moves
            if moves.ndim != 2 or moves.shape[1] != 2:
                raise InvalidValueError(
                    f"move_many: moves must be (old, new) pairs, got shape {tuple(moves.shape)}"
                )
        else:
            moves = list(moves)
            bad = [m for m in moves if not isinstance(m, (tuple, list)) or len(m) != 2]
            if bad:
                raise InvalidValueError(
                    f"move_many: moves must be (old, new) pairs, got {bad[0]!r}"
                )
            flat = [v for pair in moves for v in pair]
        ids = check_ids(flat, "move_many: block ids", lo=0, hi=self._capacity).reshape(-1, 2)
        if ids.size == 0:
            return
        sources, targets = ids[:, 0].tolist(), ids[:, 1].tolist()
        source_set, target_set = set(sources), set(targets)
        if len(source_set) != len(sources):
            raise InvalidValueError(f"move_many: a block moves once, got sources {sources[:8]}")
        dead = self._kind[ids[:, 0]] != LIVE
        if dead.any():
            bad = sources[int(np.argmax(dead))]
            raise InvalidValueError(f"block {bad} is not live; only live blocks move")
        taken = ids[:, 1][self._kind[ids[:, 1]] != FREE].tolist()
        if taken or len(target_set) != len(targets) or not target_set.isdisjoint(source_set):
            raise InvalidValueError(
                f"move_many: targets must be distinct free blocks, got {targets[:8]}"
                + (f" (block {taken[0]} is not free)" if taken else "")
            )
        # Whole-set operations: a boundary move relocates thousands of blocks.
        self._free.take_many(targets)
        self._refs[ids[:, 1]] = self._refs[ids[:, 0]]
        self._refs[ids[:, 0]] = 0
        moved_cached = self._cached & source_set
        if moved_cached:
            remap = dict(zip(sources, targets, strict=True))
            self._cached -= moved_cached
            self._cached.update(remap[o] for o in moved_cached)
        self._free.push_many(sources)
        self._kind[ids[:, 1]] = LIVE
        self._kind[ids[:, 0]] = FREE

    def shrink(self, n: int) -> None:
        """Give up the ``n`` highest ids; every one of them must be free."""
        n = check_count(n, "BlockAllocator.shrink: n", hi=self._capacity)
        new = self._capacity - n
        blocked = (np.flatnonzero(self._kind[new:] != FREE) + new).tolist()
        if blocked:
            raise InvalidValueError(f"shrink by {n}: blocks {blocked[:8]} are not free")
        self._free.take_range(new, self._capacity)
        self._capacity = new
        self._kind = self._kind[:new].copy()
        self._refs = self._refs[:new].copy()

    def grow(self, n: int) -> None:
        """Add ``n`` ids above the current capacity, free."""
        n = check_count(n, "BlockAllocator.grow: n")
        self._free.push_many(list(range(self._capacity, self._capacity + n)))
        self._capacity += n
        self._kind = np.concatenate((self._kind, np.zeros(n, dtype=np.int8)))
        self._refs = np.concatenate((self._refs, np.zeros(n, dtype=np.int64)))
