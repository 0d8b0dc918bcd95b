"""The prefix cache's side toward the tiers: loading a hit's objects, draining.

A mixin of :class:`~kvarena.prefix.cache.PrefixCache`: everything that moves
bytes between the device cache and the tier stack on the way in (fetch,
check, copy into new blocks and the new slot) and, at a shutdown, out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ..checkpoint import CheckpointSpec
from ..checks import check_count
from ..locking import synchronized
from ..pools import BlockAllocator
from ..pools.unified import UnifiedCache
from ..tiers import TierStack
from ..tiers.checked import Expectations, fetch_checked
from ..tiers.image import Expected, ImageKind, TierObject, object_name
from .records import Image, PrefixHit, PrefixMetrics
from .tiering import WriteDown, host_bytes


class TierSide:
    """Loads and drains for a prefix cache (a mixin; the attributes are its)."""

    cache: UnifiedCache
    pool: BlockAllocator
    tiers: TierStack
    spec: CheckpointSpec | None
    block_size: int
    metrics: PrefixMetrics
    _expect: Expectations
    _write_down: WriteDown
    _copying: dict[bytes, Image]
    _lock: threading.RLock

    # The prefix cache's own: the lookup contract and the promotion of copied images.
    _answer: Callable[..., PrefixHit]
    poll: Callable[[], None]

    def _load(
        self, tok: np.ndarray, keys: list[bytes], hit: PrefixHit
    ) -> tuple[PrefixHit, dict[str, memoryview]]:
        """Fetch and check every tier object ``hit`` uses; an object that fails
        is deleted and counted, and the answer recomputed without it."""
        tier_of = {n: i for i, n in enumerate(self.tiers.names)}
        good: dict[str, memoryview] = {}
        skip: set[str] = set()
        while True:
            wanted: list[tuple[str, Expected]] = []
            first: list[int] = []
            for i, src in enumerate(hit.sources):
                name = object_name(ImageKind.KV_BLOCK, keys[i])
                if src != "device" and name not in good:
                    wanted.append((name, self._expect.kv(keys[i], i)))
                    first.append(tier_of[src])
            if hit.image_source not in (None, "device"):
                b = hit.tokens // self.block_size
                name = object_name(ImageKind.STATE, keys[b - 1])
                if name not in good:
                    wanted.append((name, self._expect.state(keys[b - 1], b)))
                    first.append(tier_of[hit.image_source])
            got = fetch_checked(self.tiers, wanted, first=first)
            for r in got.rejected:
                self.metrics.tier_rejected[r.reason] = self.metrics.tier_rejected.get(r.reason, 0) + 1
            for (name, _), payload in zip(wanted, got.payloads, strict=True):
                if payload is not None:
                    good[name] = payload
            if not got.failed:
                return hit, good
            skip |= set(got.failed)
            hit = self._answer(tok, keys, frozenset(skip))

    def _take_hit_blocks(
        self, keys: list[bytes], hit: PrefixHit, new: list[int], payloads: dict[str, memoryview]
    ) -> list[int]:
        """The request's blocks: the device's hit blocks (retained), then tier
        blocks copied into new ones and cached at once, then the rest."""
        out: list[int] = []
        fresh = iter(new)
        for i, b in enumerate(hit.blocks):
            if b >= 0:
                out.append(b)
                continue
            blk = next(fresh)
            if not self._expect.elided:
                src = host_bytes(payloads[object_name(ImageKind.KV_BLOCK, keys[i])])
                self.cache.block_bytes_of(blk).copy_(src)
            self.pool.cache(keys[i], [blk], tag=i)
            out.append(blk)
            name = hit.sources[i]
            self.metrics.tier_hit_tokens[name] = (
                self.metrics.tier_hit_tokens.get(name, 0) + self.block_size
            )
        out.extend(fresh)
        return out

    def _restore_payload(self, payload: memoryview, slot: int) -> None:
        """A state image's bytes (its checkpoint ranges, in order) into ``slot``."""
        if self._expect.elided or self.spec is None:
            return
        src = host_bytes(payload)
        raw = self.cache.slot_bytes_of(slot)
        pos = 0
        for o, n in self.spec.ranges:
            raw[o : o + n].copy_(src[pos : pos + n])
            pos += n

    @synchronized
    def drain(self, batch: int = 256) -> int:
        """Write every cached block and READY image back to the tiers without
        evicting anything (a server shutting down, so the next one starts warm);
        the number of objects written."""
        batch = check_count(batch, "drain: batch", lo=1)
        if not self.tiers:
            return 0
        self.poll()
        objects: list[TierObject] = []
        n = 0
        for key in self.pool.keys():
            blocks = self.pool.blocks_of(key) or ()
            tag = self.pool.tag_of(key)
            if isinstance(key, bytes):
                objects.append(self._write_down.kv_object(key, blocks[0], tag))
            elif isinstance(key, tuple) and self.spec is not None and key[1] not in self._copying:
                objects.append(self._write_down.state_object(key[1], blocks, tag))
            if len(objects) >= batch:
                self.tiers.write_back(objects)
                n, objects = n + len(objects), []
        self.tiers.write_back(objects)
        return n + len(objects)
