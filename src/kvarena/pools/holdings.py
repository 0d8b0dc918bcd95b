"""One record per request: the ids it holds, remapped in place by a boundary move.

Whoever needs a request's ids — a prefix-cache admission, a block table, an
integration's rows — holds the same :class:`Holding`, never a copy of its
lists. A boundary move relocates live blocks and slots; the cache that moved
them remaps every registered holding in place, so no holder can keep
appending to a list the move left behind.

The blocks a request holds, in token order, are the holding's own book (the
allocator counts references, it does not know who holds them); its slots are
the STATE allocator's book, which the holding asks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from ..checks import check_request_id
from ..errors import InvalidValueError
from .states import StateAllocator


class Holding:
    """The blocks (token order) and slots one request holds."""

    def __init__(
        self, request: Hashable, blocks: list[int], states: StateAllocator, fixed: bool = False
    ) -> None:
        self.request = request
        self.blocks = blocks
        self._states = states
        # A peer may be writing these ids by address (a transfer in flight): a
        # boundary move that would relocate them is refused, never done under it.
        self.fixed = fixed

    @property
    def slots(self) -> tuple[int, ...]:
        """The request's slots (state, then rollback copies); () when it holds none."""
        return self._states.held_by(self.request) if self.request is not None else ()

    def __repr__(self) -> str:
        return f"Holding(request={self.request!r}, blocks={len(self.blocks)}, slots={self.slots})"


class Holdings:
    """The registry of live holdings a cache remaps when its boundary moves."""

    def __init__(self, states: StateAllocator) -> None:
        self._states = states
        self._live: dict[int, Holding] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Holding]:
        return iter(list(self._live.values()))

    def hold(
        self, request: Hashable = None, blocks: list[int] | None = None, *, fixed: bool = False
    ) -> Holding:
        """A new registered holding for ``request`` over ``blocks`` (the list is
        kept, not copied: it is the record's); ``fixed``: its ids must not move."""
        if blocks is None:
            blocks = []
        elif not isinstance(blocks, list):
            raise InvalidValueError(
                f"a holding's blocks must be a list, got {type(blocks).__name__}"
            )
        if not isinstance(fixed, bool):
            raise InvalidValueError(f"fixed must be a bool, got {fixed!r}")
        if request is not None:
            check_request_id(request)
        holding = Holding(request, blocks, self._states, fixed)
        self._live[id(holding)] = holding
        return holding

    def let_go(self, holding: Holding) -> None:
        """Stop remapping ``holding`` (its ids were given back)."""
        if self._live.pop(id(holding), None) is None:
            raise InvalidValueError(f"{holding!r} is not held in this cache")

    def fixed_blocks(self) -> set[int]:
        """Blocks no move may relocate (a peer may be writing them)."""
        return {b for h in self._live.values() if h.fixed for b in h.blocks}

    def fixed_slots(self) -> set[int]:
        """Slots no move may relocate."""
        return {s for h in self._live.values() if h.fixed for s in h.slots}

    def remap_blocks(self, remap: dict[int, int]) -> None:
        """Every holding's relocated blocks, in place (the lists are shared)."""
        if not remap:
            return
        for holding in self._live.values():
            blocks = holding.blocks
            for i, b in enumerate(blocks):
                new = remap.get(b)
                if new is not None:
                    blocks[i] = new
