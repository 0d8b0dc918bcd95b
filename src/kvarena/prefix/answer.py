"""A prefix cache's answer: the lookup contract over what the device and the tiers hold.

The answer is computed, never stored: the device's part is asked of the
block pool (the one book of cached blocks) each time, the tiers' part of the
tiers (:func:`~.lookup.locate_in_tiers`), and the resume point is the
contract's (:func:`~.lookup.resume_point`). A lookup and an admission ask
the same function, so what a lookup promises is what an admission takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from ..pools import BlockAllocator
from ..tiers import TierStack
from .lookup import TierFinds, locate_in_tiers, resume_point
from .records import Image, ImageState, PrefixHit, image_key


@dataclass(frozen=True, kw_only=True)
class DeviceHeld:
    """What the device holds for a prompt's keys, asked of the block pool: KV
    blocks by key, READY images by resume point. ``copying``: the prefix
    cache's images whose bytes are still being written (its own dict, read
    here, never copied): held by the pool, not yet an answer."""

    pool: BlockAllocator
    copying: Mapping[bytes, Image]

    def kv(self, key: bytes) -> bool:
        return self.pool.blocks_of(key) is not None

    def has_image(self, keys: Sequence[bytes], b: int) -> bool:
        """Whether the device holds a READY image at resume point ``b``."""
        if b < 1:
            return False
        key = keys[b - 1]
        return key not in self.copying and self.pool.blocks_of(image_key(key)) is not None

    def image_at(self, keys: Sequence[bytes], b: int) -> Image | None:
        """The device's READY image at resume point ``b``, or None."""
        if not self.has_image(keys, b):
            return None
        return Image(key=keys[b - 1], resume_point=b, state=ImageState.READY, pool=self.pool)


def answer(
    device: DeviceHeld,
    tiers: TierStack,
    keys: Sequence[bytes],
    tokens: int,
    *,
    block_size: int,
    has_kv: bool,
    has_state: bool,
    images: bool,
    skip: Set[str] = frozenset(),
) -> PrefixHit:
    """The hit for a prompt of ``tokens`` tokens and chained ``keys``: the
    device's KV run, extended by the tiers; the deepest boundary every group
    resumes from (an image on the device or in a tier where there is a state;
    ``images``: the cache keeps them); at most ``tokens - 1`` tokens. Objects
    named in ``skip`` count as absent (they failed their checks). A cache
    with reuse off passes ``tokens`` 0: a miss."""
    limit = min(len(keys), max(0, (tokens - 1) // block_size))
    full = 0
    while full < limit and device.kv(keys[full]):
        full += 1
    finds = TierFinds(kv_end=full, kv={}, state={})
    if tiers and limit:
        finds = locate_in_tiers(
            tiers,
            keys,
            kv_end=full,
            limit=limit,
            has_kv=has_kv,
            has_state=has_state and images,
            device_kv=device.kv,
            device_image=lambda b: device.has_image(keys, b),
            skip=skip,
        )
    full, tier_kv, tier_state = finds.kv_end, finds.kv, finds.state
    cand = resume_point(
        full if has_kv else limit,
        has_state,
        lambda b: b in tier_state or device.has_image(keys, b),
    )
    image = device.image_at(keys, cand) if has_state else None
    names = tiers.labels
    image_source = None
    if has_state and cand:
        image_source = "device" if image is not None else names[tier_state[cand]]
    matched = full if has_kv else cand
    kv = range(cand) if has_kv else range(0)
    blocks = [-1 if i in tier_kv else (device.pool.blocks_of(keys[i]) or (-1,))[0] for i in kv]
    return PrefixHit(
        tokens=cand * block_size,
        blocks=tuple(blocks),
        image=image,
        matched_kv_tokens=matched * block_size,
        lost_tokens=(matched - cand) * block_size,
        sources=tuple(names[tier_kv[i]] if i in tier_kv else "device" for i in kv),
        image_source=image_source,
    )
