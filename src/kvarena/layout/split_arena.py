"""Entry-major planes side by side: one logical entry split over several arenas.

When one entry-major arena cannot hold every field (a plane per alignment
class, a plane per device), a :class:`SplitEntryMajorArena` keeps each
plane an :class:`~kvarena.layout.arenas.EntryMajorArena` of its own and
answers by field name which plane holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidValueError
from .arenas import EntryMajorArena, _unknown
from .fields import (
    EntryField,
)


class SplitEntryMajorArena:
    """One request's state spread over planes (one entry-major arena per plane).

    A field is one strided tensor, so it lives in exactly one plane; the
    contiguous unit is the slot (the same rows in every plane), so there is no
    whole-entry accessor here.
    """

    def __init__(self, arenas: Sequence[EntryMajorArena]) -> None:
        arenas = tuple(arenas)
        if not arenas:
            raise InvalidValueError(
                "SplitEntryMajorArena: no planes given; pass at least one arena"
            )
        owner: dict[str, int] = {}
        for p, arena in enumerate(arenas):
            if not isinstance(arena, EntryMajorArena):
                raise InvalidValueError(
                    f"SplitEntryMajorArena: arenas[{p}] must be an EntryMajorArena, "
                    f"got {type(arena).__name__}"
                )
            if arena.entries != arenas[0].entries:
                raise InvalidValueError(
                    f"SplitEntryMajorArena: plane {p} has {arena.entries} entries but plane 0 "
                    f"has {arenas[0].entries}; every plane must index the same entries"
                )
            for field in arena.fields:
                if field.name in owner:
                    raise InvalidValueError(
                        f"SplitEntryMajorArena: field {field.name!r} is in plane "
                        f"{owner[field.name]} and plane {p}; a field lives in exactly one plane"
                    )
                owner[field.name] = p
        self._arenas = arenas
        self._owner = owner

    @property
    def arenas(self) -> tuple[EntryMajorArena, ...]:
        return self._arenas

    @property
    def fields(self) -> tuple[EntryField, ...]:
        return tuple(f for a in self._arenas for f in a.fields)

    @property
    def entries(self) -> int:
        return self._arenas[0].entries

    @property
    def entry_bytes(self) -> int:
        return sum(a.entry_bytes for a in self._arenas)

    def plane_of(self, name: str) -> int:
        try:
            return self._owner[name]
        except (KeyError, TypeError):
            raise _unknown(name, self.fields) from None

    def view(self, name: str) -> torch.Tensor:
        return self._arenas[self.plane_of(name)].view(name)

    def field_offset(self, name: str) -> int:
        """Offset of ``name`` inside its own plane's entry."""
        return self._arenas[self.plane_of(name)].field_offset(name)
