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
from functools import cached_property

import numpy as np
import torch

from ..checkpoint import CheckpointSpec, PageUnits, restore, store
from ..checks import check_bytes, check_choice, check_count, check_device, check_int
from ..copy import CopyBatch, CopyStats, execute_batch
from ..errors import Error, InvalidValueError
from ..layout import EntryMajorArena, LayerMajorArena
from ..layout.regions import aligned_zeros
from .blocks import BlockAllocator
from .plan import CachePlan
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


@dataclass(frozen=True)
class _BlockReader:
    """Blocks as the source of block images: live or cached ones may be read."""

    blocks: BlockAllocator

    def check_held(self, slots: object, what: str) -> np.ndarray:
        return self.blocks.check_held(slots, f"{what} (blocks)", writing=False)


@dataclass(frozen=True)
class _BlockWriter:
    """Blocks as the target of block images: only live ones may be written."""

    blocks: BlockAllocator

    def check_held(self, slots: object, what: str) -> np.ndarray:
        return self.blocks.check_held(slots, f"{what} (blocks)", writing=True)


class UnifiedCache:
    """PAGE blocks and STATE slots carved from one buffer on ``device``.

    Built from a :class:`~kvarena.pools.plan.CachePlan` only
    (:meth:`from_plan`), so it holds exactly the blocks and slots the plan
    promised. A model with only paged layers has no STATE pool, one with only
    recurrent layers no PAGE pool; the boundary then has nothing to move past.

    ``page_layout="layer_major"`` lays the PAGE region out as a
    :class:`LayerMajorArena` for kernels that need each layer contiguous; its
    region then cannot move, so the boundary is fixed and moves are refused.
    """

    def __init__(
        self,
        plan: CachePlan,
        device: torch.device | str,
        *,
        on_evict: Callable[[int], None] | None = None,
        before_evict: Callable[[list[int]], None] | None = None,
        page_layout: str = "entry_major",
    ) -> None:
        if not isinstance(plan, CachePlan):
            raise InvalidValueError(
                f"UnifiedCache: plan must be a CachePlan (from kvarena.plan_cache), "
                f"got {type(plan).__name__}"
            )
        check_choice(page_layout, "page_layout", ("entry_major", "layer_major"))
        if page_layout == "layer_major" and not plan.page_fields:
            raise InvalidValueError(
                "page_layout='layer_major' needs PAGE fields; this plan has none"
            )
        self.device = check_device(device)
        self.plan = plan
        self.page_fields = plan.page_fields
        self.state_fields = plan.state_fields
        self.block_size = plan.block_size
        self.page_layout = page_layout
        self.block_bytes, self.block_stride = plan.block_bytes, plan.block_stride
        self.slot_bytes, self.slot_stride = plan.slot_bytes, plan.slot_stride
        self.geometry = g = plan.geometry
        self.total_slots, self.slot_base, self.max_blocks = g.total_slots, g.slot_base, g.max_blocks
        self.page_fingerprint = plan.page_fingerprint
        self.state_fingerprint = plan.state_fingerprint
        self.buf = aligned_zeros(plan.budget_bytes, plan.alignment, self.device)
        self.state = EntryMajorArena(
            self.state_fields,
            self.total_slots,
            self.device,
            buf=self.buf[self.slot_base : g.top],
            slot_stride=self.slot_stride or None,
            # Liveness is the allocator's, never a count fixed here: the arena
            # itself claims no live entry (so a raw kvarena.store over it is
            # refused), and the plan's slots get their fills below.
            live_entries=0,
        )
        self.state.fill_entries(slice(self.total_slots - plan.state_slots, self.total_slots))
        self.slots = StateAllocator(self.total_slots, plan.state_slots, plan.entries_per_req)
        blocks = plan.blocks
        if page_layout == "entry_major":
            self.pages: EntryMajorArena | LayerMajorArena = EntryMajorArena(
                self.page_fields,
                self.max_blocks,
                self.device,
                buf=self.buf,
                slot_stride=self.block_stride or None,
                live_entries=0,
            )
            self.pages.fill_entries(slice(0, blocks))
        else:
            # Layer-major: field regions are sized by the block count, so the
            # count (and with it the boundary) is fixed at construction. Its
            # stride is block_bytes per layer, so it needs no more bytes than
            # the entry-major plan it was promised from.
            self.pages = LayerMajorArena(
                self.page_fields, blocks, self.device, buf=self.buf[: self.block_bytes * blocks]
            )
            self.pages.fill_entries(slice(None))
        self.blocks = BlockAllocator(blocks, on_evict=on_evict, before_evict=before_evict)
        self._listeners: list[Callable[[BoundaryMove], None]] = []

    @classmethod
    def from_plan(
        cls,
        plan: CachePlan,
        device: torch.device | str,
        *,
        on_evict: Callable[[int], None] | None = None,
        before_evict: Callable[[list[int]], None] | None = None,
        page_layout: str = "entry_major",
    ) -> UnifiedCache:
        """The cache a plan promised: ``num_blocks == plan.blocks``, ``num_slots == plan.state_slots``.

        ``on_evict(block)`` runs after each operation that evicted, per block;
        ``before_evict(blocks)`` before it, while the victims still hold their
        bytes (see :class:`BlockAllocator`)."""
        return cls(
            plan, device, on_evict=on_evict, before_evict=before_evict, page_layout=page_layout
        )

    # -- geometry --------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.blocks.capacity

    @property
    def num_slots(self) -> int:
        return self.slots.capacity

    @property
    def has_state(self) -> bool:
        return bool(self.state_fields)

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def page_view(self, name: str) -> torch.Tensor:
        """``[layers, max_blocks, *shape]``: ids below ``num_blocks`` are the pool's."""
        return self.pages.view(name)

    def state_view(self, name: str) -> torch.Tensor:
        """``[layers, total_slots, *shape]``: slots ``>= slots.first`` are the pool's."""
        return self.state.view(name)

    def _block_pages(self, what: str) -> EntryMajorArena:
        """The PAGE pool, for what needs each block as one contiguous entry
        (block bytes, images, block copies); refused for a layer-major pool or
        a cache without PAGE fields."""
        if not self.page_fields or not isinstance(self.pages, EntryMajorArena):
            raise InvalidValueError(
                f"{what} needs an entry-major PAGE pool (a block is one contiguous entry); "
                + (
                    "this cache's is layer-major, with no contiguous block: use page_view"
                    if self.page_fields
                    else "this cache has no PAGE fields"
                )
            )
        return self.pages

    def block_bytes_of(self, block: int) -> torch.Tensor:
        """Block ``block``'s field bytes (``block_bytes``); the id must be in the PAGE pool now."""
        pages = self._block_pages("block_bytes_of")
        return pages.entry(check_int(block, "block id", lo=0, hi=self.num_blocks - 1))

    def slot_bytes_of(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s field bytes (``slot_bytes``); the id must be in the STATE pool now."""
        return self.state.entry(
            check_int(slot, "slot id", lo=self.slots.first, hi=self.total_slots - 1)
        )

    # -- checkpoint images -------------------------------------------------------
    def checkpoint_spec(self, unit_bytes: int | None = None) -> CheckpointSpec:
        """The image plan of this cache's state, in units of ``unit_bytes`` (default: a
        whole block stride, so one image takes the fewest blocks)."""
        unit = self.block_stride if unit_bytes is None else unit_bytes
        key = check_bytes(unit, "unit_bytes", lo=1)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = CheckpointSpec.build(self.state_fields, key)
        return spec

    @cached_property
    def _specs(self) -> dict[int, CheckpointSpec]:
        return {}

    def page_units(self, unit_bytes: int | None = None) -> PageUnits:
        """The PAGE pool seen as image units: unit ``u`` is block ``u``'s first
        ``unit_bytes`` bytes (default the whole block stride).

        The units' liveness is the block allocator's, read at each copy, so the
        same object stays true across boundary moves.
        """
        self._block_pages("image units")
        unit = self.block_stride if unit_bytes is None else unit_bytes
        unit = check_bytes(unit, "unit_bytes", lo=1)
        if unit > self.block_stride:
            raise InvalidValueError(
                f"unit_bytes {unit} exceeds the block stride {self.block_stride}; a unit is one block"
            )
        return PageUnits(
            buf=self.buf,
            unit_bytes=unit,
            unit_stride=self.block_stride,
            num_units=self.max_blocks,
            holder=self.blocks,
        )

    def store(
        self, spec: CheckpointSpec, slots: Sequence[int], unit_lists: Sequence[Sequence[int]]
    ) -> CopyStats:
        """Copy each slot's checkpoint image into its units (blocks it holds live)."""
        return store(
            spec,
            self.state,
            slots,
            self.page_units(spec.unit_bytes),
            unit_lists,
            slot_holder=self.slots,
        )

    def restore(
        self, spec: CheckpointSpec, unit_lists: Sequence[Sequence[int]], slots: Sequence[int]
    ) -> CopyStats:
        """Copy each image back into a slot a request holds."""
        return restore(
            spec,
            self.page_units(spec.unit_bytes),
            unit_lists,
            self.state,
            slots,
            slot_holder=self.slots,
        )

    def block_checkpoint_spec(self, unit_bytes: int | None = None) -> CheckpointSpec:
        """The image plan of one KV block (its PAGE fields), in units of ``unit_bytes``
        (default a whole block stride): what :meth:`store_blocks` writes."""
        self._block_pages("block images")
        unit = self.block_stride if unit_bytes is None else unit_bytes
        key = -check_bytes(unit, "unit_bytes", lo=1)  # negative keys: PAGE specs
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = CheckpointSpec.build(self.page_fields, -key)
        return spec

    def store_blocks(
        self, spec: CheckpointSpec, blocks: Sequence[int], unit_lists: Sequence[Sequence[int]]
    ) -> CopyStats:
        """Copy each block's bytes (a live or cached block) into image units (blocks
        held live): a KV block kept aside, e.g. before it is overwritten."""
        return store(
            spec,
            self._block_pages("store_blocks"),
            blocks,
            self.page_units(spec.unit_bytes),
            unit_lists,
            slot_holder=_BlockReader(self.blocks),
        )

    def restore_blocks(
        self, spec: CheckpointSpec, unit_lists: Sequence[Sequence[int]], blocks: Sequence[int]
    ) -> CopyStats:
        """Copy block images back into live blocks."""
        pages = self._block_pages("restore_blocks")
        return restore(
            spec,
            self.page_units(spec.unit_bytes),
            unit_lists,
            pages,
            blocks,
            slot_holder=_BlockWriter(self.blocks),
        )

    # -- requests --------------------------------------------------------------
    def allocate_state(self, request: Hashable) -> tuple[int, ...]:
        """Slots for a new request, reset to the fields' fills (padding zero).

        Slots are reset here, when they are handed out, rather than when they
        are freed or won from the PAGE pool: whatever a slot held before (a
        finished request, KV bytes), a request always starts from a clean state.
        """
        if not self.state_fields:
            raise InvalidValueError(
                f"{self.plan.model} keeps no per-request state (no STATE fields); "
                "its requests hold blocks only"
            )
        slots = self.slots.allocate(request)
        for s in slots:
            self.state.entry(s).zero_()
            self.state.fill_entries(s)
        return slots

    def allocate_states(self, requests: Sequence[Hashable]) -> list[tuple[int, ...]]:
        """Slots for a batch of new requests, reset like :meth:`allocate_state`:
        one run of consecutive ascending slots where the free slots hold one, so
        :meth:`state_rows` can give the batch's states as one strided view."""
        if not self.state_fields:
            raise InvalidValueError(
                f"{self.plan.model} keeps no per-request state (no STATE fields); "
                "its requests hold blocks only"
            )
        groups = self.slots.allocate_batch(requests)
        for slots in groups:
            for s in slots:
                self.state.entry(s).zero_()
                self.state.fill_entries(s)
        return groups

    def free_state(self, request: Hashable) -> tuple[int, ...]:
        return self.slots.free(request)

    def state_rows(self, name: str, slots: Sequence[int]) -> torch.Tensor | None:
        """``[layers, len(slots), *shape]`` of field ``name`` as a VIEW into the
        slots' bytes when the slots are consecutive and ascending (a kernel that
        updates it in place updates the cache); None when no strided view can
        express them (use :meth:`gather_states` / :meth:`scatter_states`)."""
        ids = self.slots.check_held(slots, "state_rows: slots")
        if ids.size == 0:
            raise InvalidValueError("state_rows: slots must name at least one slot")
        first = int(ids[0])
        if not np.array_equal(ids, np.arange(first, first + ids.size)):
            return None
        return self.state.view(name)[:, first : first + ids.size]

    def gather_states(self, name: str, slots: Sequence[int]) -> torch.Tensor:
        """A copy ``[layers, len(slots), *shape]`` of field ``name`` over any held slots."""
        ids = self.slots.check_held(slots, "gather_states: slots")
        index = torch.as_tensor(ids, device=self.device)
        return self.state.view(name).index_select(1, index)

    def scatter_states(self, name: str, slots: Sequence[int], values: torch.Tensor) -> None:
        """Write ``values`` (``[layers, len(slots), *shape]``) into field ``name``
        of the slots (the inverse of :meth:`gather_states`)."""
        ids = self.slots.check_held(slots, "scatter_states: slots")
        if len(set(ids.tolist())) != ids.size:
            raise InvalidValueError(f"scatter_states: slots repeat: {ids.tolist()}")
        view = self.state.view(name)
        want = (view.shape[0], ids.size, *view.shape[2:])
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != want:
            raise InvalidValueError(
                f"scatter_states: values must be a tensor of shape {want}, got "
                f"{tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__}"
            )
        if values.dtype != view.dtype:
            raise InvalidValueError(
                f"scatter_states: values are {values.dtype}; field {name!r} holds {view.dtype}"
            )
        view.index_copy_(1, torch.as_tensor(ids, device=self.device), values.to(self.device))

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole state entries: slot ``src[i]``'s bytes into slot ``dst[i]``.

        Each state moves as one unit (all its layers and fields). The slots may
        overlap as sets — a beam reorder is a permutation — so when a source is
        also a target every source is read before any target is written."""
        s = self.slots.check_held(src, "copy_slots: src")
        d = self.slots.check_held(dst, "copy_slots: dst")
        if s.size != d.size:
            raise InvalidValueError(
                f"copy_slots: {s.size} sources but {d.size} targets; they pair one to one"
            )
        if len(set(d.tolist())) != d.size:
            raise InvalidValueError(f"copy_slots: targets repeat: {d.tolist()}")
        keep = s != d
        s, d = s[keep], d[keep]
        if s.size == 0:
            return
        if set(s.tolist()) & set(d.tolist()):
            rows = self._rows(self.slot_base, self.slot_stride, self.total_slots)
            staged = rows.index_select(0, torch.as_tensor(s, device=self.device))
            rows.index_copy_(0, torch.as_tensor(d, device=self.device), staged)
            return
        self._copy_entries(s, d, self.slot_base, self.slot_stride, self.slot_bytes)

    def fork_state(self, request: Hashable, new_request: Hashable) -> tuple[int, ...]:
        """Slots for ``new_request`` holding a copy of ``request``'s states (every
        entry, rollback copies included), e.g. a beam or a parallel sample."""
        src = self.slots.slots_of(request)
        dst = self.slots.allocate(new_request)
        self.copy_slots(src, dst)
        return dst

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole blocks (every layer of each), ``src[i]`` into ``dst[i]``:
        the copy half of copy-on-write. Targets must be held for writing."""
        self._block_pages("copy_blocks")
        s = self.blocks.check_held(src, "copy_blocks: src", writing=False)
        d = self.blocks.check_held(dst, "copy_blocks: dst", writing=True)
        if s.size != d.size:
            raise InvalidValueError(
                f"copy_blocks: {s.size} sources but {d.size} targets; they pair one to one"
            )
        self._copy_entries(s, d, 0, self.block_stride, self.block_bytes)

    def _copy_entries(
        self, src: np.ndarray, dst: np.ndarray, base: int, stride: int, nbytes: int
    ) -> CopyStats:
        """Entry ``src[i]`` into entry ``dst[i]`` of a pool at ``base`` with ``stride``,
        ``nbytes`` of each, as one described batch (evenly spaced entries are one copy)."""
        return execute_batch(
            CopyBatch(base + src * stride, base + dst * stride, np.full(src.size, nbytes)),
            self.buf,
            self.buf,
        )

    def _rows(self, base: int, stride: int, count: int) -> torch.Tensor:
        return self.buf[base : base + stride * count].view(count, stride)

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
        stats = self._copy_entries(pairs[:, 0], pairs[:, 1], base, stride, stride)
        return stats.ops, stats.nbytes

    def add_move_listener(self, listener: Callable[[BoundaryMove], None]) -> None:
        """Call ``listener(move)`` after every completed boundary move (after the
        eviction callbacks), so whoever keeps block or slot ids (a prefix cache)
        follows the remaps itself."""
        if not callable(listener):
            raise InvalidValueError(f"a move listener must be callable, got {listener!r}")
        self._listeners.append(listener)

    def _moved(self, move: BoundaryMove) -> None:
        for listener in self._listeners:
            listener(move)

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
        if len(live) > free_below + len(room_evict):
            raise BoundaryMoveError(
                f"grow_state({n}): {len(live)} live blocks sit above the new boundary (block "
                f"{new_blocks}) but only {free_below} free and {len(room_evict)} evictable blocks "
                "lie below it",
                needed=len(live),
                available=free_below + len(room_evict),
            )
        before = (self.blocks.capacity, self.slots.capacity)
        evicted = list(evictable)
        # Eviction callbacks run once the move is complete (see BlockAllocator).
        with self.blocks.deferred_callbacks():
            targets = room_free[: len(live)]
            taken = room_evict[: len(live) - len(targets)]
            # One batch, before any byte moves: before_evict sees every victim intact.
            self.blocks.evict_many([*evictable, *taken])
            evicted.extend(taken)
            targets.extend(taken)
            targets.sort()
            pairs = np.column_stack((live, targets)).astype(np.int64).reshape(-1, 2)
            ops, copied = self._copy(pairs, self.block_stride, 0)
            self.blocks.move_many(pairs)
            self.blocks.shrink(self.blocks.capacity - new_blocks)
            self.slots.grow(n)
        move = BoundaryMove(
            blocks_before=before[0],
            blocks_after=self.blocks.capacity,
            slots_before=before[1],
            slots_after=self.slots.capacity,
            block_remap=dict(zip(live, targets, strict=True)),
            slot_remap={},
            dropped_blocks=tuple(free),
            evicted_blocks=tuple(evicted),
            copies=ops,
            copied_bytes=copied,
        )
        try:
            self.blocks.notify_evicted(move)
        finally:
            self._moved(move)
        return move

    def shrink_state(self, n: int) -> BoundaryMove:
        """Give ``n`` slots back to PAGE: live states in them move to free higher slots."""
        self._fixed()
        n = _check_move("shrink_state", n, self.slots.capacity, "slots are in the STATE pool")
        first = self.slots.first
        released = range(first, first + n)
        live = [s for s in released if not self.slots.is_free(s)]
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
        move = BoundaryMove(
            blocks_before=before[0],
            blocks_after=self.blocks.capacity,
            slots_before=before[1],
            slots_after=self.slots.capacity,
            block_remap={},
            slot_remap=dict(moves),
            dropped_blocks=(),
            evicted_blocks=(),
            copies=ops,
            copied_bytes=copied,
        )
        self._moved(move)
        return move

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
