"""The rows of one cache: the batch's requests, their block tables and state slots,
shared by every layer (what each layer reads and writes, and what the pool gives back)."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ...errors import InvalidValueError
from ...pools import BlockTable, Holding, UnifiedCache


class Rows:
    """The batch's requests, shared by every layer of one cache.

    Each row is one request's :class:`~kvarena.pools.Holding` (the record a
    boundary move remaps in place) and, with PAGE fields, its block table over
    that holding. Views and index tensors made from the ids are the rows' own
    and go stale when the boundary moves: :meth:`follow` remakes them, and a
    use after a move not followed is refused (never served from old ids)."""

    def __init__(
        self, cache: UnifiedCache, holdings: list[Holding], tables: list[BlockTable]
    ) -> None:
        self.cache = cache
        self.holdings = holdings
        self.requests: list[Hashable] = [h.request for h in holdings]
        self.tables = tables
        self.has_slots = bool(cache.state_fields)
        self._moves = cache.moves
        self._states: dict[str, torch.Tensor] = {}
        self._copies: set[str] = set()  # fields held as working copies
        self._index: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._prepared: tuple[int, int] | None = None
        self.released = False  # set once, by the cache's close(): then every use refuses
        # A window of tokens counts in the tables (and so can be committed to the
        # prefix cache) only once every paged layer wrote it: a forward that
        # raises in layer 5 leaves the tables where the last whole forward left them.
        self.paged_layers = 0
        self._wrote: dict[int, int] = {}  # window end -> paged layers that wrote it
        # Each row's first rollback entry, where a crop finds the state from
        # before the last forward (None: the pool keeps no rollback entries).
        self.rollback_index = self._rollback_index()

    @property
    def slots(self) -> list[tuple[int, ...]]:
        """Each row's slots (state, then rollback copies), asked of its holding; [] with
        no STATE fields."""
        return [h.slots for h in self.holdings] if self.has_slots else []

    def _rollback_index(self) -> torch.Tensor | None:
        slots = self.slots
        if not slots or len(slots[0]) < 2:
            return None
        return torch.tensor([g[1] for g in slots], device=self.cache.device)

    def follow(self) -> None:
        """The boundary moved (the slots' bytes and the holdings were remapped,
        working copies synced before): remake every view and index from the ids."""
        self.reload()
        self.changed()
        self.rollback_index = self._rollback_index()
        self._moves = self.cache.moves

    def check_live(self) -> None:
        if self.released:
            raise InvalidValueError(
                "this KvarenaCache was released to its pool: its blocks and slots may belong "
                "to another cache now; make a new cache (pool.new_cache or pool.prefill)"
            )
        if self._moves != self.cache.moves:
            raise InvalidValueError(
                "the cache's boundary moved under this KvarenaCache and it was not told: "
                "move the boundary through its pool (KvarenaPool.move_boundary or "
                "KvarenaPool.rebalance), which remakes every live cache's views"
            )

    def wrote(self, end: int) -> None:
        """One paged layer wrote its tokens up to ``end``; the last of them advances
        every row's table to ``end``."""
        n = self._wrote.get(end, 0) + 1
        if n < self.paged_layers:
            self._wrote[end] = n
            return
        self._wrote.pop(end, None)
        for t in self.tables:
            t.tokens = max(t.tokens, end)

    @property
    def live_slots(self) -> list[int]:
        return [s[0] for s in self.slots]

    # -- states --------------------------------------------------------------
    def state(self, name: str) -> torch.Tensor:
        """``[layers, B, *shape]`` of a STATE field over the rows' live slots."""
        t = self._states.get(name)
        if t is None:
            t = self.cache.state_rows(name, self.live_slots)
            if t is None:  # scattered slots: a working copy, written back by sync()
                t = self.cache.gather_states(name, self.live_slots)
                self._copies.add(name)
            self._states[name] = t
        return t

    def sync(self) -> None:
        """Write working copies back into the slots (views need nothing)."""
        for name in self._copies:
            self.cache.scatter_states(name, self.live_slots, self._states[name])

    def reload(self) -> None:
        """Forget views and copies (the slots' bytes changed under them)."""
        self._states.clear()
        self._copies.clear()

    # -- blocks --------------------------------------------------------------
    def prepare(self, start: int, end: int) -> None:
        """Blocks for tokens ``[start, end)`` of every row, private (copied on write)."""
        if self._prepared == (start, end):
            return
        changed = False
        for t in self.tables:
            held = len(t.blocks)
            changed |= bool(t.prepare_write(start, end)) or len(t.blocks) != held
        if changed:  # block ids moved: cached index tensors are stale
            self._index.clear()
        self._prepared = (start, end)

    def index(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block, row)`` index tensors ``[B, end - start]`` of the tokens."""
        bs = self.cache.block_size
        key = (start, end)
        got = self._index.get(key)
        if got is None:
            flat = torch.stack([t.token_index(start, end) for t in self.tables])
            flat = flat.to(self.cache.device)
            got = self._index[key] = (flat // bs, flat % bs)
        return got

    def blocks(self, tokens: int) -> tuple[torch.Tensor, int]:
        """The rows' first ``ceil(tokens / block_size)`` blocks, row after row, as
        one index tensor, and that count: a read gathers whole blocks (one
        contiguous run per block and layer), not single tokens."""
        n = self.cache.plan.blocks_for(tokens)
        key = (-1, n)
        got = self._index.get(key)
        if got is None:
            ids = [b for t in self.tables for b in t.blocks[:n]]
            got = self._index[key] = (torch.tensor(ids, device=self.cache.device), torch.empty(0))
        return got[0], n

    def changed(self) -> None:
        self._index.clear()
        self._prepared = None
