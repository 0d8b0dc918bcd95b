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


def rank_names(name: str, ranks: int) -> list[str]:
    """Every rank's object name for the prefix object named ``name``."""
    if ranks == 1:
        return [name]
    kind, key = parse_object_name(name)
    return [object_name(kind, rank_key(key, r, ranks)) for r in range(ranks)]


class AllRanks:
    """The catalogue as a lookup over prefix objects: a name is held where every
    rank's object is (at the deepest tier any of them is in), and not at all
    where one is missing."""

    def __init__(self, catalogue: Locates, ranks: int) -> None:
        self.catalogue, self.ranks = catalogue, ranks

    def locate(self, names: Sequence[str]) -> list[int | None]:
        per_rank = [rank_names(n, self.ranks) for n in names]
        where = self.catalogue.locate([x for names_of in per_rank for x in names_of])
        out: list[int | None] = []
        for i in range(len(per_rank)):
            tiers = where[i * self.ranks : (i + 1) * self.ranks]
            if any(t is None for t in tiers):
                out.append(None)
            else:
                out.append(max(t for t in tiers if t is not None))
        return out
