"""The checkpoint images of a :class:`~kvarena.pools.unified.UnifiedCache`.

An image is a state's (or a KV block's) checkpoint ranges stored into PAGE
blocks of the same pool, used as units: :class:`ImageAccess`, an object the
cache holds, plans images from the cache's fields and copies them with
:mod:`kvarena.checkpoint`, checking every id against the allocators' state at
the moment of the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..checkpoint import CheckpointSpec, PageUnits, restore, store
from ..checks import check_bytes
from ..copy import CopyStats
from ..errors import InvalidValueError
from ..layout import EntryMajorArena, LayerMajorArena
from ..layout.fields import EntryField
from .blocks import BlockAllocator
from .states import StateAllocator


@dataclass(frozen=True)
class _BlockReader:
    """Blocks as the source of block images: live or cached ones may be read."""

    blocks: BlockAllocator

    def check_held(self, slots: object, what: str) -> np.ndarray:
        return self.blocks.check_held(slots, f"{what} (blocks)", writing=False)


@dataclass(frozen=True)
class _BlockWriter:
    """Blocks as the target of block images: only live ones may be written."""

    blocks: BlockAllocator

    def check_held(self, slots: object, what: str) -> np.ndarray:
        return self.blocks.check_held(slots, f"{what} (blocks)", writing=True)


class ImageAccess:
    """Images of states and of blocks in PAGE units, over one cache's buffer,
    arenas and allocators (given at construction)."""

    def __init__(
        self,
        *,
        buf: torch.Tensor,
        state: EntryMajorArena,
        pages: EntryMajorArena | LayerMajorArena,
        blocks: BlockAllocator,
        slots: StateAllocator,
        page_fields: tuple[EntryField, ...],
        state_fields: tuple[EntryField, ...],
        block_stride: int,
        max_blocks: int,
    ) -> None:
        self.buf, self.state, self.pages = buf, state, pages
        self.blocks, self.slots = blocks, slots
        self.page_fields, self.state_fields = page_fields, state_fields
        self.block_stride, self.max_blocks = block_stride, max_blocks
        self._specs: dict[int, CheckpointSpec] = {}  # by unit bytes (negative: PAGE images)

    def block_pages(self, what: str) -> EntryMajorArena:
        """The PAGE pool, for what needs each block as one contiguous entry
        (block bytes, images, block copies); refused for a layer-major pool or
        a cache without PAGE fields."""
        if not self.page_fields or not isinstance(self.pages, EntryMajorArena):
            raise InvalidValueError(
                f"{what} needs an entry-major PAGE pool (a block is one contiguous entry); "
                + (
                    "this cache's is layer-major, with no contiguous block: use page_view"
                    if self.page_fields
                    else "this cache has no PAGE fields"
                )
            )
        return self.pages

    def checkpoint_spec(self, unit_bytes: int | None = None) -> CheckpointSpec:
        """The image plan of this cache's state, in units of ``unit_bytes`` (default: a
        whole block stride, so one image takes the fewest blocks)."""
        unit = self.block_stride if unit_bytes is None else unit_bytes
        key = check_bytes(unit, "unit_bytes", lo=1)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = CheckpointSpec.build(self.state_fields, key)
        return spec

    def page_units(self, unit_bytes: int | None = None) -> PageUnits:
        """The PAGE pool seen as image units: unit ``u`` is block ``u``'s first
        ``unit_bytes`` bytes (default the whole block stride).

        The units' liveness is the block allocator's, read at each copy, so the
        same object stays true across boundary moves.
        """
        self.block_pages("image units")
        unit = self.block_stride if unit_bytes is None else unit_bytes
        unit = check_bytes(unit, "unit_bytes", lo=1)
        if unit > self.block_stride:
            raise InvalidValueError(
                f"unit_bytes {unit} exceeds the block stride {self.block_stride}; a unit is one block"
            )
        return PageUnits(
            buf=self.buf,
            unit_bytes=unit,
            unit_stride=self.block_stride,
            num_units=self.max_blocks,
            holder=self.blocks,
        )

    def store(
        self, spec: CheckpointSpec, slots: Sequence[int], unit_lists: Sequence[Sequence[int]]
    ) -> CopyStats:
        """Copy each slot's checkpoint image into its units (blocks it holds live)."""
        return store(
            spec,
            self.state,
            slots,
            self.page_units(spec.unit_bytes),
            unit_lists,
            slot_holder=self.slots,
        )

    def restore(
        self, spec: CheckpointSpec, slots: Sequence[int], unit_lists: Sequence[Sequence[int]]
    ) -> CopyStats:
        """Copy each image ``unit_lists[c]`` back into ``slots[c]``, a slot a request
        holds (the arguments in :meth:`store`'s order: slots, then their units)."""
        return restore(
            spec,
            self.state,
            slots,
            self.page_units(spec.unit_bytes),
            unit_lists,
            slot_holder=self.slots,
        )

    def block_checkpoint_spec(self, unit_bytes: int | None = None) -> CheckpointSpec:
        """The image plan of one KV block (its PAGE fields), in units of ``unit_bytes``
        (default a whole block stride): what :meth:`store_blocks` writes."""
        self.block_pages("block images")
        unit = self.block_stride if unit_bytes is None else unit_bytes
        key = -check_bytes(unit, "unit_bytes", lo=1)  # negative keys: PAGE specs
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = CheckpointSpec.build(self.page_fields, -key)
        return spec

    def store_blocks(
        self, spec: CheckpointSpec, blocks: Sequence[int], unit_lists: Sequence[Sequence[int]]
    ) -> CopyStats:
        """Copy each block's bytes (a live or cached block) into image units (blocks
        held live): a KV block kept aside, e.g. before it is overwritten."""
        return store(
            spec,
            self.block_pages("store_blocks"),
            blocks,
            self.page_units(spec.unit_bytes),
            unit_lists,
            slot_holder=_BlockReader(self.blocks),
        )

    def restore_blocks(
        self, spec: CheckpointSpec, blocks: Sequence[int], unit_lists: Sequence[Sequence[int]]
    ) -> CopyStats:
        """Copy block images ``unit_lists[c]`` back into live blocks ``blocks[c]``."""
        pages = self.block_pages("restore_blocks")
        return restore(
            spec,
            pages,
            blocks,
            self.page_units(spec.unit_bytes),
            unit_lists,
            slot_holder=_BlockWriter(self.blocks),
        )
