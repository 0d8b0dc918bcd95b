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

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence

from ...prefix.lookup import Locates
from ...tiers import TierSpec
from ...tiers.image import KEY_BYTES, object_name, parse_object_name


def rank_key(key: bytes, rank: int, ranks: int) -> bytes:
    """Rank ``rank``'s key for the object of prefix key ``key`` (the key itself at
    one rank: a single-rank engine's objects are named by the prefix)."""
    if ranks == 1:
        return key
    return hashlib.blake2b(
        key, digest_size=KEY_BYTES, person=b"kvarena-tp" + rank.to_bytes(2, "big")
    ).digest()


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


def rank_names(name: str, ranks: int, *, only: int | None = None) -> list[str]:
    """Every rank's object name for the prefix object named ``name`` (rank
    ``only``'s alone, where given)."""
    if ranks == 1:
        return [name]
    kind, key = parse_object_name(name)
    which = range(ranks) if only is None else (only,)
    return [object_name(kind, rank_key(key, r, ranks)) for r in which]


NAMES_KEPT = 1 << 18
"""Prefix objects whose rank names a lookup keeps (a few hundred bytes each at TP 8)."""


class AllRanks:
    """The catalogue as a lookup over prefix objects: a name is held where every
    rank's object is (at the deepest tier any of them is in), and not at all
    where one is missing."""

    def __init__(self, catalogue: Locates, ranks: int) -> None:
        self.catalogue, self.ranks = catalogue, ranks
        # Each prefix object's rank names, kept for the prefixes asked most lately:
        # shared prefixes (a system prompt, a conversation's earlier turns) are
        # asked again and again, and each name is a hash per rank.
        self._names: OrderedDict[str, list[str]] = OrderedDict()

    def _rank_names(self, name: str) -> list[str]:
        got = self._names.get(name)
        if got is None:
            got = self._names[name] = rank_names(name, self.ranks)
            if len(self._names) > NAMES_KEPT:
                self._names.popitem(last=False)
        else:
            self._names.move_to_end(name)
        return got

    def locate(self, names: Sequence[str]) -> list[int | None]:
        """Each prefix object's deepest tier over every rank, None where some rank's
        object is missing. Rank 0's names are asked first: a block no tier holds
        (most of a miss's probe) costs one name, not one per rank."""
        if self.ranks == 1:
            return self.catalogue.locate(list(names))
        known = [self._names.get(n) for n in names]
        first = [
            k[0] if k is not None else rank_names(n, self.ranks, only=0)[0]
            for n, k in zip(names, known, strict=True)
        ]
        out: list[int | None] = list(self.catalogue.locate(first))
        held = [i for i, where in enumerate(out) if where is not None]
        others = [self._rank_names(names[i])[1:] for i in held]
        where = self.catalogue.locate([x for names_of in others for x in names_of])
        step = self.ranks - 1
        for j, i in enumerate(held):
            tiers = where[j * step : (j + 1) * step]
            if any(t is None for t in tiers):
                out[i] = None
            else:
                out[i] = max([out[i], *tiers])  # type: ignore[type-var]
        return out
