"""Pool sizing: how many PAGE blocks and STATE slots a byte budget holds.

Entry classes name index spaces with a per-entry byte cost. The STATE pool
scales with requests in flight (``max_num_seqs * entries_per_req + extra``),
so its floor is reserved first; the one PAGE class, which scales with cached
history, absorbs what remains. Planning uses sizes only.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..checks import check_bytes, check_count
from ..errors import InvalidValueError, UnknownNameError


class PoolKind(enum.Enum):
    PAGE = "page"
    STATE = "state"


@dataclass(frozen=True, kw_only=True)
class EntryClass:
    """A named index space drawn from one pool.

    ``entries_per_req`` (STATE only) is how many entries one request holds,
    e.g. ``1 + num_speculative`` rollback copies; ``extra_entries`` are
    reserved beyond ``max_num_seqs`` (padding slots, warm-up). PAGE classes
    carry ``block_size`` (tokens per block) so a plan can report token capacity.
    """

    pool: PoolKind
    name: str
    entry_bytes: int
    entries_per_req: int = 1
    extra_entries: int = 0
    block_size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.pool, PoolKind):
            raise InvalidValueError(f"EntryClass pool must be a PoolKind, got {self.pool!r}")
        if not isinstance(self.name, str) or not self.name:
            raise InvalidValueError(f"EntryClass name must be a non-empty str, got {self.name!r}")
        where = f"EntryClass {self.name!r}"
        check_bytes(self.entry_bytes, f"{where}: entry_bytes", lo=1)
        check_count(self.entries_per_req, f"{where}: entries_per_req", lo=1)
        check_count(self.extra_entries, f"{where}: extra_entries")
        check_count(self.block_size, f"{where}: block_size")
        if self.pool is PoolKind.PAGE and (self.entries_per_req != 1 or self.extra_entries):
            raise InvalidValueError(
                f"{where}: entries_per_req and extra_entries are STATE settings; a PAGE class "
                f"takes the remainder (got {self.entries_per_req}, {self.extra_entries})"
            )

    def floor_entries(self, max_num_seqs: int) -> int:
        """Entries this class needs at ``max_num_seqs`` (0 for PAGE: it takes the rest)."""
        if self.pool is PoolKind.PAGE:
            return 0
        return max_num_seqs * self.entries_per_req + self.extra_entries


def merge_classes(classes: Sequence[EntryClass]) -> list[EntryClass]:
    """Merge classes of one name: their bytes add (fields of one index space).

    Classes of one name must agree on pool, multiplicity and tokens per entry;
    order of first appearance is kept.
    """
    merged: dict[str, EntryClass] = {}
    for c in classes:
        if not isinstance(c, EntryClass):
            raise InvalidValueError(f"merge_classes: expected EntryClass, got {type(c).__name__}")
        prev = merged.get(c.name)
        if prev is None:
            merged[c.name] = c
            continue
        for attr in ("pool", "entries_per_req", "extra_entries", "block_size"):
            if getattr(prev, attr) != getattr(c, attr):
                raise InvalidValueError(
                    f"entry class {c.name!r} is declared twice with different {attr}: "
                    f"{getattr(prev, attr)!r} vs {getattr(c, attr)!r}"
                )
        merged[c.name] = replace(c, entry_bytes=prev.entry_bytes + c.entry_bytes)
    return list(merged.values())


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


@dataclass(frozen=True)
class ClassPlan:
    """One class's share of a plan."""

    entry_class: EntryClass
    entries: int

    @property
    def nbytes(self) -> int:
        return self.entries * self.entry_class.entry_bytes


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """The answer of :func:`plan_pools`, every number a user asks about."""

    budget_bytes: int
    requested_seqs: int
    max_num_seqs: int
    classes: tuple[ClassPlan, ...]

    def of(self, name: str) -> ClassPlan:
        for c in self.classes:
            if c.entry_class.name == name:
                return c
        raise UnknownNameError(
            f"no entry class {name!r}; classes are {[c.entry_class.name for c in self.classes]}"
        )

    @property
    def clamped(self) -> bool:
        return self.max_num_seqs < self.requested_seqs

    @property
    def used_bytes(self) -> int:
        return sum(c.nbytes for c in self.classes)

    @property
    def unused_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    @property
    def page(self) -> ClassPlan | None:
        pages = [c for c in self.classes if c.entry_class.pool is PoolKind.PAGE]
        return pages[0] if pages else None

    @property
    def token_capacity(self) -> int:
        page = self.page
        return page.entries * page.entry_class.block_size if page else 0


def max_fitting_seqs(classes: Sequence[EntryClass], budget_bytes: int) -> int:
    """The largest ``max_num_seqs`` whose STATE floor fits ``budget_bytes`` (may be 0)."""
    budget_bytes = check_bytes(budget_bytes, "max_fitting_seqs: budget_bytes")
    states = [c for c in merge_classes(classes) if c.pool is PoolKind.STATE]
    fixed = sum(c.extra_entries * c.entry_bytes for c in states)
    per_seq = sum(c.entries_per_req * c.entry_bytes for c in states)
    if fixed > budget_bytes:
        return 0
    if per_seq == 0:
        return 1 << 62
    return (budget_bytes - fixed) // per_seq


def plan_pools(
    classes: Sequence[EntryClass], budget_bytes: int, max_num_seqs: int, *, clamp: bool = False
) -> PoolPlan:
    """Reserve the STATE floor, then give the remainder to the one PAGE class.

    Over budget raises :class:`PoolBudgetError` with the numbers and the
    largest ``max_num_seqs`` that fits; ``clamp=True`` plans at that instead.
    """
    budget_bytes = check_bytes(budget_bytes, "plan_pools: budget_bytes")
    max_num_seqs = check_count(max_num_seqs, "plan_pools: max_num_seqs", lo=1)
    merged = merge_classes(classes)
    pages = [c for c in merged if c.pool is PoolKind.PAGE]
    if len(pages) > 1:
        raise InvalidValueError(
            f"plan_pools: one PAGE class takes the remainder, got {len(pages)}: {[c.name for c in pages]}"
        )
    seqs = max_num_seqs
    floor = {c.name: c.floor_entries(seqs) for c in merged if c.pool is PoolKind.STATE}
    needed = sum(floor[c.name] * c.entry_bytes for c in merged if c.name in floor)
    if needed > budget_bytes:
        fitting = max_fitting_seqs(merged, budget_bytes)
        if not clamp or fitting < 1:
            raise PoolBudgetError(needed, budget_bytes, floor, fitting)
        seqs = fitting
        floor = {c.name: c.floor_entries(seqs) for c in merged if c.pool is PoolKind.STATE}
        needed = sum(floor[c.name] * c.entry_bytes for c in merged if c.name in floor)
    remainder = budget_bytes - needed
    plans = []
    for c in merged:
        entries = floor[c.name] if c.pool is PoolKind.STATE else remainder // c.entry_bytes
        plans.append(ClassPlan(c, entries))
    return PoolPlan(
        budget_bytes=budget_bytes,
        requested_seqs=max_num_seqs,
        max_num_seqs=seqs,
        classes=tuple(plans),
    )
