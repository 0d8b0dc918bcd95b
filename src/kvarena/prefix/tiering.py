"""Where a prefix cache's victims go.

:class:`WriteDown` is the block pool's one write-down sink: it sees each batch
of evicted keys while their bytes are intact, encodes KV blocks and images
as checksummed tier objects, writes them to the top tier (whose own
evictions flow down) and counts the evictions. It reads the cache's buffer,
never the prefix cache: nothing calls back into the caller.

Objects are encoded from the cache's :class:`~kvarena.tiers.checked.Expectations`
(unsealed: a tier outside this process's memory seals what it is handed).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ..checkpoint import CheckpointSpec
from ..pools import Evicted
from ..tiers import TierStack
from ..tiers.checked import Expectations
from ..tiers.image import TierObject
from ..tiers.names import ImageKind
from .records import PrefixMetrics


def host_view(t: torch.Tensor) -> memoryview:
    """A uint8 tensor's bytes as a host memoryview (a device tensor is copied once)."""
    return memoryview(t.detach().cpu().contiguous().numpy())  # type: ignore[arg-type]


def host_bytes(data: memoryview) -> torch.Tensor:
    """A read-only host buffer as a uint8 tensor to copy FROM (never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns on read-only buffers
        return torch.frombuffer(data, dtype=torch.uint8)


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
        self._gone: list[bytes] = []  # evicted KV blocks' keys, until taken

    def take_gone(self) -> list[bytes]:
        """The keys of the KV blocks evicted since the last call (with ``track``)."""
        gone, self._gone = self._gone, []
        return gone

    def kv_object(self, key: bytes, block: int, index: int) -> TierObject:
        e = self._expect
        at = block * self._stride
        payload = None if e.elided else [host_view(self._buf[at : at + e.kv_bytes])]
        return e.encode(ImageKind.KV_BLOCK, key, index, payload)

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
        return e.encode(ImageKind.STATE, key, boundary, parts)

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
