"""One allocation for PAGE blocks and STATE slots, with a movable boundary.

One zeroed uint8 buffer holds both pools: PAGE blocks grow from offset 0
(block ``j`` at ``j * block_stride``), STATE slots from the top down (slot
``i`` at ``base + i * slot_stride``, the pool owning slots ``[first, total)``).
Kernels get per-layer views of both, made once over the whole buffer, so they
stay valid whichever way the boundary moves; block and slot ids never change
meaning, only which of them are in use.

Moving the boundary relocates live entries as whole units, one contiguous
copy each, issued as one batch; everything a move needs is checked before any
byte or id changes, and a refused move leaves the cache exactly as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..layout import (
    EntryField,
    EntryMajorArena,
    LayerMajorArena,
    entry_bytes_for,
    layout_fingerprint,
    min_slot_stride,
    strictest_alignment,
)
from ..spans import coalesce
from .blocks import BlockAllocator
from .states import StateAllocator


class BoundaryMoveError(RuntimeError):
    """A boundary move that cannot be completed; nothing was changed."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        self.needed, self.available = needed, available
        super().__init__(message)


def _check_move(op: str, n: object, limit: int, what: str) -> None:
    """Refuse a slot count that is not an int in ``0..limit``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{op}: n must be an int >= 0, got {n!r}")
    if n > limit:
        raise BoundaryMoveError(f"{op}({n}): only {limit} {what}", needed=n, available=limit)


@dataclass(frozen=True)
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


class UnifiedCache:
    """PAGE blocks and STATE slots carved from one buffer on ``device``.

    ``page_layout="layer_major"`` lays the PAGE region out as a
    :class:`LayerMajorArena` for kernels that need each layer contiguous; its
    region then cannot move, so the boundary is fixed and moves are refused.
    """

    def __init__(
        self,
        page_fields: Sequence[EntryField],
        state_fields: Sequence[EntryField],
        total_bytes: int,
        device: torch.device | str,
        *,
        state_slots: int,
        entries_per_req: int = 1,
        tokens_per_block: int = 0,
        on_evict: Callable[[int], None] | None = None,
        page_layout: str = "entry_major",
    ) -> None:
        if page_layout not in ("entry_major", "layer_major"):
            raise ValueError(
                f"page_layout must be 'entry_major' or 'layer_major', got {page_layout!r}"
            )
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes <= 0:
            raise ValueError(
                f"UnifiedCache: total_bytes must be a positive int, got {total_bytes!r}"
            )
        if not page_fields or not state_fields:
            raise ValueError("UnifiedCache needs both PAGE fields and STATE fields")
        self.device = torch.device(device)
        self.page_fields = tuple(page_fields)
        self.state_fields = tuple(state_fields)
        self.tokens_per_block = tokens_per_block
        self.page_layout = page_layout
        self.block_bytes = entry_bytes_for(page_fields)
        self.block_stride = min_slot_stride(page_fields)
        self.slot_bytes = entry_bytes_for(state_fields)
        self.slot_stride = min_slot_stride(state_fields)
        state_align = strictest_alignment(state_fields)
        top = total_bytes // state_align * state_align
        self.total_slots = top // self.slot_stride
        if not 0 <= state_slots <= self.total_slots:
            raise ValueError(
                f"UnifiedCache: state_slots {state_slots} out of range; {total_bytes:,} bytes hold "
                f"at most {self.total_slots} slots of {self.slot_stride:,} bytes"
            )
        self.slot_base = top - self.total_slots * self.slot_stride
        self.buf = torch.zeros(total_bytes, dtype=torch.uint8, device=self.device)
        self.max_blocks = total_bytes // self.block_stride
        self.state = EntryMajorArena(
            state_fields,
            self.total_slots,
            self.device,
            buf=self.buf[self.slot_base : top],
            slot_stride=self.slot_stride,
            live_entries=state_slots,
        )
        self.slots = StateAllocator(self.total_slots, state_slots, entries_per_req)
        if page_layout == "entry_major":
            blocks = self._blocks_below(self.slots.first)
            self.pages: EntryMajorArena | LayerMajorArena = EntryMajorArena(
                page_fields,
                self.max_blocks,
                self.device,
                buf=self.buf,
                slot_stride=self.block_stride,
                live_entries=0,
            )
            self._fill_pages(0, blocks)
        else:
            # Layer-major: field regions are sized by the block count, so the
            # count (and with it the boundary) is fixed at construction.
            blocks = self._boundary(self.slots.first) // self.block_bytes
            self.pages = LayerMajorArena(
                page_fields, blocks, self.device, buf=self.buf[: self.block_bytes * blocks]
            )
        self.blocks = BlockAllocator(blocks, on_evict=on_evict)
        self.page_fingerprint = layout_fingerprint(page_fields)
        self.state_fingerprint = layout_fingerprint(state_fields)

    # -- geometry --------------------------------------------------------------
    def _boundary(self, first_slot: int) -> int:
        """Byte offset where the STATE pool starts when it owns ``[first_slot, total)``."""
        return self.slot_base + first_slot * self.slot_stride

    def _blocks_below(self, first_slot: int) -> int:
        """Whole entry-major blocks that fit below the STATE pool's first slot."""
        return self._boundary(first_slot) // self.block_stride

    @property
    def num_blocks(self) -> int:
        return self.blocks.capacity

    @property
    def num_slots(self) -> int:
        return self.slots.capacity

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.tokens_per_block

    def page_view(self, name: str) -> torch.Tensor:
        """``[layers, max_blocks, *shape]``: ids below ``num_blocks`` are the pool's."""
        return self.pages.view(name)

    def state_view(self, name: str) -> torch.Tensor:
        """``[layers, total_slots, *shape]``: slots ``>= slots.first`` are the pool's."""
        return self.state.view(name)

    def block_bytes_of(self, block: int) -> torch.Tensor:
        if not isinstance(self.pages, EntryMajorArena):
            raise ValueError("a layer-major PAGE region has no contiguous block; use page_view")
        return self.pages.entry(block)

    def slot_bytes_of(self, slot: int) -> torch.Tensor:
        return self.state.entry(slot)

    # -- requests --------------------------------------------------------------
    def allocate_state(self, request: Hashable) -> tuple[int, ...]:
        """Slots for a new request, reset to the fields' fills (padding zero).

        Slots are reset here, when they are handed out, rather than when they
        are freed or won from the PAGE pool: whatever a slot held before (a
        finished request, KV bytes), a request always starts from a clean state.
        """
        slots = self.slots.allocate(request)
        for s in slots:
            self._reset_slot(s)
        return slots

    def free_state(self, request: Hashable) -> tuple[int, ...]:
        return self.slots.free(request)

    def _reset_slot(self, slot: int) -> None:
        self.state.entry(slot).zero_()
        for f in self.state_fields:
            if not f.fill_is_zero_bits:
                self.state.view(f.name)[:, slot].fill_(f.fill)

    def _fill_pages(self, lo: int, hi: int) -> None:
        for f in self.page_fields:
            if not f.fill_is_zero_bits:
                self.pages.view(f.name)[:, lo:hi].fill_(f.fill)

    def _fixed(self) -> None:
        if self.page_layout == "layer_major":
            raise BoundaryMoveError(
                "the PAGE region is layer-major, so its blocks cannot move: the boundary is "
                "fixed for this cache (use page_layout='entry_major' for a movable boundary)",
                needed=0,
                available=0,
            )

    def _copy(
        self, moves: list[tuple[int, int]], stride: int, nbytes: int, base: int
    ) -> tuple[int, int]:
        """One contiguous copy per moved entry, or per run of entries that are
        consecutive on both sides (when ``nbytes`` fills the stride). Sources
        lie in the released range and targets outside it, so no copy reads
        bytes another one wrote."""
        if not moves:
            return 0, 0
        pairs = np.array(moves, dtype=np.int64)
        src, dst, length = (
            base + pairs[:, 0] * stride,
            base + pairs[:, 1] * stride,
            np.full(len(moves), nbytes),
        )
        src, dst, length = coalesce(src, dst, length)
        for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
            self.buf[d : d + n].copy_(self.buf[s : s + n])
        return int(src.size), len(moves) * nbytes

    # -- the movable boundary --------------------------------------------------
    def plan_grow_state(self, n: int) -> tuple[int, list[int], list[int], list[int]]:
        """(new block count, free going, evictable going, live going) for growing by n."""
        _check_move("grow_state", n, self.slots.first, "slots remain below the STATE pool")
        new_blocks = min(self.blocks.capacity, self._blocks_below(self.slots.first - n))
        going = range(new_blocks, self.blocks.capacity)
        free = [b for b in going if self.blocks.is_free(b)]
        evictable = [b for b in going if self.blocks.is_evictable(b)]
        live = [b for b in going if self.blocks.refcount(b) > 0]
        return new_blocks, free, evictable, live

    def grow_state(self, n: int) -> BoundaryMove:
        """Give ``n`` more slots to STATE: blocks under them are dropped if free,
        evicted if evictable, relocated below the new boundary if live."""
        self._fixed()
        new_blocks, free, evictable, live = self.plan_grow_state(n)
        room_free = self.blocks.free_blocks_below(new_blocks)  # evictions above do not add to it
        room_evict = [b for b in self.blocks.evictable_blocks() if b < new_blocks]  # LRU first
        if len(live) > len(room_free) + len(room_evict):
            raise BoundaryMoveError(
                f"grow_state({n}): {len(live)} live blocks sit above the new boundary (block "
                f"{new_blocks}) but only {len(room_free)} free and {len(room_evict)} evictable blocks "
                "lie below it",
                needed=len(live),
                available=len(room_free) + len(room_evict),
            )
        before = (self.blocks.capacity, self.slots.capacity)
        evicted = list(evictable)
        for b in evictable:
            self.blocks.evict(b)
        targets = room_free[: len(live)]
        for b in room_evict[: len(live) - len(targets)]:
            self.blocks.evict(b)
            evicted.append(b)
            targets.append(b)
        targets.sort()
        moves = list(zip(live, targets, strict=True))
        ops, copied = self._copy(moves, self.block_stride, self.block_bytes, 0)
        for old, new in moves:
            self.blocks.move(old, new)
        self.blocks.shrink(new_blocks)
        self.slots.grow(n)
        return BoundaryMove(
            before[0], self.blocks.capacity, before[1], self.slots.capacity,
            dict(moves), {}, tuple(free), tuple(evicted), ops, copied,
        )  # fmt: skip

    def shrink_state(self, n: int) -> BoundaryMove:
        """Give ``n`` slots back to PAGE: live states in them move to free higher slots."""
        self._fixed()
        _check_move("shrink_state", n, self.slots.capacity, "slots are in the STATE pool")
        first = self.slots.first
        released = range(first, first + n)
        live = [s for s in released if self.slots.owner(s) is not None]
        room = [s for s in range(first + n, self.slots.total) if self.slots.is_free(s)]
        if len(live) > len(room):
            raise BoundaryMoveError(
                f"shrink_state({n}): {len(live)} live states sit in the released slots but only "
                f"{len(room)} free slots remain above them",
                needed=len(live),
                available=len(room),
            )
        before = (self.blocks.capacity, self.slots.capacity)
        moves = list(zip(live, sorted(room, reverse=True)[: len(live)], strict=True))
        ops, copied = self._copy(moves, self.slot_stride, self.slot_bytes, self.slot_base)
        for old, new in moves:
            self.slots.move(old, new)
        self.slots.shrink(n)
        old_blocks = self.blocks.capacity
        self.blocks.grow(self._blocks_below(self.slots.first))
        self._fill_pages(old_blocks, self.blocks.capacity)
        return BoundaryMove(
            before[0], self.blocks.capacity, before[1], self.slots.capacity,
            {}, dict(moves), (), (), ops, copied,
        )  # fmt: skip

    # -- policy ------------------------------------------------------------------
    def rebalance(self, *, waiting_requests: int, blocks_needed: int) -> BoundaryMove | None:
        """Move the boundary toward current demand, or return None if no move helps.

        Slots short for waiting requests: grow STATE as far as the ladder
        (free -> evict -> relocate) allows while keeping ``blocks_needed``
        blocks obtainable. Blocks short: shrink STATE by the free slots it
        can spare. Never raises for lack of room; it moves what it can.
        """
        self._fixed()
        slot_deficit = waiting_requests * self.slots.entries_per_req - self.slots.num_free
        obtainable = self.blocks.num_free + self.blocks.num_evictable
        if slot_deficit > 0:
            # The largest n <= deficit that keeps blocks_needed obtainable and relocatable.
            for n in range(min(slot_deficit, self.slots.first), 0, -1):
                kept = min(self.blocks.capacity, self._blocks_below(self.slots.first - n))
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
