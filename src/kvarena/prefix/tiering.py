"""Where a prefix cache's victims go, and how tier objects are checked on the way in.

:class:`WriteDown` is the block pool's one write-down sink: it sees each batch
of evicted keys while their bytes are intact, encodes KV blocks and images
as checksummed tier objects, writes them to the top tier (whose own
evictions flow down) and counts the evictions. It reads the cache's buffer,
never the prefix cache: nothing calls back into the caller.

:class:`Expectations` says what an object must be to be used (kind, key,
namespace, token span, length); :func:`fetch_checked` fetches and decodes
them, deleting and counting any that fail.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..checkpoint import CheckpointSpec
from ..pools import Evicted
from ..tiers import TierStack
from ..tiers.image import Expected, ImageKind, ImageMismatch, TierObject, decode, encode
from .records import PrefixMetrics


def host_view(t: torch.Tensor) -> memoryview:
    """A uint8 tensor's bytes as a host memoryview (a device tensor is copied once)."""
    return memoryview(t.detach().cpu().contiguous().numpy())  # type: ignore[arg-type]


def host_bytes(data: memoryview) -> torch.Tensor:
    """A read-only host buffer as a uint8 tensor to copy FROM (never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns on read-only buffers
        return torch.frombuffer(data, dtype=torch.uint8)


@dataclass(frozen=True, kw_only=True)
class Expectations:
    """What a KV block's or an image's tier object must be (one namespace, one layout)."""

    namespace: bytes
    block_size: int
    block_bytes: int
    image_bytes: int
    elided: bool  # a meta-device cache: objects carry headers only

    def kv(self, key: bytes, index: int) -> Expected:
        bs = self.block_size
        return Expected(
            kind=ImageKind.KV_BLOCK,
            key=key,
            namespace=self.namespace,
            start=index * bs,
            end=(index + 1) * bs,
            payload_bytes=self.block_bytes,
            elided=self.elided,
        )

    def state(self, key: bytes, boundary: int) -> Expected:
        return Expected(
            kind=ImageKind.STATE,
            key=key,
            namespace=self.namespace,
            start=0,
            end=boundary * self.block_size,
            payload_bytes=self.image_bytes,
            elided=self.elided,
        )


class WriteDown:
    """The block pool's write-down sink for one prefix cache's keys."""

    def __init__(
        self,
        *,
        buf: torch.Tensor,
        block_stride: int,
        spec: CheckpointSpec | None,
        expect: Expectations,
        tiers: TierStack,
        metrics: PrefixMetrics,
        track: bool = False,
    ) -> None:
        self._buf, self._stride, self._spec = buf, block_stride, spec
        self._track = track  # keep the evicted KV keys for the owner to take (its ghosts)
        self._expect, self._tiers, self._metrics = expect, tiers, metrics
        # Objects bound for a host tier stay unsealed: it holds them in this
        # process's memory; a tier below seals what it is handed.
        self._seal = not (tiers and tiers.tiers[0].trusted)
        self._gone: list[bytes] = []  # evicted KV blocks' keys, until taken

    def take_gone(self) -> list[bytes]:
        """The keys of the KV blocks evicted since the last call (with ``track``)."""
        gone, self._gone = self._gone, []
        return gone

    def kv_object(self, key: bytes, block: int, index: int) -> TierObject:
        e = self._expect
        at = block * self._stride
        payload = None if e.elided else (host_view(self._buf[at : at + e.block_bytes]),)
        return encode(
            kind=ImageKind.KV_BLOCK,
            namespace=e.namespace,
            key=key,
            start=index * e.block_size,
            end=(index + 1) * e.block_size,
            payload=payload,
            payload_bytes=e.block_bytes,
            seal=self._seal,
        )

    def state_object(self, key: bytes, units: Sequence[int], boundary: int) -> TierObject:
        spec, e = self._spec, self._expect
        assert spec is not None
        parts: list[memoryview] | None = None
        if not e.elided:
            parts, left = [], spec.image_bytes
            for u in units:
                n = min(spec.unit_bytes, left)
                at = u * self._stride
                parts.append(host_view(self._buf[at : at + n]))
                left -= n
        return encode(
            kind=ImageKind.STATE,
            namespace=e.namespace,
            key=key,
            start=0,
            end=boundary * e.block_size,
            payload=parts,
            payload_bytes=spec.image_bytes,
            seal=self._seal,
        )

    def __call__(self, victims: Sequence[Evicted]) -> None:
        """Write the victims down (when there are tiers), then count them: a tier
        that raises refuses the eviction whole, counts included."""
        objects: list[TierObject] = []
        blocks = images = 0
        for v in victims:
            if isinstance(v.key, bytes):
                blocks += 1
                if self._tiers:
                    objects.append(self.kv_object(v.key, v.blocks[0], v.tag))
            elif isinstance(v.key, tuple):
                images += 1
                if self._tiers and self._spec is not None:
                    objects.append(self.state_object(v.key[1], v.blocks, v.tag))
        if objects:
            self._tiers.write_back(objects)
        if self._track:
            self._gone += [v.key for v in victims if type(v.key) is bytes]
        m = self._metrics
        m.evicted_blocks += blocks
        m.evicted_images += images
        if self._tiers:
            m.tier_blocks_written += blocks
            m.tier_images_written += images


def fetch_checked(
    tiers: TierStack,
    tier: int,
    items: Sequence[tuple[str, Expected]],
    good: dict[str, memoryview],
    metrics: PrefixMetrics,
) -> set[str]:
    """Fetch ``items`` (name, expectation) from ``tier`` into ``good``, checked in
    full; the names that were missing or failed (a failing one is deleted from
    the tier and counted by reason)."""
    failed: set[str] = set()
    todo = [(n, e) for n, e in items if n not in good]
    trusted = tiers.tiers[tier].trusted
    for (name, exp), data in zip(todo, tiers.fetch(tier, [n for n, _ in todo]), strict=True):
        if data is None:
            failed.add(name)
            continue
        try:
            good[name] = decode(data, exp, trusted=trusted)
        except ImageMismatch as exc:
            r = metrics.tier_rejected
            r[exc.reason] = r.get(exc.reason, 0) + 1
            tiers.drop(tier, [name])
            failed.add(name)
    return failed
