"""One plan from a model and a budget: everything a cache needs, from sizes alone.

:func:`plan_cache` is the one road from a model's declarations to a byte plan,
and :meth:`~kvarena.pools.UnifiedCache.from_plan` the one road from a plan to
memory. Every number a plan reports is derived from the fields and
:class:`~kvarena.pools.geometry.PoolGeometry` (the same function the cache
carves its buffer with), so a cache built from a plan holds exactly the blocks
and slots the plan promised: no second calculation exists to disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..checks import MAX_ENTRIES, check_bytes, check_count
from ..errors import InvalidValueError
from ..layout import (
    EntryField,
    entry_bytes_for,
    layout_fingerprint,
    min_slot_stride,
    strictest_alignment,
)
from ..layout.regions import align_up
from ..models import ModelCache
from .geometry import PoolGeometry, blocks_for

MAX_SEQS = 1 << 24
"""Requests in flight beyond this are refused as nonsense (no server runs 16M at once)."""


class PoolBudgetError(InvalidValueError):
    """The STATE floor does not fit the budget; carries the numbers."""

    def __init__(
        self,
        needed: int,
        available: int,
        entries: dict[str, int],
        max_fitting_seqs: int,
    ) -> None:
        self.needed = needed
        self.available = available
        self.entries = entries
        self.max_fitting_seqs = max_fitting_seqs
        self._args = (needed, available, entries, max_fitting_seqs)
        # With clamp=True only "not even one" is ever raised, so the advice to
        # pass it is given exactly when it would help.
        if max_fitting_seqs < 1:
            advice = "not even one request fits; raise the budget"
        else:
            advice = (
                f"at most max_num_seqs={max_fitting_seqs} fits (pass clamp=True to plan at that)"
            )
        super().__init__(
            f"the pools need {needed:,} bytes ({entries}) but the budget is {available:,}; "
            + advice
        )

    def __reduce__(self) -> tuple:
        # Rebuilt from its numbers, so it survives a trip between processes.
        return (type(self), self._args)


@dataclass(frozen=True, kw_only=True)
class CachePlan:
    """A model's cache planned for a budget: the record a :class:`UnifiedCache` is built from.

    Stored: what was asked and decided (the model's declarations, the budget,
    asked and effective concurrency). Derived, never stored: fields, block
    size, strides, counts, unused bytes and fingerprints, so a plan cannot
    carry two numbers that disagree.
    """

    model: ModelCache
    budget_bytes: int
    requested_seqs: int
    max_seqs: int

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelCache):
            raise InvalidValueError(
                f"CachePlan: model must be a ModelCache, got {type(self.model).__name__}"
            )
        if not self.page_fields and not self.state_fields:
            raise InvalidValueError(
                "CachePlan: no PAGE and no STATE fields; a cache needs one or both"
            )
        check_bytes(self.budget_bytes, "CachePlan: budget_bytes", lo=1)
        check_count(self.requested_seqs, "CachePlan: requested_seqs", lo=1, hi=MAX_SEQS)
        check_count(self.max_seqs, "CachePlan: max_seqs", lo=1, hi=self.requested_seqs)
        for what, n in (("blocks", self.geometry.max_blocks), ("slots", self.geometry.total_slots)):
            if n > MAX_ENTRIES:
                raise InvalidValueError(
                    f"CachePlan: {self.budget_bytes:,} bytes would index {n:,} {what}, more than "
                    f"{MAX_ENTRIES:,}; raise the block size or lower the budget"
                )
        if self.state_slots > self.geometry.total_slots:
            raise InvalidValueError(
                f"CachePlan: {self.state_slots} state slots do not fit {self.budget_bytes:,} bytes "
                f"(at most {self.geometry.total_slots}); plan with plan_cache"
            )
        if self.page_fields and self.blocks < 1:
            raise InvalidValueError(
                f"CachePlan: {self.budget_bytes:,} bytes leave no PAGE block beside "
                f"{self.state_slots} state slots; plan with plan_cache"
            )

    # -- the model's declarations ---------------------------------------------------
    @property
    def name(self) -> str:
        return self.model.name

    @property
    def page_fields(self) -> tuple[EntryField, ...]:
        return self.model.page_fields

    @property
    def state_fields(self) -> tuple[EntryField, ...]:
        return self.model.state_fields

    @property
    def block_size(self) -> int:
        """Tokens per PAGE block."""
        return self.model.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens at this plan's block size."""
        return blocks_for(tokens, self.block_size)

    @property
    def entries_per_req(self) -> int:
        """STATE entries one request holds: its state and its rollback copies."""
        return self.model.entries_per_req

    # -- derived from the fields ---------------------------------------------------
    @cached_property
    def block_bytes(self) -> int:
        """One PAGE block's field bytes (0 without PAGE fields)."""
        return entry_bytes_for(self.page_fields)

    @cached_property
    def block_stride(self) -> int:
        """Bytes between blocks: the block rounded up to its strictest alignment."""
        return min_slot_stride(self.page_fields)

    @cached_property
    def slot_bytes(self) -> int:
        """One request state's field bytes (0 without STATE fields)."""
        return entry_bytes_for(self.state_fields)

    @cached_property
    def slot_stride(self) -> int:
        """Bytes between slots: the state rounded up to its strictest alignment."""
        return min_slot_stride(self.state_fields)

    @cached_property
    def alignment(self) -> int:
        """What the buffer's start address must be a multiple of (both pools' strictest)."""
        return max(strictest_alignment(self.page_fields), strictest_alignment(self.state_fields))

    @cached_property
    def page_fingerprint(self) -> str | None:
        return layout_fingerprint(self.page_fields) if self.page_fields else None

    @cached_property
    def state_fingerprint(self) -> str | None:
        return layout_fingerprint(self.state_fields) if self.state_fields else None

    # -- derived from the geometry -------------------------------------------------
    @cached_property
    def geometry(self) -> PoolGeometry:
        return PoolGeometry(
            total_bytes=self.budget_bytes,
            block_stride=self.block_stride,
            slot_stride=self.slot_stride,
            state_alignment=strictest_alignment(self.state_fields),
        )

    @property
    def state_slots(self) -> int:
        """Slots the STATE pool starts with: ``max_seqs * entries_per_req`` (0 without STATE)."""
        return self.max_seqs * self.entries_per_req if self.state_fields else 0

    @property
    def blocks(self) -> int:
        """PAGE blocks below those slots (0 without PAGE fields)."""
        return self.geometry.blocks_with_slots(self.state_slots)

    @property
    def token_capacity(self) -> int:
        return self.blocks * self.block_size

    @property
    def clamped(self) -> bool:
        return self.max_seqs < self.requested_seqs

    @property
    def used_bytes(self) -> int:
        return self.blocks * self.block_stride + self.state_slots * self.slot_stride

    @property
    def unused_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def to_dict(self) -> dict[str, Any]:
        """The plan's numbers as plain data (the ``pools`` section of ``kvarena plan --json``)."""
        return {
            "budget_bytes": self.budget_bytes,
            "requested_max_seqs": self.requested_seqs,
            "effective_max_seqs": self.max_seqs,
            "clamped": self.clamped,
            "block_size": self.block_size,
            "entries_per_req": self.entries_per_req,
            "blocks": self.blocks,
            "block_bytes": self.block_bytes,
            "block_stride": self.block_stride,
            "token_capacity": self.token_capacity,
            "state_slots": self.state_slots,
            "slot_bytes": self.slot_bytes,
            "slot_stride": self.slot_stride,
            "used_bytes": self.used_bytes,
            "unused_bytes": self.unused_bytes,
            "page_fingerprint": self.page_fingerprint,
            "state_fingerprint": self.state_fingerprint,
        }


def _fitting_seqs(geometry: PoolGeometry, entries_per_req: int, needs_block: bool) -> int:
    """The largest concurrency whose slots fit (and leave one block, where blocks exist)."""
    per_seq = entries_per_req * geometry.slot_stride
    room = geometry.top - (geometry.block_stride if needs_block else 0)
    if room < 0:
        return 0
    if per_seq == 0:
        return MAX_SEQS
    # Slots are whole: at most total_slots of them, and their bytes within room.
    return min(geometry.total_slots, room // geometry.slot_stride) // entries_per_req


def plan_cache(
    model: ModelCache, *, budget_bytes: int, max_seqs: int, clamp: bool = True
) -> CachePlan:
    """Plan ``model``'s cache in ``budget_bytes``: the STATE floor first, PAGE takes the rest.

    The STATE pool needs ``max_seqs * entries_per_req`` slots; a model with
    paged layers also needs at least one block. When they do not fit,
    ``clamp=True`` plans at the largest concurrency that does, and
    ``clamp=False`` raises :class:`PoolBudgetError` with the numbers; a budget
    that fits not even one request is refused either way.
    """
    if not isinstance(model, ModelCache):
        raise InvalidValueError(
            f"plan_cache: model must be a ModelCache (kvarena.model_cache(...) or "
            f"ModelCache.from_fields(...)), got {type(model).__name__}"
        )
    budget = check_bytes(budget_bytes, "plan_cache: budget_bytes", lo=1)
    asked = check_count(max_seqs, "plan_cache: max_seqs", lo=1, hi=MAX_SEQS)
    if not isinstance(clamp, bool):
        raise InvalidValueError(f"plan_cache: clamp must be a bool, got {clamp!r}")
    geometry = PoolGeometry(
        total_bytes=budget,
        block_stride=min_slot_stride(model.page_fields),
        slot_stride=min_slot_stride(model.state_fields),
        state_alignment=strictest_alignment(model.state_fields),
    )
    fitting = _fitting_seqs(geometry, model.entries_per_req, bool(model.page_fields))
    seqs = asked
    if asked > fitting:
        if not clamp or fitting < 1:
            slots = asked * model.entries_per_req if model.state_fields else 0
            # The smallest budget that holds them: slots hang from the budget
            # rounded down to the STATE alignment, so the block below them is
            # counted up to that alignment (needed > budget, always).
            needed = slots * geometry.slot_stride + align_up(
                geometry.block_stride, geometry.state_alignment
            )
            entries = {"state": slots} if model.state_fields else {}
            if model.page_fields:
                entries["page"] = 1
            raise PoolBudgetError(needed, budget, entries, fitting)
        seqs = fitting
    return CachePlan(model=model, budget_bytes=budget, requested_seqs=asked, max_seqs=seqs)
