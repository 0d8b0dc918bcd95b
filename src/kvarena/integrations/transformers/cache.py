"""``KvarenaCache``: a transformers ``Cache`` whose bytes live in a kvarena pool.

Every row of the batch is one request: a :class:`BlockTable` for the paged
layers and a STATE slot for the rings and linear-attention states. The
layers hold no tensors of their own:

- a paged layer writes new K/V into the rows' blocks and reads the whole
  sequence back through the block tables (a gather, as ``DynamicCache``'s
  ``cat`` copies the sequence each step);
- a linear layer's conv and recurrent states ARE views of the rows' slots
  when the slots are consecutive (the usual case: a batch takes one run of
  slots), so the decode kernels that update the conv state in place update
  the pool; otherwise they are working copies, written back by :meth:`sync`
  before kvarena reads the slots (a checkpoint, a transfer, a release).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from transformers.cache_utils import Cache

from ...errors import InvalidValueError
from ...pools import BlockTable
from .layers import NoneLayer, PagedLayer, RingLayer, _cropped
from .layout import LINEAR, NONE, PAGED, RING, HfLayout
from .linear import LinearLayer
from .rollback import MixerReplay
from .rows import Rows


def _row_selection(beam_idx: object, rows: int) -> list[int]:
    """``beam_idx`` as row numbers: a 1-D integer tensor of ``rows`` values in ``[0, rows)``."""
    if (
        not isinstance(beam_idx, torch.Tensor)
        or beam_idx.dim() != 1
        or beam_idx.dtype.is_floating_point
        or beam_idx.dtype.is_complex
        or beam_idx.dtype == torch.bool
        or beam_idx.device.type == "meta"
    ):
        got = (
            f"a {beam_idx.dim()}-D {beam_idx.dtype} tensor on {beam_idx.device}"
            if isinstance(beam_idx, torch.Tensor)
            else type(beam_idx).__name__
        )
        raise InvalidValueError(
            f"reorder_cache: beam_idx must be a 1-D integer tensor of row numbers; got {got}"
        )
    order = [int(i) for i in beam_idx.tolist()]
    if len(order) != rows or not all(0 <= i < rows for i in order):
        raise InvalidValueError(
            f"reorder_cache: beam_idx {order[:16]} is not a selection of the {rows} rows"
        )
    return order


class KvarenaCache(Cache):
    """A batch of requests in a :class:`KvarenaPool`, as transformers' ``Cache``.

    Made by ``pool.new_cache(batch_size)`` or ``pool.prefill(...)``; given back
    with ``pool.release(cache)`` (``generate`` never frees a cache passed in).
    """

    def __init__(
        self, layout: HfLayout, rows: Rows, tokens: int, started: bool, model: Any = None
    ) -> None:
        self.rows = rows
        self.recording = False
        layers: list[Any] = []
        for i, (kind, g) in enumerate(zip(layout.kinds, layout.group, strict=True)):
            if kind == PAGED:
                layers.append(PagedLayer(rows, i, g, tokens))
            elif kind == RING:
                layers.append(RingLayer(rows, i, g, tokens, layout.window))
            elif kind == LINEAR:
                layers.append(LinearLayer(rows, i, g, tokens, started))
            else:
                assert kind == NONE
                layers.append(NoneLayer())
        super().__init__(layers=layers)
        rows.paged_layers = sum(1 for x in layers if isinstance(x, PagedLayer))
        self._replay: MixerReplay | None = None
        if model is not None and any(isinstance(x, LinearLayer) for x in layers):
            if rows.rollback_index is None:
                raise InvalidValueError(
                    "this pool keeps no rollback entry: build it with rollback_tokens > 0 "
                    "for crop (assisted decoding) on linear-attention layers"
                )
            self._replay = MixerReplay(self, model)

    def activate_past_recording(
        self, recurrent_states_to_keep: int | None = None, **kwargs: Any
    ) -> None:
        """transformers asks before a draft is verified: from now on the cache keeps
        what ``crop`` needs. Linear layers keep the states the model hands over
        (``recurrent_states_to_keep``, transformers >= 5.25); a cache made with
        ``model=`` also records the mixers' inputs, to replay what those states
        do not cover (transformers 5.24 hands none)."""
        self._check_live()
        for layer in self.layers:
            if isinstance(layer, LinearLayer):
                # checks the count before anything is recorded
                layer.activate_past_recording(recurrent_states_to_keep)
        self.recording = True
        for layer in self.layers:
            if not isinstance(layer, LinearLayer) and hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """How many intermediate recurrent states a forward should hand layer
        ``layer_idx`` (the most over all layers for None): 0 unless recording."""
        keep = {
            i: x.states_to_keep
            for i, x in enumerate(self.layers)
            if isinstance(x, LinearLayer) and x.record_past
        }
        if layer_idx is None:
            return max(keep.values(), default=0)
        return keep.get(layer_idx, 0)

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        layer = self.layers[layer_idx]
        if isinstance(layer, LinearLayer):
            layer.increase_count(state_idx)

    def close(self) -> None:
        """Remove the hooks this cache placed on the model, and refuse every later
        use (the pool calls it on release, before it gives the blocks and slots back)."""
        if self._replay is not None:
            self._replay.close()
            self._replay = None
        self.rows.released = True

    def follow(self) -> None:
        """The pool moved the boundary: remake the rows' views and point the
        linear layers at their (possibly relocated) slots again."""
        self.rows.follow()
        for layer in self.layers:
            if isinstance(layer, LinearLayer):
                layer.attach()

    @property
    def released(self) -> bool:
        return self.rows.released

    @property
    def requests(self) -> list[Hashable]:
        return list(self.rows.requests)

    @property
    def slots(self) -> list[tuple[int, ...]]:
        return list(self.rows.slots)

    @property
    def block_tables(self) -> list[BlockTable]:
        return list(self.rows.tables)

    @property
    def is_compileable(self) -> bool:
        return False

    def sync(self) -> None:
        """Make the slots hold every state (a no-op when the states are views)."""
        self.rows.sync()

    def _check_live(self) -> None:
        self.rows.check_live()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached: layer ``layer_idx``'s count where it attends, else the
        first attending layer's (transformers 5.24's rule; in 5.25 linear layers
        count too, and agree), else the first linear layer's."""
        self._check_live()
        if not 0 <= layer_idx < len(self.layers):
            raise InvalidValueError(
                f"get_seq_length: layer_idx {layer_idx} is not a layer of this "
                f"{len(self.layers)}-layer cache"
            )
        attending = (PagedLayer, RingLayer)
        at = self.layers[layer_idx]
        if isinstance(at, attending):
            return at.get_seq_length()
        for kinds in (attending, LinearLayer):
            for layer in self.layers:
                if isinstance(layer, kinds):
                    return layer.get_seq_length()
        return 0

    # -- batch-wide operations: once for every layer --------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``r`` becomes old row ``beam_idx[r]``: its blocks shared (copied on
        the next write), its state copied whole, as one entry per row."""
        self._check_live()
        rows = self.rows
        order = _row_selection(beam_idx, len(rows.requests))
        if order == list(range(len(order))):
            return
        if rows.tables:
            new = [list(rows.tables[i].blocks) for i in order]
            tokens = [rows.tables[i].tokens for i in order]
            alloc = rows.cache.blocks
            for blocks in new:
                for b in blocks:
                    alloc.retain(b)
            for table, blocks, n in zip(rows.tables, new, tokens, strict=True):
                old = list(table.blocks)
                table.blocks[:] = blocks
                table.tokens = n
                for b in old:
                    alloc.release(b)
            rows.changed()
        for layer in self.layers:
            if isinstance(layer, LinearLayer):
                layer.forget()  # kept states are in the old row order
        if rows.slots:
            rows.sync()
            src = [rows.slots[i] for i in order]
            rows.cache.copy_slots(
                [s for group in src for s in group], [s for group in rows.slots for s in group]
            )
            if rows._copies:
                rows.reload()
                for layer in self.layers:
                    if isinstance(layer, LinearLayer):
                        layer.attach()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last tokens of every row: paged layers truncate their tables,
        rings step back within their rollback rows, linear-attention states are
        restored from the rollback entry and replayed over the accepted tokens
        (a cache made with ``model=`` in a pool with ``rollback_tokens``;
        refused otherwise). Every check runs before anything changes."""
        self._check_live()
        _cropped(1 << 62, tokens_to_remove)
        linear = [layer for layer in self.layers if isinstance(layer, LinearLayer)]
        # Kept states roll back without a replay when they cover every linear layer.
        kept = all(layer.rollback_covers(-tokens_to_remove) for layer in linear)
        if linear and not kept and self._replay is None:
            raise InvalidValueError(
                f"crop({tokens_to_remove}): layers {[x.layer_idx for x in linear][:4]} are "
                "linear attention, whose state cannot roll back without the states from "
                "before the last forward (activate_past_recording(recurrent_states_to_keep=N) "
                "on transformers >= 5.25, or a rollback entry: KvarenaPool(..., "
                "rollback_tokens=N) and new_cache(..., model=model))"
            )
        if linear and not kept and self._replay is not None:
            self._replay.check(tokens_to_remove)
        for layer in self.layers:
            if isinstance(layer, RingLayer):
                layer.crop(tokens_to_remove)  # refuses before anything changed
        for layer in self.layers:
            if isinstance(layer, PagedLayer):
                layer.crop(tokens_to_remove)
        keep = next((layer.tokens for layer in self.layers if isinstance(layer, PagedLayer)), None)
        if keep is not None:
            for t in self.rows.tables:
                t.truncate(min(keep, t.tokens))
        self.rows.changed()
        if kept:
            for layer in linear:
                layer.roll_back(-tokens_to_remove)
            if self._replay is not None:
                self._replay.forget()
        elif self._replay is not None:
            target = [layer.tokens + tokens_to_remove for layer in linear]
            self._replay.roll_back(-tokens_to_remove)
            for layer, n in zip(linear, target, strict=True):
                layer.tokens = n  # the replay counted its accepted tokens again
                layer.forget()

    @property
    def is_croppable(self) -> bool:
        """Whether a draft can be taken back: rings with rollback rows, and linear
        layers through a replay (a cache made with ``model=``) or, once recording
        with ``recurrent_states_to_keep``, through the states the model hands over."""
        return all(
            (self._replay is not None or (layer.record_past and layer.states_to_keep > 0))
            if isinstance(layer, LinearLayer)
            else getattr(layer, "is_croppable", True)
            for layer in self.layers
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise InvalidValueError(
            "KvarenaCache rows are requests: make a cache of the expanded batch size instead"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise InvalidValueError(
            "KvarenaCache rows are requests: release the cache and admit the rows kept"
        )

    def reset(self) -> None:
        self._check_live()
        for layer in self.layers:
            layer.reset()
        for t in self.rows.tables:
            t.truncate(0)
        self.rows.changed()
