"""PAGE block allocation: reference counts, lowest ids first, LRU eviction.

Blocks are handed out lowest id first so that the top of the PAGE region
stays free: the STATE pool grows down into it, and a free block there costs
nothing to give up. A block whose last reference is released while it holds
a cached key (:mod:`kvarena.pools.cached_keys`, the one book of cached
blocks, which this allocator owns) becomes *evictable* instead of free: it
keeps its bytes for a future prefix hit, and is reclaimed in
least-recently-used order. Evicting a block drops its key in the same step
(and the key's other blocks, and the key declared worthless without it).

Evictions are not announced to anyone above: the operation that evicted
returns what it did (:meth:`evict_many` the dropped keys, a boundary move its
record). One *write-down sink* may be set (:meth:`set_write_down`): it sees
each batch of :class:`Evicted` keys BEFORE anything changes, while their
bytes are still theirs — the place to write them to a lower tier. If it
raises, the operation is refused whole (nothing evicted, nothing allocated).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from ..checks import MAX_ENTRIES, check_count, check_ids, check_int, check_key
from ..errors import Error, InvalidValueError
from .block_region import EVICTABLE, FREE, LIVE, BlockRegion
from .cached_keys import CachedKeys, Evicted


class BlockAllocationError(Error, RuntimeError):
    """Not enough free or evictable blocks; carries the numbers."""

    def __init__(self, wanted: int, free: int, evictable: int) -> None:
        self.wanted, self.free, self.evictable = wanted, free, evictable
        super().__init__(
            f"wanted {wanted} blocks but only {free} are free and {evictable} evictable"
        )


WriteDown = Callable[[Sequence[Evicted]], None]
"""The sink an allocator hands each batch of victims to, while their bytes are intact."""


class BlockAllocator:
    """Blocks ``[0, capacity)``: O(log n) alloc/free, refcounts, LRU evictables.

    States of a block id: free, live (refcount > 0), or evictable (refcount 0,
    cached, in the LRU). ``free + live + evictable == capacity`` always.

    The ids and their kinds and reference counts are a :class:`BlockRegion`
    it holds; beside it, the LRU of evictable blocks and the one book of
    cached keys.
    """

    def __init__(self, capacity: int) -> None:
        capacity = check_count(capacity, "BlockAllocator: capacity", hi=MAX_ENTRIES)
        self._region = BlockRegion(capacity)  # ids, free heap, kinds, reference counts
        self._num_live = 0
        self._keys = CachedKeys()
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._write_down: WriteDown | None = None

    # -- the id range, as a boundary move changes it ------------------------------
    def partition(self, lo: int, hi: int) -> tuple[list[int], list[int], list[int]]:
        """(free, evictable, live) block ids in ``[lo, hi)``, each lowest first."""
        return self._region.partition(lo, hi)

    def free_blocks_below(self, limit: int, k: int | None = None) -> list[int]:
        """Free block ids under ``limit``, lowest first; only the ``k`` lowest if given."""
        return self._region.free_blocks_below(limit, k)

    def move_many(self, moves: Any) -> None:
        """Give each live ``old`` block's references and cached key to free block
        ``new`` (the caller copies the bytes; ``old`` becomes free): ``(old, new)``
        pairs, checked whole first (:meth:`BlockRegion.move_many`)."""
        remap = self._region.move_many(moves)
        if remap and len(self._keys):
            self._keys.remap(remap)

    def shrink(self, n: int) -> None:
        """Give up the ``n`` highest ids; every one of them must be free."""
        self._region.shrink(n)

    def grow(self, n: int) -> None:
        """Add ``n`` ids above the current capacity, free."""
        self._region.grow(n)

    def set_write_down(self, sink: WriteDown | None) -> None:
        """The one sink that sees each batch of victims before they are evicted
        (None: victims are simply dropped)."""
        if sink is not None and not callable(sink):
            raise InvalidValueError(f"a write-down sink must be callable, got {sink!r}")
        self._write_down = sink

    # -- queries -------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._region.capacity

    @property
    def num_free(self) -> int:
        return len(self._region.free)

    @property
    def num_live(self) -> int:
        return self._num_live

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def refcount(self, block: int) -> int:
        if isinstance(block, (int, np.integer)) and 0 <= block < self._region.capacity:
            return int(self._region.refs[block])
        return 0

    def is_free(self, block: int) -> bool:
        return block in self._region.free

    def is_evictable(self, block: int) -> bool:
        return block in self._lru

    def is_cached(self, block: int) -> bool:
        return self._keys.key_of(block) is not None

    # -- the book of cached blocks ------------------------------------------
    @property
    def num_keys(self) -> int:
        """Cached keys (a KV block's or an image's)."""
        return len(self._keys)

    def keys(self) -> list[Hashable]:
        """Every cached key, oldest cached first."""
        return list(self._keys)

    def blocks_of(self, key: Hashable) -> tuple[int, ...] | None:
        """The blocks ``key`` is cached in, in order; None when it is not cached."""
        return self._keys.blocks_of(key)

    def key_of(self, block: int) -> Hashable | None:
        return self._keys.key_of(block)

    def tag_of(self, key: Hashable) -> int:
        """The integer its owner cached ``key`` with (a block index, a boundary)."""
        if key not in self._keys:
            raise InvalidValueError(f"key {key!r} is not cached")
        return self._keys.tag_of(key)

    def cache(
        self, key: Hashable, blocks: Sequence[int], *, tag: int = 0, after: Hashable | None = None
    ) -> None:
        """Hold ``key`` in ``blocks`` (live, uncached, each named once): at their last
        release they age in the LRU instead of going free. ``after`` names a key
        without which this one is worthless: evicting that one evicts this one too."""
        check_key(key, "cache: key")
        if after is not None:
            check_key(after, "cache: after")
        ids = self.check_held(blocks, "cache: blocks", writing=True)
        if ids.size == 0 or len(set(ids.tolist())) != ids.size:
            raise InvalidValueError(
                f"cache: blocks must be distinct and at least one, got {blocks!r}"
            )
        held = [b for b in ids.tolist() if self._keys.key_of(b) is not None]
        if held:
            raise InvalidValueError(
                f"cache: block {held[0]} holds key {self._keys.key_of(held[0])!r} already"
            )
        check_int(tag, "cache: tag")
        self._keys.add(key, tuple(ids.tolist()), int(tag), after)

    def check_books(self) -> None:
        """The key book, the kinds and the LRU agree (for tests)."""
        self._keys.check()
        evictable = set(np.flatnonzero(self._region.kind == EVICTABLE).tolist())
        assert evictable == set(self._lru)
        assert all(self._keys.key_of(b) is not None for b in evictable)
        for key in self._keys:
            blocks = self._keys.blocks_of(key) or ()
            assert all(self._region.kind[b] != FREE for b in blocks), key

    def live_blocks(self) -> list[int]:
        return np.flatnonzero(self._region.kind == LIVE).tolist()

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, least recently used first."""
        return list(self._lru)

    def _check_id(self, block: Any) -> int:
        return check_int(block, "block id", lo=0, hi=self._region.capacity - 1)

    def check_held(self, blocks: Any, what: str, *, writing: bool) -> np.ndarray:
        """``blocks`` as an id array if each is in the pool and held, else refuse.

        Writing needs a live block (someone holds a reference, so no one else
        is handed it); reading also accepts an evictable one, which keeps its
        bytes until it is evicted. The answer comes from the allocator's state
        now, so it stays true across boundary moves.
        """
        ids = check_ids(blocks, what, lo=0, hi=self._region.capacity)
        kinds = self._region.kind[ids]
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

        Refused before any change when free + evictable < n (or when the
        write-down sink refuses the victims)."""
        n = check_count(n, "allocate: n")
        if n > self.num_free + self.num_evictable:
            raise BlockAllocationError(n, self.num_free, self.num_evictable)
        short = n - self.num_free
        if short > 0:
            self._evict_keys(self._victims(short))
        blocks = [self._region.free.pop() for _ in range(n)]
        self._region.refs[blocks] = 1
        self._region.kind[blocks] = LIVE
        self._num_live += n
        return blocks

    def _victims(self, short: int) -> list[Hashable]:
        """The least recently used keys whose evictable blocks free ``short`` blocks."""
        keys: list[Hashable] = []
        chosen: set[Hashable] = set()
        freed = 0
        for block in self._lru:
            key = self._keys.key_of(block)
            if key in chosen:
                continue
            chosen.add(key)
            keys.append(key)
            freed += sum(
                1 for b in self._keys.blocks_of(key) or () if self._region.kind[b] == EVICTABLE
            )
            if freed >= short:
                break
        return keys

    def retain(self, block: int) -> None:
        """One more reference (a prefix hit); revives an evictable block."""
        block = self._check_id(block)
        kind = self._region.kind[block]
        if kind == EVICTABLE:
            del self._lru[block]
            self._region.refs[block] = 1
            self._region.kind[block] = LIVE
            self._num_live += 1
        elif kind == LIVE:
            self._region.refs[block] += 1
        else:
            raise InvalidValueError(f"block {block} is free; allocate it instead of retaining it")

    def pin(self, blocks: Any, what: str) -> list[int]:
        """One more reference on each of ``blocks``, all or nothing: every id is
        checked live first, so a refused pin leaves every refcount as it was."""
        ids = self.check_held(blocks, what, writing=True)
        np.add.at(self._region.refs, ids, 1)  # a block named twice takes two references
        return ids.tolist()

    def release(self, block: int) -> None:
        """Drop one reference; at zero a cached block becomes evictable, else free."""
        block = self._check_id(block)
        if self._region.kind[block] != LIVE:
            raise InvalidValueError(
                f"block {block} is not live (free or evictable); nothing to release"
            )
        self._region.refs[block] -= 1
        if self._region.refs[block]:
            return
        self._num_live -= 1
        if self._keys.key_of(block) is not None:
            self._lru[block] = None
            self._region.kind[block] = EVICTABLE
        else:
            self._region.free.push(block)
            self._region.kind[block] = FREE

    def refresh(self, block: int) -> None:
        """Move an evictable block to the most-recently-used end of the LRU.

        (Not a reference: vLLM's ``touch`` takes one; this only reorders.)
        """
        block = self._check_id(block)
        if block not in self._lru:
            raise InvalidValueError(f"block {block} is not evictable; only evictable blocks age")
        self._lru.move_to_end(block)

    def _with_dependents(self, keys: list[Hashable]) -> list[Hashable]:
        """``keys`` and, after each, the key worthless without it when all of that
        one's blocks are evictable (one held by a request stays: it ages later)."""
        out: list[Hashable] = []
        seen: set[Hashable] = set()
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            out.append(key)
            dep = self._keys.dependent_of(key)
            blocks = self._keys.blocks_of(dep) if dep is not None else None
            if (
                dep not in seen
                and blocks
                and all(self._region.kind[b] == EVICTABLE for b in blocks)
            ):
                seen.add(dep)
                out.append(dep)
        return out

    def _evict_keys(self, keys: list[Hashable]) -> list[Evicted]:
        """Drop ``keys``: the sink sees them first, whole, while every byte is
        intact; then their evictable blocks go free and their live ones (held by
        a request) are simply no longer cached."""
        keys = self._with_dependents(keys)
        if not keys:
            return []
        victims = [
            Evicted(key=k, blocks=self._keys.blocks_of(k) or (), tag=self._keys.tag_of(k))
            for k in keys
        ]
        if self._write_down is not None:
            self._write_down(victims)
        for key in keys:
            for b in self._keys.drop(key).blocks:
                if self._region.kind[b] == EVICTABLE:
                    del self._lru[b]
                    self._region.free.push(b)
                    self._region.kind[b] = FREE
        return victims

    def evict(self, block: int) -> list[Evicted]:
        """Evict one specific evictable block now (and the rest of its key)."""
        return self.evict_many([block])

    def evict_many(self, blocks: Sequence[int]) -> list[Evicted]:
        """Evict these evictable blocks now, each with the whole key it holds: all
        checked first, the write-down sink sees every victim together while its
        bytes are intact, then each is evicted. Returns the keys dropped."""
        ids = [self._check_id(b) for b in blocks]
        bad = [b for b in ids if b not in self._lru]
        if bad or len(set(ids)) != len(ids):
            raise InvalidValueError(
                f"evict: blocks must be distinct and evictable, got {ids[:8]}"
                + (f" (block {bad[0]} is not evictable)" if bad else "")
            )
        return self._evict_keys([self._keys.key_of(b) for b in ids])
