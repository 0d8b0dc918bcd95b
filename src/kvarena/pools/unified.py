"""One allocation for PAGE blocks and STATE slots, with a movable boundary.

One zeroed uint8 buffer holds both pools: PAGE blocks grow from offset 0
(block ``j`` at ``j * block_stride``), STATE slots from the top down (slot
``i`` at ``base + i * slot_stride``, the pool owning slots ``[first, total)``).
Kernels get per-layer views of both, made once over the whole buffer, so they
stay valid whichever way the boundary moves; block and slot ids never change
meaning, only which of them are in use.

The boundary's moves live in :mod:`kvarena.pools.boundary`, the image
accessors in :mod:`kvarena.pools.image_access`; both are mixed in here. Every
request's ids are one :class:`~kvarena.pools.holdings.Holding` registered
with the cache, which a move remaps in place.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from ..checkpoint import CheckpointSpec, PageUnits
from ..checks import check_choice, check_device, check_int
from ..copy import CopyStats
from ..errors import InvalidValueError
from ..layout import EntryMajorArena, LayerMajorArena
from ..layout.regions import aligned_zeros
from .blocks import BlockAllocator
from .boundary import BoundaryMove, BoundaryMover, copy_entries
from .holdings import Holding, Holdings
from .image_access import ImageAccess
from .plan import CachePlan
from .states import StateAllocator


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
        self.blocks = BlockAllocator(blocks)
        self.holdings = Holdings(self.slots)
        self._images = ImageAccess(
            buf=self.buf,
            state=self.state,
            pages=self.pages,
            blocks=self.blocks,
            slots=self.slots,
            page_fields=self.page_fields,
            state_fields=self.state_fields,
            block_stride=self.block_stride,
            max_blocks=self.max_blocks,
        )
        self._boundary = BoundaryMover(
            buf=self.buf,
            pages=self.pages,
            blocks=self.blocks,
            slots=self.slots,
            holdings=self.holdings,
            geometry=g,
            page_layout=page_layout,
            page_fields=self.page_fields,
            state_fields=self.state_fields,
            block_stride=self.block_stride,
            slot_stride=self.slot_stride,
            slot_base=self.slot_base,
        )

    @classmethod
    def from_plan(
        cls, plan: CachePlan, device: torch.device | str, *, page_layout: str = "entry_major"
    ) -> UnifiedCache:
        """The cache a plan promised: ``num_blocks == plan.blocks``, ``num_slots == plan.state_slots``."""
        return cls(plan, device, page_layout=page_layout)

    # -- holdings --------------------------------------------------------------
    def hold(
        self, request: Hashable = None, blocks: list[int] | None = None, *, fixed: bool = False
    ) -> Holding:
        """The one record of the ids ``request`` holds (its blocks, in token order:
        the list given, kept; its slots, asked of the STATE allocator), remapped
        in place by every boundary move until :meth:`let_go`. ``fixed=True``
        while a peer may write its ids by address: a move that would relocate
        them is refused."""
        if isinstance(blocks, list):  # a holder holds references: every block is live
            self.blocks.check_held(blocks, "hold: blocks", writing=True)
        return self.holdings.hold(request, blocks, fixed=fixed)

    def let_go(self, holding: Holding) -> None:
        """Stop following ``holding`` (its ids were given back)."""
        self.holdings.let_go(holding)

    # -- images in PAGE units (ImageAccess) ---------------------------------------
    def checkpoint_spec(self, unit_bytes: int | None = None) -> CheckpointSpec:
        """The image plan of this cache's state, in units of ``unit_bytes`` (default:
        a whole block stride, so one image takes the fewest blocks)."""
        return self._images.checkpoint_spec(unit_bytes)

    def page_units(self, unit_bytes: int | None = None) -> PageUnits:
        """The PAGE pool seen as image units (unit ``u``: block ``u``'s first bytes)."""
        return self._images.page_units(unit_bytes)

    def store(
        self, spec: CheckpointSpec, slots: Sequence[int], unit_lists: Sequence[Sequence[int]]
    ) -> CopyStats:
        """Copy each slot's checkpoint image into its units (blocks it holds live)."""
        return self._images.store(spec, slots, unit_lists)

    def restore(
        self, spec: CheckpointSpec, slots: Sequence[int], unit_lists: Sequence[Sequence[int]]
    ) -> CopyStats:
        """Copy each image ``unit_lists[c]`` back into ``slots[c]`` (slots, then units)."""
        return self._images.restore(spec, slots, unit_lists)

    def block_checkpoint_spec(self, unit_bytes: int | None = None) -> CheckpointSpec:
        """The image plan of one KV block (its PAGE fields): what store_blocks writes."""
        return self._images.block_checkpoint_spec(unit_bytes)

    def store_blocks(
        self, spec: CheckpointSpec, blocks: Sequence[int], unit_lists: Sequence[Sequence[int]]
    ) -> CopyStats:
        """Copy each block's bytes (a live or cached block) into image units."""
        return self._images.store_blocks(spec, blocks, unit_lists)

    def restore_blocks(
        self, spec: CheckpointSpec, blocks: Sequence[int], unit_lists: Sequence[Sequence[int]]
    ) -> CopyStats:
        """Copy block images ``unit_lists[c]`` back into live blocks ``blocks[c]``."""
        return self._images.restore_blocks(spec, blocks, unit_lists)

    # -- the movable boundary (BoundaryMover) -------------------------------------
    @property
    def moves(self) -> int:
        """Boundary moves so far: a holder of views over ids asks it."""
        return self._boundary.moves

    def plan_grow_state(self, n: int) -> tuple[int, list[int], list[int], list[int]]:
        return self._boundary.plan_grow_state(n)

    def grow_state(self, n: int) -> BoundaryMove:
        """Move the boundary down by ``n`` slots (STATE takes PAGE's top blocks)."""
        return self._boundary.grow_state(n)

    def shrink_state(self, n: int) -> BoundaryMove:
        """Move the boundary up by ``n`` slots (PAGE takes STATE's lowest slots)."""
        return self._boundary.shrink_state(n)

    def rebalance(self, *, waiting_requests: int, blocks_needed: int) -> BoundaryMove | None:
        """Move the boundary toward current demand, or None if no move helps."""
        return self._boundary.rebalance(
            waiting_requests=waiting_requests, blocks_needed=blocks_needed
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

    def block_bytes_of(self, block: int) -> torch.Tensor:
        """Block ``block``'s field bytes (``block_bytes``); the id must be in the PAGE pool now."""
        pages = self._images.block_pages("block_bytes_of")
        return pages.entry(check_int(block, "block id", lo=0, hi=self.num_blocks - 1))

    def slot_bytes_of(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s field bytes (``slot_bytes``); the id must be in the STATE pool now."""
        return self.state.entry(
            check_int(slot, "slot id", lo=self.slots.first, hi=self.total_slots - 1)
        )

    # -- requests --------------------------------------------------------------
    def allocate_slots(self, request: Hashable) -> tuple[int, ...]:
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

    def allocate_slots_batch(self, requests: Sequence[Hashable]) -> list[tuple[int, ...]]:
        """Slots for a batch of new requests, reset like :meth:`allocate_slots`:
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

    def release_slots(self, request: Hashable) -> tuple[int, ...]:
        return self.slots.release(request)

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
        copy_entries(self.buf, s, d, self.slot_base, self.slot_stride, self.slot_bytes)

    def fork_slots(self, request: Hashable, new_request: Hashable) -> tuple[int, ...]:
        """Slots for ``new_request`` holding a copy of ``request``'s states (every
        entry, rollback copies included), e.g. a beam or a parallel sample."""
        src = self.slots.slots_of(request)
        dst = self.slots.allocate(new_request)
        self.copy_slots(src, dst)
        return dst

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole blocks (every layer of each), ``src[i]`` into ``dst[i]``:
        the copy half of copy-on-write. Targets must be held for writing."""
        self._images.block_pages("copy_blocks")
        s = self.blocks.check_held(src, "copy_blocks: src", writing=False)
        d = self.blocks.check_held(dst, "copy_blocks: dst", writing=True)
        if s.size != d.size:
            raise InvalidValueError(
                f"copy_blocks: {s.size} sources but {d.size} targets; they pair one to one"
            )
        copy_entries(self.buf, s, d, 0, self.block_stride, self.block_bytes)

    def _rows(self, base: int, stride: int, count: int) -> torch.Tensor:
        return self.buf[base : base + stride * count].view(count, stride)
