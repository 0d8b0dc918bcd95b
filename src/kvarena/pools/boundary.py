"""The movable boundary between PAGE blocks and STATE slots.

Moving the boundary relocates live entries as whole units, one contiguous
copy each, issued as one batch; everything a move needs is checked before
any byte or id changes, and a refused move leaves the cache exactly as it
was. A move returns what it did (:class:`BoundaryMove`); the cache remaps
the holdings registered with it in place, and evicted keys went through the
block allocator's write-down sink before their blocks were reused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import check_count
from ..copy import CopyBatch, CopyStats, execute_batch
from ..errors import Error
from ..layout import EntryMajorArena, LayerMajorArena
from .blocks import BlockAllocator
from .geometry import PoolGeometry
from .holdings import Holdings
from .states import StateAllocator


class BoundaryMoveError(Error, RuntimeError):
    """A boundary move that cannot be completed; nothing was changed."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        self.needed, self.available = needed, available
        super().__init__(message)


def _check_move(op: str, n: object, limit: int, what: str) -> int:
    """A slot count: not an int >= 0 is a bad value; one above ``limit`` a refused move."""
    n = check_count(n, f"{op}: n")
    if n > limit:
        raise BoundaryMoveError(f"{op}({n}): only {limit} {what}", needed=n, available=limit)
    return n


@dataclass(frozen=True, kw_only=True)
class BoundaryMove:
    """What a move did: the new counts and the remaps an engine must apply."""

    blocks_before: int
    blocks_after: int
    slots_before: int
    slots_after: int
    block_remap: dict[int, int]
    slot_remap: dict[int, int]
    dropped_blocks: tuple[int, ...]
    evicted_blocks: tuple[int, ...]
    copies: int
    copied_bytes: int


def copy_entries(
    buf: torch.Tensor, src: np.ndarray, dst: np.ndarray, base: int, stride: int, nbytes: int
) -> CopyStats:
    """Entry ``src[i]`` into entry ``dst[i]`` of a pool at ``base`` with ``stride``
    in ``buf``, ``nbytes`` of each, as one described batch (evenly spaced
    entries are one copy)."""
    return execute_batch(
        CopyBatch(base + src * stride, base + dst * stride, np.full(src.size, nbytes)), buf, buf
    )


class BoundaryMover:
    """Boundary moves and the policy that asks for them, over one cache's
    buffer, pools and holdings (an object the :class:`UnifiedCache` holds,
    given them at construction; ``moves`` counts the moves so far, for a
    holder of views over ids to ask)."""

    def __init__(
        self,
        *,
        buf: torch.Tensor,
        pages: EntryMajorArena | LayerMajorArena,
        blocks: BlockAllocator,
        slots: StateAllocator,
        holdings: Holdings,
        geometry: PoolGeometry,
        page_layout: str,
        page_fields: tuple,
        state_fields: tuple,
        block_stride: int,
        slot_stride: int,
        slot_base: int,
    ) -> None:
        self.buf, self.pages, self.blocks, self.slots = buf, pages, blocks, slots
        self.holdings, self.geometry, self.page_layout = holdings, geometry, page_layout
        self.page_fields, self.state_fields = page_fields, state_fields
        self.block_stride, self.slot_stride, self.slot_base = block_stride, slot_stride, slot_base
        self.moves = 0

    def _fixed(self) -> None:
        if self.page_layout == "layer_major":
            raise BoundaryMoveError(
                "the PAGE region is layer-major, so its blocks cannot move: the boundary is "
                "fixed for this cache (use page_layout='entry_major' for a movable boundary)",
                needed=0,
                available=0,
            )
        if not self.state_fields:
            raise BoundaryMoveError(
                "this cache has no STATE pool, so there is no boundary to move",
                needed=0,
                available=0,
            )

    def _copy(self, pairs: np.ndarray, stride: int, base: int) -> tuple[int, int]:
        """Relocate whole strides (not just the fields' bytes: an image unit may use a
        block's tail) as ONE described batch, the checkpoints' machinery: runs
        consecutive on both sides coalesce and evenly spaced moves are one
        strided copy. Sources lie in the released range and
        targets outside it, so no copy reads bytes another one writes (the batch
        validation checks it again)."""
        stats = copy_entries(self.buf, pairs[:, 0], pairs[:, 1], base, stride, stride)
        return stats.ops, stats.nbytes

    def _completed(
        self,
        before: tuple[int, int],
        block_remap: dict[int, int],
        slot_remap: dict[int, int],
        dropped: tuple[int, ...],
        evicted: tuple[int, ...],
        ops: int,
        copied: int,
    ) -> BoundaryMove:
        """The record of a move just applied (and one more move counted)."""
        self.moves += 1
        return BoundaryMove(
            blocks_before=before[0],
            blocks_after=self.blocks.capacity,
            slots_before=before[1],
            slots_after=self.slots.capacity,
            block_remap=block_remap,
            slot_remap=slot_remap,
            dropped_blocks=dropped,
            evicted_blocks=evicted,
            copies=ops,
            copied_bytes=copied,
        )

    # -- the movable boundary --------------------------------------------------
    def plan_grow_state(self, n: int) -> tuple[int, list[int], list[int], list[int]]:
        """(new block count, free going, evictable going, live going) for growing by n."""
        n = _check_move("grow_state", n, self.slots.first, "slots remain below the STATE pool")
        new_blocks = min(self.blocks.capacity, self.geometry.blocks_below(self.slots.first - n))
        free, evictable, live = self.blocks.partition(new_blocks, self.blocks.capacity)
        return new_blocks, free, evictable, live

    def grow_state(self, n: int) -> BoundaryMove:
        """Give ``n`` more slots to STATE: blocks under them are dropped if free,
        evicted if evictable, relocated below the new boundary if live."""
        self._fixed()
        new_blocks, free, evictable, live = self.plan_grow_state(n)
        # Free blocks below the new boundary: all free ones but those going
        # (evictions above it do not add to them). Only the lowest few are named.
        free_below = self.blocks.num_free - len(free)
        room_free = self.blocks.free_blocks_below(new_blocks, len(live))
        room_evict = (
            [b for b in self.blocks.evictable_blocks() if b < new_blocks]  # LRU first
            if len(live) > free_below
            else []
        )
        pinned = sorted(self.holdings.fixed_blocks().intersection(live))
        if pinned:
            raise BoundaryMoveError(
                f"grow_state({n}): blocks {pinned[:8]} above the new boundary (block "
                f"{new_blocks}) are read or written by a peer by address (a transfer in flight); they "
                "cannot move until it lands or is released",
                needed=len(pinned),
                available=0,
            )
        if len(live) > free_below + len(room_evict):
            raise BoundaryMoveError(
                f"grow_state({n}): {len(live)} live blocks sit above the new boundary (block "
                f"{new_blocks}) but only {free_below} free and {len(room_evict)} evictable blocks "
                "lie below it",
                needed=len(live),
                available=free_below + len(room_evict),
            )
        before = (self.blocks.capacity, self.slots.capacity)
        targets = room_free[: len(live)]
        taken = room_evict[: len(live) - len(targets)]
        # One batch, before any byte moves: the write-down sink sees every victim
        # intact. A victim's key may take more blocks with it (an image's other
        # units, the image worthless without an evicted block): all are freed.
        victims = self.blocks.evict_many([*evictable, *taken])
        # What the evictions freed (a victim key's block a request still holds stays live).
        evicted = tuple(sorted(b for v in victims for b in v.blocks if self.blocks.is_free(b)))
        targets.extend(taken)
        targets.sort()
        pairs = np.column_stack((live, targets)).astype(np.int64).reshape(-1, 2)
        ops, copied = self._copy(pairs, self.block_stride, 0)
        self.blocks.move_many(pairs)
        self.blocks.shrink(self.blocks.capacity - new_blocks)
        self.slots.grow(n)
        block_remap = dict(zip(live, targets, strict=True))
        self.holdings.remap_blocks(block_remap)
        return self._completed(before, block_remap, {}, tuple(free), evicted, ops, copied)

    def shrink_state(self, n: int) -> BoundaryMove:
        """Give ``n`` slots back to PAGE: live states in them move to free higher slots."""
        self._fixed()
        n = _check_move("shrink_state", n, self.slots.capacity, "slots are in the STATE pool")
        first = self.slots.first
        released = range(first, first + n)
        live = [s for s in released if not self.slots.is_free(s)]
        pinned = sorted(self.holdings.fixed_slots().intersection(live))
        if pinned:
            raise BoundaryMoveError(
                f"shrink_state({n}): slots {pinned[:8]} are read or written by a peer by address (a "
                "transfer in flight); they cannot move until it lands or is released",
                needed=len(pinned),
                available=0,
            )
        room = [s for s in range(first + n, self.slots.total) if self.slots.is_free(s)]
        if len(live) > len(room):
            raise BoundaryMoveError(
                f"shrink_state({n}): {len(live)} live states sit in the released slots but only "
                f"{len(room)} free slots remain above them",
                needed=len(live),
                available=len(room),
            )
        before = (self.blocks.capacity, self.slots.capacity)
        # The highest free slots take them, paired in ascending order: a run of
        # states keeps its order (a request's consecutive slots stay ascending)
        # and evenly spaced moves stay one strided copy.
        targets = sorted(sorted(room, reverse=True)[: len(live)])
        moves = list(zip(live, targets, strict=True))
        pairs = np.array(moves, dtype=np.int64).reshape(-1, 2)
        ops, copied = self._copy(pairs, self.slot_stride, self.slot_base)
        for old, new in moves:
            self.slots.move(old, new)
        self.slots.shrink(n)
        old_blocks = self.blocks.capacity
        self.blocks.grow(self.geometry.blocks_below(self.slots.first) - old_blocks)
        self.pages.fill_entries(slice(old_blocks, self.blocks.capacity))
        return self._completed(before, {}, dict(moves), (), (), ops, copied)

    # -- policy ------------------------------------------------------------------
    def rebalance(self, *, waiting_requests: int, blocks_needed: int) -> BoundaryMove | None:
        """Move the boundary toward current demand, or return None if no move helps.

        Slots short for waiting requests: grow STATE as far as the ladder
        (free -> evict -> relocate) allows while keeping ``blocks_needed``
        blocks obtainable. Blocks short: shrink STATE by the free slots it
        can spare. Never raises for lack of room; it moves what it can. A
        cache whose boundary cannot move (no STATE or no PAGE pool, a
        layer-major PAGE region) has no move that helps: None.
        """
        waiting_requests = check_count(waiting_requests, "rebalance: waiting_requests")
        blocks_needed = check_count(blocks_needed, "rebalance: blocks_needed")
        if self.page_layout == "layer_major" or not self.state_fields or not self.page_fields:
            return None
        slot_deficit = waiting_requests * self.slots.entries_per_req - self.slots.num_free
        obtainable = self.blocks.num_free + self.blocks.num_evictable
        if slot_deficit > 0:
            # The largest n <= deficit that keeps blocks_needed obtainable and relocatable.
            for n in range(min(slot_deficit, self.slots.first), 0, -1):
                kept = min(self.blocks.capacity, self.geometry.blocks_below(self.slots.first - n))
                # Blocks going are either dropped or take a free block below:
                # free + evictable shrinks by exactly the blocks given up.
                if obtainable - (self.blocks.capacity - kept) < blocks_needed:
                    continue
                try:
                    return self.grow_state(n)
                except BoundaryMoveError:
                    continue
            return None
        block_deficit = blocks_needed - obtainable
        if block_deficit > 0:
            per_slot = self.slot_stride / self.block_stride
            want = min(math.ceil(block_deficit / per_slot) + 1, self.slots.num_free)
            for n in range(want, 0, -1):
                try:
                    return self.shrink_state(n)
                except BoundaryMoveError:
                    continue
        return None
