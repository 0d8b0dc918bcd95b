"""The prefix cache's side toward the tiers: loading a hit's objects, draining.

:class:`TierLoads` is an object the prefix cache holds, given what it reads
and writes at construction: it moves bytes between the device cache and the
tier stack on the way in (fetch, check, copy into new blocks and the new
slot) and, at a shutdown, out. It never calls back into the prefix cache: a
fetch returns the names that failed, and the cache answers its lookup again
without them.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from ..checkpoint import CheckpointSpec
from ..checks import check_count
from ..errors import InvalidValueError
from ..pools.unified import UnifiedCache
from ..tiers import TierStack
from ..tiers.checked import Expectations, fetch_checked
from ..tiers.image import Expected, TierObject
from ..tiers.names import ImageKind, object_name
from .records import Admission, PrefixHit, PrefixMetrics, image_key
from .tiering import WriteDown, host_bytes


class TierLoads:
    """Loads and drains for one prefix cache (called under its lock)."""

    def __init__(
        self,
        *,
        cache: UnifiedCache,
        tiers: TierStack,
        spec: CheckpointSpec | None,
        metrics: PrefixMetrics,
        expect: Expectations,
        write_down: WriteDown,
    ) -> None:
        self.cache, self.pool = cache, cache.blocks
        self.tiers, self.spec, self.metrics = tiers, spec, metrics
        self.expect, self.write_down = expect, write_down
        self.block_size = expect.block_size

    @classmethod
    def build(
        cls,
        *,
        cache: UnifiedCache,
        tiers: TierStack,
        spec: CheckpointSpec | None,
        metrics: PrefixMetrics,
        namespace: bytes,
    ) -> TierLoads:
        """The loads of a prefix cache over ``cache``, with the expectations and
        the write-down sink (for the pool) of its namespace."""
        expect = Expectations(
            namespace=namespace,
            block_size=cache.plan.block_size,
            kv_bytes=cache.block_bytes,
            state_bytes=spec.image_bytes if spec else 0,
            elided=cache.device.type == "meta",  # no bytes: tier images are headers
        )
        write_down = WriteDown(
            buf=cache.buf,
            block_stride=cache.block_stride,
            spec=spec,
            expect=expect,
            tiers=tiers,
            metrics=metrics,
            track=spec is not None,
        )
        return cls(
            cache=cache,
            tiers=tiers,
            spec=spec,
            metrics=metrics,
            expect=expect,
            write_down=write_down,
        )

    def fetch(self, keys: list[bytes], hit: PrefixHit, good: dict[str, memoryview]) -> set[str]:
        """Fetch and check every tier object ``hit`` uses and ``good`` lacks, into
        ``good``; an object that fails is deleted and counted. Returns the names
        no tier served (the caller answers again without them)."""
        level_of = {n: i for i, n in enumerate(self.tiers.labels)}
        wanted: list[tuple[str, Expected]] = []
        first: list[int] = []
        for i, src in enumerate(hit.sources):
            name = object_name(ImageKind.KV_BLOCK, keys[i])
            if src != "device" and name not in good:
                wanted.append((name, self.expect.kv(keys[i], i)))
                first.append(level_of[src])
        if hit.image_source not in (None, "device"):
            b = hit.tokens // self.block_size
            name = object_name(ImageKind.STATE, keys[b - 1])
            if name not in good:
                wanted.append((name, self.expect.state(keys[b - 1], b)))
                first.append(level_of[hit.image_source])  # type: ignore[index]
        got = fetch_checked(self.tiers, wanted, first=first)
        rejected = self.metrics.tier_rejected
        for r in got.rejected:
            rejected[r.reason] = rejected.get(r.reason, 0) + 1
        for (name, _), payload in zip(wanted, got.payloads, strict=True):
            if payload is not None:
                good[name] = payload
        return set(got.failed)

    def take_hit_blocks(
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
            if not self.expect.elided:
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

    def restore_payload(self, payload: memoryview, slot: int) -> None:
        """A state image's bytes (its checkpoint ranges, in order) into ``slot``."""
        if self.expect.elided or self.spec is None:
            return
        src = host_bytes(payload)
        raw = self.cache.slot_bytes_of(slot)
        pos = 0
        for o, n in self.spec.ranges:
            raw[o : o + n].copy_(src[pos : pos + n])
            pos += n

    def publish(
        self,
        adm: Admission,
        store: TierStack,
        boundaries: Sequence[int],
        copying: Set[bytes],
        *,
        kv: bool,
    ) -> int:
        """Write a running request's full KV blocks past its hit (``kv``: the cache
        has them) and its images at ``boundaries`` (those still being written
        skipped) through every tier of ``store``; the objects written."""
        if not isinstance(store, TierStack):
            raise InvalidValueError(f"publish: store must be a TierStack, got {store!r}")
        marks = [check_count(b, "publish: boundary", lo=1) for b in boundaries]
        h, full = adm.hit.tokens // self.block_size, adm.tokens.size // self.block_size
        keys = adm.keys
        objects = [
            self.write_down.kv_object(keys[i], adm.blocks[i], i) for i in range(h, full) if kv
        ]
        for b in marks:
            units = self.pool.blocks_of(image_key(keys[b - 1])) if h < b <= full else None
            if self.spec is not None and units is not None and keys[b - 1] not in copying:
                objects.append(self.write_down.state_object(keys[b - 1], units, b))
        if objects:
            store.write_through(objects)
        return len(objects)

    def drain(self, copying: Set[bytes], batch: int) -> int:
        """Write every cached block and every image not in ``copying`` (bytes still
        being written) back to the tiers without evicting anything; the number
        of objects written."""
        batch = check_count(batch, "drain: batch", lo=1)
        if not self.tiers:
            return 0
        objects: list[TierObject] = []
        n = 0
        for key in self.pool.keys():
            blocks = self.pool.blocks_of(key) or ()
            tag = self.pool.tag_of(key)
            if isinstance(key, bytes):
                objects.append(self.write_down.kv_object(key, blocks[0], tag))
            elif isinstance(key, tuple) and self.spec is not None and key[1] not in copying:
                objects.append(self.write_down.state_object(key[1], blocks, tag))
            if len(objects) >= batch:
                self.tiers.write_back(objects)
                n, objects = n + len(objects), []
        self.tiers.write_back(objects)
        return n + len(objects)
