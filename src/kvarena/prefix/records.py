"""The prefix cache's records: images, hits, admissions, metrics.

None of them is a second book of blocks. The block pool owns which block
holds which key (:mod:`kvarena.pools.cached_keys`); an :class:`Image` asks it
for its units, and an :class:`Admission` holds the request's one
:class:`~kvarena.pools.Holding`, which boundary moves remap in place.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..layout import dtype_name
from ..pools import BlockAllocator, CachePlan, Holding
from .keys import Namespace


class ImageState(enum.Enum):
    COPYING = "copying"  # bytes still being written: invisible to lookups
    READY = "ready"


def image_key(key: bytes) -> tuple[str, bytes]:
    """The pool key an image at the boundary ending with block key ``key`` is held under
    (distinct from the KV block's own key, ``key`` itself)."""
    return ("image", key)


@dataclass(eq=False, kw_only=True)
class Image:
    """A checkpoint image of a state at a block boundary, held in PAGE units.

    Its units are the blocks the pool holds under :func:`image_key` of ``key``:
    asked of the pool, so a boundary move that relocates them needs no word here."""

    key: bytes
    resume_point: int  # in blocks
    state: ImageState
    pool: BlockAllocator = field(repr=False)
    event: Any = None  # a CUDA event while COPYING on a device; None on CPU
    writer_done: bool = False  # the request that wrote it finished: its references go

    @property
    def units(self) -> list[int]:
        """The image's units in order; [] once the pool dropped it."""
        return list(self.pool.blocks_of(image_key(self.key)) or ())


@dataclass(frozen=True, kw_only=True)
class PrefixHit:
    tokens: int  # hit tokens: blocks x block_size, at most len(tokens) - 1
    blocks: tuple[int, ...]  # the hit's device KV blocks, in order; -1 where a tier serves it
    image: Image | None  # the device image restored into the new slot
    matched_kv_tokens: int  # tokens of KV matched by the full-attention group
    lost_tokens: int  # matched KV given up for want of a checkpoint
    sources: tuple[str, ...] = ()  # per hit block: "device" or the tier that serves it
    image_source: str | None = None  # "device", a tier's name, or None (no state restored)


@dataclass(kw_only=True)
class PrefixMetrics:
    requests: int = 0
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    lost_tokens: int = 0
    images_written: int = 0
    image_bytes_written: int = 0
    images_read: int = 0
    image_bytes_read: int = 0
    images_skipped: int = 0  # wanted but no room for the units
    evicted_blocks: int = 0
    evicted_images: int = 0
    tier_blocks_written: int = 0  # KV blocks written back to the tiers
    tier_images_written: int = 0
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)  # hit tokens by tier
    tier_images_read: dict[str, int] = field(default_factory=dict)
    tier_rejected: dict[str, int] = field(default_factory=dict)  # bad objects by reason

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def admitted(self, hit: PrefixHit, tokens: int, image_bytes: int | None) -> None:
        """Count an admission of ``tokens`` that took ``hit`` (``image_bytes``: a
        state image's size, None where the cache keeps no images)."""
        src = hit.image_source
        if src is not None and image_bytes is not None:
            if src != "device":
                self.tier_images_read[src] = self.tier_images_read.get(src, 0) + 1
            self.images_read += 1
            self.image_bytes_read += image_bytes
        self.requests += 1
        self.hits += bool(hit.tokens)
        self.hit_tokens += hit.tokens
        self.lost_tokens += hit.lost_tokens
        self.computed_tokens += tokens - hit.tokens


@dataclass(kw_only=True)
class Admission:
    """A running request: what it hit, what it holds, where it keeps images."""

    request: Hashable
    tokens: np.ndarray
    keys: list[bytes]
    hit: PrefixHit
    holding: Holding  # the request's one record of ids (blocks in token order, slots)
    checkpoints: list[int]  # block counts at which to keep an image while computing
    committed: int = 0  # leading blocks whose keys are registered
    extra: tuple[object, ...] = field(default=())
    images: list[Image] = field(default_factory=list)  # written by this request, held by it

    @property
    def blocks(self) -> list[int]:
        return self.holding.blocks

    @property
    def slots(self) -> tuple[int, ...]:
        return self.holding.slots


def plan_namespace(plan: CachePlan, *, tp_rank: int = 0) -> Namespace:
    """The namespace of a planned cache: its model, both layouts' fingerprints,
    its dtypes, block size and this rank's place."""
    dtypes = sorted({dtype_name(f.dtype) for f in (*plan.page_fields, *plan.state_fields)})
    return Namespace(
        model=plan.model.name,
        page_fingerprint=plan.page_fingerprint,
        state_fingerprint=plan.state_fingerprint,
        dtypes=tuple(dtypes),
        block_size=plan.block_size,
        tp_rank=tp_rank,
        tp_size=plan.model.options.tp,
    )
