"""A waiting request's last lookup, so asking again costs a window, not the prompt.

vLLM asks the connector about a waiting request step after step until it is
scheduled. Between two asks the catalogue's books only gain names, except
for what they remove (evictions, drops, a store's relisting) and the loads
that fail: where none of that touched the request's run of blocks, the run
found last time still holds, and the next lookup starts where it ended. A
stale answer would cost a failed load and a recompute, never a wrong token;
this one is exact.

Runs are also remembered by the prefix they cover, for the first ask of
another request: requests that share a system prompt or a document recall
its keys by vLLM's hashes (:mod:`.key_memo`), and where the deepest recalled
block ends a run found before, that run holds for them too (keys are
chained: the name of a run's last block names every block before it). So a
first ask over a long shared prefix costs a few lookups, not one per block.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from ...errors import InvalidValueError
from ...prefix.lookup import ImagesWalked, TierFinds
from ...tiers.names import ImageKind, parse_object_name
from .chains import RequestKeys

RUN_BLOCKS_KEPT = 1 << 18
"""Blocks the runs remembered by the prefix they cover may span together (a
level each; those met most lately kept): a few tens of MB at most, however
long the prompts."""


class _Catalogue(Protocol):
    def gone(self, since: int) -> tuple[list[str] | None, int]: ...

    def removals(self) -> int: ...

    def images(self, since: int) -> tuple[list[str] | None, int]: ...

    def images_joined(self) -> int: ...


def _key(name: str) -> bytes | None:
    """The key a state image's name was made of (None: a name no tier object has,
    as a shared store may list under its prefix)."""
    try:
        return parse_object_name(name)[1]
    except InvalidValueError:
        return None


class _Objects(Protocol):
    def prefix_of(self, name: str) -> str: ...


@dataclass(frozen=True, kw_only=True)
class Since:
    """The catalogue's counts read before a lookup: removals, and state images joined."""

    removals: int
    images: int


@dataclass(frozen=True, kw_only=True)
class _Asked:
    """What a request's last lookup found, with the catalogue's counts and the
    changes to the names skipped counted then."""

    local: int
    kv_end: int
    kv: dict[int, int]  # the lookup's own (never changed after it)
    walked: ImagesWalked | None  # its walk of the state images (None: no state groups)
    since: Since
    skips: int


class AskedBefore:
    """Each waiting request's last lookup, the runs found lately by the prefix
    they cover, and whether they still hold."""

    def __init__(self, catalogue: _Catalogue, objects: _Objects) -> None:
        """``objects``: how a lookup asks (maps a rank's name to its prefix object)."""
        self.catalogue, self.objects = catalogue, objects
        self._asked: dict[str, _Asked] = {}
        # by the name of the run's last KV block; a run's ``local`` is where it began
        self._runs: OrderedDict[str, _Asked] = OrderedDict()
        self._run_blocks = 0  # blocks the remembered runs span
        # prefix objects a load could not use (on any rank): lookups skip them until
        # they are saved again; and how often that set has changed
        self.skip: set[str] = set()
        self._skips = 0

    def reported(self, failed: Iterable[str], saved: Iterable[str]) -> None:
        """A worker's report: names whose loads failed, and names saved. Where the
        names skipped change (a failure, or a failed name saved again: a
        remembered walk skipped it), every remembered lookup is walked again."""
        before = len(self.skip)
        self.skip.update(failed)
        grown = len(self.skip) - before
        if self.skip:
            self.skip.difference_update(saved)
        if grown or len(self.skip) != before:
            self._skips += 1

    def start(
        self, rid: str, keys: RequestKeys, local: int, limit: int, known: int
    ) -> tuple[int, dict[int, int], ImagesWalked | None, Since]:
        """Where the lookup of ``rid`` may start, the levels of the blocks below
        it, what its walk of the state images may skip, and the catalogue's
        counts now (read before the lookup, for :meth:`found`): the end of its
        last run, or else of a run another request found ending at the
        request's ``known``-th block (its keys had without hashing), where
        nothing of it has left the books since and no load has failed; else
        ``local``. The run's walk holds where no image has joined the books at a
        boundary it found none at, and the image it found is still held."""
        now = Since(removals=self.catalogue.removals(), images=self.catalogue.images_joined())
        asked = self._asked.get(rid)
        if asked is None or asked.local != local:
            asked = self._run(keys, local, known)
        if asked is None or asked.skips != self._skips:
            return local, {}, None, now
        gone, _ = self.catalogue.gone(asked.since.removals)
        if gone is None:
            return local, {}, None, now
        end = min(asked.kv_end, limit)
        walked = asked.walked
        if gone:
            mine = set(keys.names(ImageKind.KV_BLOCK, local, end))
            if walked is not None and walked.image:  # the image the walk found
                mine.update(keys.names(ImageKind.STATE, walked.image - 1, walked.image))
            if any(self.objects.prefix_of(name) in mine for name in gone):
                return local, {}, None, now
        if walked is not None and not self._no_image_joined(keys, walked, asked.since.images):
            walked = None
        kv = asked.kv if end == asked.kv_end else {i: x for i, x in asked.kv.items() if i < end}
        return end, kv, walked, now

    def _no_image_joined(self, keys: RequestKeys, walked: ImagesWalked, since: int) -> bool:
        """Whether no state image has joined the books, since the catalogue had
        ``since``, at a boundary where ``walked`` found none (boundary ``b``'s
        image is keyed by block ``b - 1``'s key)."""
        joined, _ = self.catalogue.images(since)
        if not joined:
            return joined is not None
        empty = set(keys.upto(walked.top)[walked.image : walked.top])
        return not any(_key(self.objects.prefix_of(name)) in empty for name in joined)

    def _run(self, keys: RequestKeys, local: int, known: int) -> _Asked | None:
        """The run remembered as ending at block ``known`` (a prefix of the
        request's), where it began at or below ``local``: its levels then cover
        every block the request lacks (a lookup reads them from ``local`` on)."""
        if known <= local:
            return None
        name = keys.names(ImageKind.KV_BLOCK, known - 1, known)[0]
        run = self._runs.get(name)
        if run is None or run.local > local:
            return None
        self._runs.move_to_end(name)
        return run

    def found(
        self, rid: str, keys: RequestKeys, local: int, finds: TierFinds, since: Since
    ) -> None:
        """Remember what the lookup of ``rid`` found (``since``: :meth:`start`'s),
        its walk of the state images with it, and its run by the prefix it covers."""
        asked = _Asked(
            local=local,
            kv_end=finds.kv_end,
            kv=finds.kv,
            walked=finds.walked,
            since=since,
            skips=self._skips,
        )
        self._asked[rid] = asked
        if finds.kv_end > local:
            end, low, kv = finds.kv_end, local, finds.kv
            while low and low - 1 in kv:  # levels had from a run that began lower
                low -= 1
            name = keys.names(ImageKind.KV_BLOCK, end - 1, end)[0]
            kept = self._runs.get(name)
            if kept is None or kept.local >= low or not self._untouched(kept):
                run = asked if low == local else dataclasses.replace(asked, local=low)
                self._run_blocks += run.kv_end - run.local
                if kept is not None:
                    self._run_blocks -= kept.kv_end - kept.local
                self._runs[name] = run
            self._runs.move_to_end(name)
            while self._run_blocks > RUN_BLOCKS_KEPT and len(self._runs) > 1:
                _, old = self._runs.popitem(last=False)
                self._run_blocks -= old.kv_end - old.local

    def _untouched(self, asked: _Asked) -> bool:
        """Whether nothing at all has left the books nor failed since ``asked``."""
        return asked.skips == self._skips and self.catalogue.gone(asked.since.removals)[0] == []

    def __contains__(self, rid: str) -> bool:
        """Whether ``rid`` was looked up since it arrived (until it finishes)."""
        return rid in self._asked

    def forget(self, rid: str) -> None:
        self._asked.pop(rid, None)
