"""Comparing a listing of the shared store with the last, a slice at a time.

The catalogue's lister shares the interpreter's lock with vLLM's scheduler:
a set built from a million fresh strings holds it ~0.2 s. So a listing is
never worked on in one call: :func:`compare` takes it a slice of names at a
time, with C-level calls a slice, resting between slices as its caller's
:class:`~kvarena.tiers.duty.DutyCycle` says.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TypeVar

from ...tiers.duty import DutyCycle

T = TypeVar("T")


def slices(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def compare(
    seen: dict[str, int], listing: int, listed: list[str], size: int, pace: DutyCycle
) -> tuple[list[str], list[str]]:
    """Bring ``seen`` (each name with the number of the listing it was last in) to
    listing number ``listing``; its names new to ``seen`` and the names it
    lacks, which leave ``seen``. ``size`` names a call, ``pace`` resting
    between calls; ``listed`` is emptied the same way (its strings freed
    a slice at a time). A name listed twice (``SCAN`` may) is harmless."""
    joined: list[str] = []
    for part in slices(listed, size):
        joined.extend(itertools.filterfalse(seen.__contains__, part))
        seen.update(zip(part, itertools.repeat(listing)))
        pace.rest()
    left: list[str] = []
    names, numbers = iter(seen), iter(seen.values())  # no tuple a name: nothing for the GC
    for _ in range(0, len(seen), size):
        stale = map(listing.__ne__, itertools.islice(numbers, size))
        left.extend(itertools.compress(itertools.islice(names, size), stale))
        pace.rest()
    for part in slices(left, size):
        for name in part:
            del seen[name]
        pace.rest()
    while listed:
        del listed[-size:]
        pace.rest()
    return joined, left
