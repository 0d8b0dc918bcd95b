"""One sequence's KV blocks in token order: append, fork with copy-on-write, truncate.

A block table is what a paged attention kernel reads: row ``r``'s token ``t``
lives in block ``table[r][t // block_size]`` at row ``t % block_size``. The
table holds one reference on each of its blocks, so a fork (a beam, a
parallel sample) shares them for free; the first write into a block that
someone else also reads — another table, or the prefix cache, which keeps
finished prompts' blocks under their keys — copies it first (copy-on-write),
so no write ever changes bytes another reader sees.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..checks import check_count
from ..errors import InvalidValueError
from .blocks import BlockAllocationError
from .geometry import blocks_for
from .holdings import Holding
from .unified import UnifiedCache


class BlockTable:
    """The blocks of one sequence and how many tokens it holds.

    The table's blocks are a :class:`~kvarena.pools.holdings.Holding`'s: the
    request's one record, which a prefix-cache admission may hold too (the
    table appends to it and replaces copied blocks in place, so whoever gives
    the request back gives back exactly what the table holds) and which a
    boundary move remaps in place. Without one the table holds a new one of
    its own, and :meth:`release` lets it go.
    """

    def __init__(
        self, cache: UnifiedCache, holding: Holding | None = None, *, tokens: int = 0
    ) -> None:
        if not isinstance(cache, UnifiedCache):
            raise InvalidValueError(
                f"BlockTable: cache must be a UnifiedCache, got {type(cache).__name__}"
            )
        if not cache.page_fields:
            raise InvalidValueError("BlockTable: this cache has no PAGE fields, so no blocks")
        self.cache = cache
        self.block_size = cache.block_size
        if holding is not None and not isinstance(holding, Holding):
            raise InvalidValueError(
                f"BlockTable: holding must be a Holding (cache.hold), got {type(holding).__name__}"
            )
        if holding is not None:
            cache.blocks.check_held(holding.blocks, "BlockTable: blocks", writing=True)
        n = len(holding.blocks) if holding is not None else 0
        tokens = check_count(tokens, "BlockTable: tokens", hi=n * self.block_size)
        self._own = holding is None
        self.holding = cache.hold() if holding is None else holding
        self.tokens = tokens

    @property
    def blocks(self) -> list[int]:
        """The blocks in token order (the holding's list, remapped by boundary moves)."""
        return self.holding.blocks

    @property
    def capacity(self) -> int:
        """Tokens the held blocks can take."""
        return len(self.blocks) * self.block_size

    def reserve(self, tokens: int) -> list[int]:
        """Hold blocks for ``tokens`` tokens in all; the new blocks (all or nothing)."""
        tokens = check_count(tokens, "BlockTable.reserve: tokens")
        need = blocks_for(tokens, self.block_size) - len(self.blocks)
        if need <= 0:
            return []
        new = self.cache.blocks.allocate(need)
        self.blocks.extend(new)
        return new

    def prepare_write(self, start: int, end: int) -> list[tuple[int, int]]:
        """Make tokens ``[start, end)`` writable: reserve blocks up to ``end`` and
        copy every block in the range that another reader holds (refcount above
        one, or cached by the prefix cache). Returns the ``(old, new)`` copies."""
        start = check_count(start, "prepare_write: start")
        end = check_count(end, "prepare_write: end", lo=start)
        bs, alloc = self.block_size, self.cache.blocks
        if end <= len(self.blocks) * bs and end - start == 1:
            # The decode step's fast path: one token into a block it holds alone.
            b = self.blocks[start // bs]
            if alloc.refcount(b) == 1 and not alloc.is_cached(b):
                return []
        touched = (
            range(start // bs, min(len(self.blocks), blocks_for(end, bs)))
            if end > start
            else range(0)
        )
        # Only blocks already held can be shared; the ones reserved now are new.
        shared = [
            i
            for i in touched
            if alloc.refcount(self.blocks[i]) > 1 or alloc.is_cached(self.blocks[i])
        ]
        # All or nothing: the reserve and the copies' blocks are counted before
        # either takes one, so a refusal leaves the table and the pool as they were.
        wanted = max(0, blocks_for(end, bs) - len(self.blocks)) + len(shared)
        if wanted > alloc.num_free + alloc.num_evictable:
            raise BlockAllocationError(wanted, alloc.num_free, alloc.num_evictable)
        self.reserve(end)
        if not shared:
            return []
        new = alloc.allocate(len(shared))
        old = [self.blocks[i] for i in shared]
        self.cache.copy_blocks(old, new)
        for i, b in zip(shared, new, strict=True):
            self.blocks[i] = b
        for b in old:
            alloc.release(b)
        return list(zip(old, new, strict=True))

    def fork(self) -> BlockTable:
        """A second table over the same blocks (one more reference on each)."""
        self.cache.blocks.pin(self.blocks, "BlockTable.fork: blocks")
        table = BlockTable(
            self.cache, self.cache.hold(blocks=list(self.blocks)), tokens=self.tokens
        )
        table._own = True
        return table

    def truncate(self, tokens: int) -> list[int]:
        """Keep the first ``tokens`` tokens; the blocks past them are released."""
        tokens = check_count(tokens, "BlockTable.truncate: tokens", hi=self.tokens)
        keep = blocks_for(tokens, self.block_size)
        gone = self.blocks[keep:]
        del self.blocks[keep:]
        for b in reversed(gone):
            self.cache.blocks.release(b)
        self.tokens = tokens
        return gone

    def release(self) -> None:
        """Give every block back (cached ones age in the LRU); a holding of the
        table's own is let go, one shared with its owner stays theirs."""
        self.truncate(0)
        if self._own:
            self._own = False
            self.cache.let_go(self.holding)

    def token_index(self, start: int, end: int) -> torch.Tensor:
        """Flat row ids (``block * block_size + t % block_size``) of tokens
        ``[start, end)`` into a ``[blocks * block_size, ...]`` view of a PAGE field."""
        start = check_count(start, "token_index: start")
        end = check_count(end, "token_index: end", lo=start, hi=self.capacity)
        t = torch.arange(start, end, dtype=torch.int64)
        ids = torch.as_tensor(self.blocks, dtype=torch.int64)
        return ids[t // self.block_size] * self.block_size + t % self.block_size


def block_table_tensor(
    tables: Sequence[BlockTable], device: torch.device | str, *, width: int | None = None
) -> torch.Tensor:
    """``int32 [rows, width]``: row ``r`` lists table ``r``'s blocks, padded with
    -1 — the block-table argument paged attention kernels take."""
    if not tables or not all(isinstance(t, BlockTable) for t in tables):
        raise InvalidValueError("block_table_tensor: tables must be a non-empty list of BlockTable")
    longest = max(len(t.blocks) for t in tables)
    w = longest if width is None else check_count(width, "block_table_tensor: width", lo=longest)
    out = torch.full((len(tables), w), -1, dtype=torch.int32)
    for r, t in enumerate(tables):
        out[r, : len(t.blocks)] = torch.as_tensor(t.blocks, dtype=torch.int32)
    return out.to(device)
