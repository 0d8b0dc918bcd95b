"""Descriptors for shipping one request, planned from ids and geometry alone.

A request ships as ONE descriptor per state slot plus one per run of blocks
that is consecutive on both sides, because kvarena keeps a request's state
contiguous and its blocks block-major in one registered buffer. Every row is
checked against both registered regions and against the pools' own ranges
(blocks below the PAGE capacity, slots inside the STATE pool) before it is
handed to the transfer engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..checks import MAX_BYTES, check_ids
from ..errors import InvalidValueError, LayoutMismatchError
from ..spans import coalesce
from .geometry import CacheGeometry


class DescriptorBoundsError(InvalidValueError):
    """A descriptor would address bytes outside a registered region or pool."""


@dataclass(frozen=True, eq=False)
class RequestDescriptors:
    """Rows ``(address, length)`` for both sides, index-aligned."""

    local: np.ndarray  # [n, 2] uint64: address, length
    remote: np.ndarray

    @property
    def count(self) -> int:
        return int(self.local.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 1].sum()) if self.count else 0

    def nixl_rows(self, side: str) -> np.ndarray:
        """``[n, 3]`` rows (address, length, device id 0) as NIXL's prepped lists take them."""
        rows = self.local if side == "local" else self.remote
        out = np.zeros((rows.shape[0], 3), dtype=np.uint64)
        out[:, :2] = rows
        return out


def _ids(values: Sequence[int], what: str) -> np.ndarray:
    arr = check_ids(values, what, lo=0, hi=MAX_BYTES)
    if np.unique(arr).size != arr.size:
        raise DescriptorBoundsError(f"{what} names an id twice: {arr.tolist()}")
    return arr


def _check_pool(g: CacheGeometry, blocks: np.ndarray, slots: np.ndarray, side: str) -> None:
    if blocks.size and blocks.max() >= g.num_blocks:
        raise DescriptorBoundsError(
            f"{side} block {int(blocks.max())} is outside its PAGE pool (blocks 0..{g.num_blocks - 1})"
        )
    bad = slots[(slots < g.first_slot) | (slots >= g.total_slots)]
    if bad.size:
        raise DescriptorBoundsError(
            f"{side} slot {int(bad[0])} is outside its STATE pool (slots {g.first_slot}..{g.total_slots - 1})"
        )


def _check_region(g: CacheGeometry, offsets: np.ndarray, lengths: np.ndarray, side: str) -> None:
    if offsets.size and (offsets.min() < 0 or int((offsets + lengths).max()) > g.size):
        raise DescriptorBoundsError(
            f"{side} descriptor reaches [{int(offsets.min())}, {int((offsets + lengths).max())}) "
            f"outside the registered region [0, {g.size})"
        )


def plan_request(
    src: CacheGeometry,
    dst: CacheGeometry,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    src_slots: Sequence[int],
    dst_slots: Sequence[int],
) -> RequestDescriptors:
    """Descriptors moving ``src_blocks[i] -> dst_blocks[i]`` and ``src_slots[j] -> dst_slots[j]``."""
    problems = src.mismatches(dst)
    if problems:
        raise LayoutMismatchError(
            "layouts differ; refusing to plan a transfer: " + "; ".join(problems)
        )
    sb, db = _ids(src_blocks, "source blocks"), _ids(dst_blocks, "destination blocks")
    ss, ds = _ids(src_slots, "source slots"), _ids(dst_slots, "destination slots")
    if sb.size != db.size or ss.size != ds.size:
        raise DescriptorBoundsError(
            f"{sb.size} source blocks for {db.size} destination blocks and {ss.size} source slots "
            f"for {ds.size} destination slots; each side needs the same counts"
        )
    _check_pool(src, sb, ss, "source")
    _check_pool(dst, db, ds, "destination")
    b_src, b_dst = src.block_offset(sb), dst.block_offset(db)
    # Blocks consecutive on both sides merge into one run (strides equal the
    # block size once padded, so a run is one contiguous range on each side).
    same_stride = src.block_stride == dst.block_stride == src.block_bytes
    lengths = np.full(sb.size, src.block_bytes, dtype=np.int64)
    if same_stride:
        b_src, b_dst, lengths = coalesce(b_src, b_dst, lengths)
    s_src, s_dst = src.slot_offset(ss), dst.slot_offset(ds)
    s_len = np.full(ss.size, src.slot_bytes, dtype=np.int64)
    off_src = np.concatenate([b_src, s_src])
    off_dst = np.concatenate([b_dst, s_dst])
    length = np.concatenate([lengths, s_len])
    _check_region(src, off_src, length, "source")
    _check_region(dst, off_dst, length, "destination")
    local = np.stack([off_src + src.base, length], axis=1).astype(np.uint64)
    remote = np.stack([off_dst + dst.base, length], axis=1).astype(np.uint64)
    return RequestDescriptors(local, remote)


def per_layer_descriptor_count(
    page_field_layers: int, state_field_layers: int, block_runs: int, slots: int
) -> int:
    """What an engine that registers one region per layer per tensor would post."""
    return page_field_layers * block_runs + state_field_layers * slots
