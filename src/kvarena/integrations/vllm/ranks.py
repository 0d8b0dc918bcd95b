"""Tensor-parallel ranks: one prefix, one object per rank.

Under tensor parallelism every rank holds its own shard of a block (its KV
heads, its share of a state), so each rank saves and loads its own objects;
the scheduler, one process for all ranks, hashes a request's tokens once. So
a prefix has one chained key (from the engine's namespace, which names the
TP size but no rank) and each rank's object a key of its own derived from it
(:func:`rank_key`); each rank's images also carry its rank's namespace, so an
object of one rank fails its checks on any other. A lookup counts a block or
a state only where every rank's object is there (:class:`AllRanks`): a hit
some rank cannot load would make vLLM recompute it on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from ...prefix.lookup import Locates
from ...tiers import TierSpec
from ...tiers.image import KEY_BYTES
from ...tiers.names import object_name, parse_object_name
from .records import BlockCopy


def rank_key(key: bytes, rank: int, ranks: int) -> bytes:
    """Rank ``rank``'s key for the object of prefix key ``key``: the key itself for
    rank 0 (a single-rank engine's objects, and rank 0's, are named by the
    prefix), a keyed hash of it for every other rank."""
    if ranks == 1 or rank == 0:
        return key
    h = _RANK_HASHES[rank].copy() if rank < len(_RANK_HASHES) else _rank_hash(rank)
    h.update(key)
    return h.digest()


def _rank_hash(rank: int) -> hashlib.blake2b:
    """Rank ``rank``'s keyed hash, nothing fed yet."""
    return hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvarena-tp" + rank.to_bytes(2, "big"))


_RANK_HASHES = tuple(_rank_hash(r) for r in range(64))
"""Ranks 0-63's keyed hashes with nothing fed, made once and never fed: each use
copies its rank's (half the cost of making one; a lookup at TP 8 derives seven
keys a block it has not met)."""


def own_copy(copy: BlockCopy, rank: int, ranks: int) -> BlockCopy:
    """The plan names a prefix's object; rank ``rank`` copies its own (keyed by
    :func:`rank_key`), into and out of the same blocks."""
    if ranks == 1:
        return copy
    return dataclasses.replace(copy, key=rank_key(copy.key, rank, ranks))


def tp_rank() -> int:
    """This worker's tensor-parallel rank (vLLM has set up its groups by now)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def rank_dir(directory: str, rank: int, ranks: int) -> str:
    """Rank ``rank``'s directory of a disk tier: one process owns a disk directory,
    so each rank's worker writes its own below the configured one."""
    return directory if ranks == 1 else os.path.join(directory, f"tp{rank}")


def rank_tier_specs(specs: Sequence[TierSpec], rank: int, ranks: int) -> tuple[TierSpec, ...]:
    """The tiers one rank's worker opens: the configured sizes are the engine's,
    so each rank's host and disk tier holds its share of them, and its disk tier
    lives in its own directory (:func:`rank_dir`); a shared store is shared as it
    is (the ranks' names differ)."""
    if ranks == 1:
        return tuple(specs)
    return tuple(
        s.share(ranks, directory=rank_dir(s.directory, rank, ranks) if s.directory else None)
        for s in specs
    )


def rank_names(name: str, ranks: int) -> list[str]:
    """Every rank's object name for the prefix object named ``name`` (rank 0's is
    ``name`` itself)."""
    if ranks == 1:
        return [name]
    kind, key = parse_object_name(name)
    return [name, *(object_name(kind, rank_key(key, r, ranks)) for r in range(1, ranks))]


NAMES_KEPT = 1 << 18
"""Prefix objects whose rank names a lookup keeps (a few hundred bytes each at TP 8)."""


class Catalogued(Locates, Protocol):
    """A catalogue that says which names it has removed since a reader last asked."""

    def gone(self, since: int) -> tuple[list[str] | None, int]: ...


class AllRanks:
    """The catalogue as a lookup over prefix objects: a name is held where every
    rank's object is (at the deepest tier any of them is in), and not at all
    where one is missing."""

    def __init__(self, catalogue: Catalogued, ranks: int) -> None:
        self.catalogue, self.ranks = catalogue, ranks
        # Each prefix object's rank names, kept for the prefixes asked most lately:
        # shared prefixes (a system prompt, a conversation's earlier turns) are
        # asked again and again, and each name is a hash per rank.
        self._names: OrderedDict[str, list[str]] = OrderedDict()
        self._prefix_of: dict[str, str] = {}  # each kept rank name's prefix object
        # Prefix objects every rank was found to hold, at which deepest tier: true
        # until one of their rank names leaves a book (the catalogue's removals,
        # read before each lookup). A name joining a higher tier leaves the
        # answer deeper than it could be: a fetch then starts lower, no more.
        self._whole: dict[str, int] = {}
        self._since = 0

    def _rank_names(self, name: str) -> list[str]:
        got = self._names.get(name)
        if got is None:
            got = self._names[name] = rank_names(name, self.ranks)
            self._prefix_of.update(dict.fromkeys(got, name))
            if len(self._names) > NAMES_KEPT:
                old, names = self._names.popitem(last=False)
                self._whole.pop(old, None)
                for n in names:
                    self._prefix_of.pop(n, None)
        else:
            self._names.move_to_end(name)
        return got

    def prefix_of(self, name: str) -> str:
        """The prefix object a rank's name belongs to, as far as a lookup has seen
        it (a name not seen: itself, as rank 0's names are)."""
        return self._prefix_of.get(name, name)

    def _forget_removed(self) -> None:
        gone, self._since = self.catalogue.gone(self._since)
        if gone is None:
            self._whole.clear()
            return
        for name in gone:
            prefix = self._prefix_of.get(name)
            if prefix is not None:
                self._whole.pop(prefix, None)

    def locate(self, names: Sequence[str]) -> list[int | None]:
        """Each prefix object's deepest tier over every rank, None where some rank's
        object is missing. Rank 0's names (the prefix objects' own) are asked
        first: a block no tier holds (most of a miss's probe) costs one name,
        not one per rank, and no hash."""
        if self.ranks == 1:
            return self.catalogue.locate(list(names))
        self._forget_removed()
        whole = self._whole
        out: list[int | None] = [whole.get(n) for n in names]
        if None not in out:
            return out
        ask = [i for i, where in enumerate(out) if where is None]
        found = self.catalogue.locate(names if len(ask) == len(out) else [names[i] for i in ask])
        held = []
        for i, level in zip(ask, found, strict=True):
            if level is not None:
                out[i] = level
                held.append(i)
        if not held:
            return out
        others = [self._rank_names(names[i])[1:] for i in held]
        where = self.catalogue.locate([x for names_of in others for x in names_of])
        step = self.ranks - 1
        for j, i in enumerate(held):
            tiers = where[j * step : (j + 1) * step]
            first = out[i]
            if first is None or any(t is None for t in tiers):
                out[i] = None
            else:
                out[i] = whole[names[i]] = max(first, *(t for t in tiers if t is not None))
        return out
