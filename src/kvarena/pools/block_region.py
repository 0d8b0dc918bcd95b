"""The block allocator's ids and their books, as the boundary changes their range.

``BlockRegion`` is an object the allocator holds: the capacity, the free
heap, each id's kind and reference count. A boundary move asks it which
blocks of a range are free, evictable and live, hands live blocks'
references to free ones below (returning the remap, for the allocator to
carry its cached keys along; the caller copies the bytes), then gives up or
gains the ids at the top.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..checks import check_count, check_ids
from ..errors import InvalidValueError
from .free_ids import FreeIds

FREE, LIVE, EVICTABLE = 0, 1, 2
"""The kinds of block a :class:`~kvarena.pools.blocks.BlockAllocator` records in its kind array."""


class BlockRegion:
    """Ids ``[0, capacity)``: the free heap, and each id's kind and reference
    count in two numpy arrays indexed by id (checking the tens of thousands of
    ids a checkpoint or a boundary move names is one gather, and moving their
    references one assignment, not a Python loop over dicts and sets)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = FreeIds(range(capacity))
        self.kind = np.zeros(capacity, dtype=np.int8)  # FREE / LIVE / EVICTABLE
        self.refs = np.zeros(capacity, dtype=np.int64)  # 0 unless LIVE

    def partition(self, lo: int, hi: int) -> tuple[list[int], list[int], list[int]]:
        """(free, evictable, live) block ids in ``[lo, hi)``, each lowest first:
        what a boundary move over that range drops, evicts and relocates."""
        lo, hi = max(0, lo), min(hi, self.capacity)
        if lo >= hi:
            return [], [], []
        kinds = self.kind[lo:hi]

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
        if k is not None and 8 * k < len(self.free):
            return self.free.lowest_below(limit, k)
        found = np.flatnonzero(self.kind[: max(0, limit)] == FREE)
        return (found if k is None else found[: max(0, k)]).tolist()

    def move_many(self, moves: Any) -> dict[int, int]:
        """Give each live ``old`` block's references to free block ``new`` (the
        caller copies the bytes; ``old`` becomes free) and return the remap
        ``{old: new}``. ``moves``: ``(old, new)`` pairs, as a list or a ``[k, 2]``
        integer array. Checked whole first: every source live, every target
        free and named once."""
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
        ids = check_ids(flat, "move_many: block ids", lo=0, hi=self.capacity).reshape(-1, 2)
        if ids.size == 0:
            return {}
        sources, targets = ids[:, 0].tolist(), ids[:, 1].tolist()
        source_set, target_set = set(sources), set(targets)
        if len(source_set) != len(sources):
            raise InvalidValueError(f"move_many: a block moves once, got sources {sources[:8]}")
        dead = self.kind[ids[:, 0]] != LIVE
        if dead.any():
            bad = sources[int(np.argmax(dead))]
            raise InvalidValueError(f"block {bad} is not live; only live blocks move")
        taken = ids[:, 1][self.kind[ids[:, 1]] != FREE].tolist()
        if taken or len(target_set) != len(targets) or not target_set.isdisjoint(source_set):
            raise InvalidValueError(
                f"move_many: targets must be distinct free blocks, got {targets[:8]}"
                + (f" (block {taken[0]} is not free)" if taken else "")
            )
        # Whole-set operations: a boundary move relocates thousands of blocks.
        self.free.take_many(targets)
        self.refs[ids[:, 1]] = self.refs[ids[:, 0]]
        self.refs[ids[:, 0]] = 0
        self.free.push_many(sources)
        self.kind[ids[:, 1]] = LIVE
        self.kind[ids[:, 0]] = FREE
        return dict(zip(sources, targets, strict=True))

    def shrink(self, n: int) -> None:
        """Give up the ``n`` highest ids; every one of them must be free."""
        n = check_count(n, "BlockAllocator.shrink: n", hi=self.capacity)
        new = self.capacity - n
        blocked = (np.flatnonzero(self.kind[new:] != FREE) + new).tolist()
        if blocked:
            raise InvalidValueError(f"shrink by {n}: blocks {blocked[:8]} are not free")
        self.free.take_range(new, self.capacity)
        self.capacity = new
        self.kind = self.kind[:new].copy()
        self.refs = self.refs[:new].copy()

    def grow(self, n: int) -> None:
        """Add ``n`` ids above the current capacity, free."""
        n = check_count(n, "BlockAllocator.grow: n")
        self.free.push_many(list(range(self.capacity, self.capacity + n)))
        self.capacity += n
        self.kind = np.concatenate((self.kind, np.zeros(n, dtype=np.int8)))
        self.refs = np.concatenate((self.refs, np.zeros(n, dtype=np.int64)))
