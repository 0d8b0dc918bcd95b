"""A waiting request's last lookup, so asking again costs a window, not the prompt.

vLLM asks the connector about a waiting request step after step until it is
scheduled. Between two asks the catalogue's books only gain names, except
for what they remove (evictions, drops, a store's relisting) and the loads
that fail: where none of that touched the request's run of blocks, the run
found last time still holds, and the next lookup starts where it ended. A
stale answer would cost a failed load and a recompute, never a wrong token;
this one is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ...prefix.lookup import TierFinds
from ...tiers.image import ImageKind
from .chains import RequestKeys


class _Catalogue(Protocol):
    def gone(self, since: int) -> tuple[list[str] | None, int]: ...

    def removals(self) -> int: ...


class _Objects(Protocol):
    def prefix_of(self, name: str) -> str: ...


@dataclass(frozen=True, kw_only=True)
class _Asked:
    """What a request's last lookup found, with the catalogue's removals and the
    failed loads counted then."""

    local: int
    kv_end: int
    kv: dict[int, int]  # the lookup's own (never changed after it)
    since: int
    failed: int


class AskedBefore:
    """Each waiting request's last lookup, and whether it still holds."""

    def __init__(self, catalogue: _Catalogue, objects: _Objects) -> None:
        """``objects``: how a lookup asks (maps a rank's name to its prefix object)."""
        self.catalogue, self.objects = catalogue, objects
        self._asked: dict[str, _Asked] = {}
        self._failed = 0  # names ever reported failed

    def failed(self, names: int) -> None:
        """Loads failed: every remembered lookup is walked again."""
        self._failed += names

    def start(
        self, rid: str, keys: RequestKeys, local: int, limit: int
    ) -> tuple[int, dict[int, int], int]:
        """Where the lookup of ``rid`` may start, the levels of the blocks below
        it, and the catalogue's removals so far (read before the lookup, for
        :meth:`found`): the end of its last run, where nothing of it has left
        the books since and no load has failed; else ``local``."""
        now = self.catalogue.removals()
        asked = self._asked.get(rid)
        if asked is None or asked.local != local or asked.failed != self._failed:
            return local, {}, now
        gone, _ = self.catalogue.gone(asked.since)
        if gone is None:
            return local, {}, now
        end = min(asked.kv_end, limit)
        if gone:
            mine = set(keys.names(ImageKind.KV_BLOCK, local, end))
            if any(self.objects.prefix_of(name) in mine for name in gone):
                return local, {}, now
        kv = asked.kv if end == asked.kv_end else {i: x for i, x in asked.kv.items() if i < end}
        return end, kv, now

    def found(self, rid: str, local: int, finds: TierFinds, since: int) -> None:
        """Remember what the lookup of ``rid`` found (``since``: :meth:`start`'s)."""
        self._asked[rid] = _Asked(
            local=local, kv_end=finds.kv_end, kv=finds.kv, since=since, failed=self._failed
        )

    def forget(self, rid: str) -> None:
        self._asked.pop(rid, None)
