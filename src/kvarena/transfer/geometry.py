"""What two sides of a transfer must agree on before any byte moves.

Each side registers its unified cache's whole buffer once and describes it
with a :class:`CacheGeometry`. Block and slot *counts* may differ (each side
sized its own budget); entry sizes, strides' meaning and the layouts'
fingerprints may not, or a block copied byte for byte would land in the wrong
fields. :meth:`CacheGeometry.mismatches` names every disagreement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ..checks import check_bytes
from ..errors import InvalidValueError, LayoutMismatchError
from ..pools import UnifiedCache


@dataclass(frozen=True, kw_only=True)
class CacheGeometry:
    """A unified cache's buffer as the peer sees it (offsets relative to ``base``)."""

    base: int
    size: int
    block_bytes: int
    block_stride: int
    num_blocks: int
    max_blocks: int  # block ids the buffer can ever hold: the plan's PoolGeometry.max_blocks
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
            max_blocks=cache.geometry.max_blocks,
            slot_bytes=cache.slot_bytes,
            slot_stride=cache.slot_stride,
            slot_base=cache.slot_base,
            first_slot=cache.slots.first,
            total_slots=cache.total_slots,
            page_fingerprint=cache.page_fingerprint,
            state_fingerprint=cache.state_fingerprint,
        )

    def __post_init__(self) -> None:
        """A geometry is checked before use: it may come from a peer over the wire."""
        try:
            for name in (
                "base",
                "size",
                "block_bytes",
                "block_stride",
                "num_blocks",
                "max_blocks",
                "slot_bytes",
                "slot_stride",
                "slot_base",
                "first_slot",
                "total_slots",
            ):
                check_bytes(getattr(self, name), f"geometry {name}")
        except InvalidValueError as exc:
            raise LayoutMismatchError(f"malformed cache geometry: {exc}") from None
        problems = []
        if self.block_stride < self.block_bytes:
            problems.append(
                f"block_stride {self.block_stride} is below block_bytes {self.block_bytes} "
                "(blocks would overlap)"
            )
        if self.slot_stride < self.slot_bytes:
            problems.append(
                f"slot_stride {self.slot_stride} is below slot_bytes {self.slot_bytes} "
                "(slots would overlap)"
            )
        if self.num_blocks > self.max_blocks:
            problems.append(f"num_blocks {self.num_blocks} exceeds max_blocks {self.max_blocks}")
        if self.max_blocks and self.max_blocks * self.block_stride > self.size:
            problems.append(f"{self.max_blocks} blocks do not fit the region of {self.size} bytes")
        if self.slot_base + self.total_slots * self.slot_stride > self.size:
            problems.append(f"{self.total_slots} slots do not fit the region of {self.size} bytes")
        if self.first_slot > self.total_slots:
            problems.append(f"first_slot {self.first_slot} exceeds total_slots {self.total_slots}")
        if self.base + self.size > 1 << 64:
            problems.append(f"the region [{self.base:#x}, +{self.size}) exceeds the address space")
        for name in ("page_fingerprint", "state_fingerprint"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, str) or len(value) != 64 or value.strip("0123456789abcdef")
            ):
                problems.append(f"{name} {value!r} is not a SHA-256 hex digest")
        if problems:
            raise LayoutMismatchError("malformed cache geometry: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> CacheGeometry:
        """A peer's geometry record; anything but the exact fields is a layout mismatch."""
        want = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != want:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise LayoutMismatchError(
                f"malformed cache geometry record: expected the fields {sorted(want)}, got {got}"
            )
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
