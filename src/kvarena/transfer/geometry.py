"""What two sides of a transfer must agree on before any byte moves.

Each side registers its unified cache's whole buffer once and describes it
with a :class:`CacheGeometry`. Block and slot *counts* may differ (each side
sized its own budget); entry sizes, strides' meaning and the layouts'
fingerprints may not, or a block copied byte for byte would land in the wrong
fields. :meth:`CacheGeometry.mismatches` names every disagreement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..pools import UnifiedCache


@dataclass(frozen=True, kw_only=True)
class CacheGeometry:
    """A unified cache's buffer as the peer sees it (offsets relative to ``base``)."""

    base: int
    size: int
    block_bytes: int
    block_stride: int
    num_blocks: int
    slot_bytes: int
    slot_stride: int
    slot_base: int
    first_slot: int
    total_slots: int
    page_fingerprint: str | None
    state_fingerprint: str | None

    @classmethod
    def of(cls, cache: UnifiedCache) -> CacheGeometry:
        return cls(
            base=cache.buf.data_ptr(),
            size=cache.buf.numel(),
            block_bytes=cache.block_bytes,
            block_stride=cache.block_stride,
            num_blocks=cache.num_blocks,
            slot_bytes=cache.slot_bytes,
            slot_stride=cache.slot_stride,
            slot_base=cache.slot_base,
            first_slot=cache.slots.first,
            total_slots=cache.total_slots,
            page_fingerprint=cache.page_fingerprint,
            state_fingerprint=cache.state_fingerprint,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheGeometry:
        return cls(**data)

    _MUST_MATCH = ("page_fingerprint", "state_fingerprint", "block_bytes", "slot_bytes")

    def mismatches(self, peer: CacheGeometry) -> list[str]:
        """``"field: ours vs theirs"`` for every field two sides must share."""
        return [
            f"{name}: {getattr(self, name)!r} here vs {getattr(peer, name)!r} on the peer"
            for name in self._MUST_MATCH
            if getattr(self, name) != getattr(peer, name)
        ]

    def block_offset(self, block):  # int or integer array
        """Byte offset of block ``block`` from ``base``."""
        return block * self.block_stride

    def slot_offset(self, slot):  # int or integer array
        """Byte offset of slot ``slot`` from ``base``."""
        return self.slot_base + slot * self.slot_stride

    @property
    def max_blocks(self) -> int:
        """Block ids the registered buffer can ever hold (the boundary only moves within it)."""
        return self.size // self.block_stride
