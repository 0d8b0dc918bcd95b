"""Where the boundary between the PAGE and STATE pools can lie in one buffer.

One pure function of sizes, used by the planner (to promise counts) and by the
cache (to carve its buffer), so what a plan promises is what a cache holds.
PAGE blocks grow from offset 0 (block ``j`` at ``j * block_stride``); STATE
slots hang from the top (slot ``i`` at ``slot_base + i * slot_stride``), and
the STATE pool owns slots ``[first, total_slots)``. Every offset here is a
multiple of its pool's strictest alignment, so a buffer that starts on the
larger of the two alignments keeps every field aligned absolutely.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_bytes, check_count
from ..errors import InvalidValueError


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens, ``block_size`` to a block (the last one
    partly filled): the one ceiling every count of blocks for tokens uses."""
    return -(-check_count(tokens, "tokens") // check_count(block_size, "block_size", lo=1))


@dataclass(frozen=True, kw_only=True)
class PoolGeometry:
    """The byte plan of one unified buffer; a stride of 0 means "no such pool"."""

    total_bytes: int
    block_stride: int
    slot_stride: int
    state_alignment: int

    def __post_init__(self) -> None:
        check_bytes(self.total_bytes, "PoolGeometry: total_bytes")
        check_bytes(self.block_stride, "PoolGeometry: block_stride")
        check_bytes(self.slot_stride, "PoolGeometry: slot_stride")
        check_bytes(self.state_alignment, "PoolGeometry: state_alignment", lo=1)
        if self.slot_stride % self.state_alignment:
            raise InvalidValueError(
                f"PoolGeometry: slot_stride {self.slot_stride} is not a multiple of the STATE "
                f"alignment {self.state_alignment}"
            )

    @property
    def top(self) -> int:
        """End of the STATE region: the buffer's end rounded down to the STATE alignment."""
        return self.total_bytes // self.state_alignment * self.state_alignment

    @property
    def total_slots(self) -> int:
        """Slots the buffer holds if STATE took all of it (ids never change meaning)."""
        return self.top // self.slot_stride if self.slot_stride else 0

    @property
    def slot_base(self) -> int:
        """Byte offset of slot 0 (it lies at or above 0; slots are laid from the top)."""
        return self.top - self.total_slots * self.slot_stride

    @property
    def max_blocks(self) -> int:
        """Blocks the buffer holds if PAGE took all of it (block ids above never exist)."""
        return self.blocks_below(self.total_slots)

    def boundary(self, first_slot: int) -> int:
        """Byte offset where the STATE pool starts when it owns ``[first_slot, total_slots)``."""
        check_count(first_slot, "first_slot", hi=self.total_slots)
        return self.slot_base + first_slot * self.slot_stride

    def blocks_below(self, first_slot: int) -> int:
        """Whole blocks that fit below the STATE pool's first slot."""
        return self.boundary(first_slot) // self.block_stride if self.block_stride else 0

    def blocks_with_slots(self, slots: int) -> int:
        """Blocks left when the STATE pool owns the top ``slots`` slots."""
        return self.blocks_below(
            self.total_slots - check_count(slots, "slots", hi=self.total_slots)
        )
