"""The linear-attention layer of a ``KvarenaCache``: conv and recurrent states in
the rows' slots, and what a crop needs while the past is recorded."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ...errors import InvalidValueError, LayoutMismatchError
from .layers import _check_dtype, _InPool
from .rows import Rows


class LinearLayer(_InPool, LinearAttentionCacheLayerMixin):
    """A linear-attention layer whose conv and recurrent states are the rows' slots.

    It counts its tokens itself (transformers 5.25 asks a linear layer for its
    length; 5.24 asked the first attention layer), and while past recording is
    on with ``recurrent_states_to_keep > 0`` (transformers 5.25's contract for
    speculative rollback) it keeps what a crop needs, keyed by position: the
    recurrent state from before each forward and the intermediate ones the
    model hands over, and every conv input since recording began. Those are
    working copies outside the pool, dropped at the next crop; the pool's slots
    always hold the live state."""

    def __init__(self, rows: Rows, index: int, group: int, tokens: int, started: bool) -> None:
        super().__init__(number_of_states=1)
        self.rows, self.layer_idx, self.group = rows, index, group
        fields = {f.name: f for f in rows.cache.state_fields}
        self.kernel = fields["conv_state"].shape[-1]
        self.has_recurrent = "recurrent_state" in fields
        self.fields = ["conv_state", *(["recurrent_state"] if self.has_recurrent else [])]
        self.conv_kernel_size[0] = self.kernel
        self.has_previous_state[0] = started
        self.batch_size = len(rows.requests)
        self.tokens = tokens
        self.record_past = False
        self.recurrent_states_to_keep = 0
        # position -> the recurrent state after that many tokens (recording only)
        self.history: dict[int, torch.Tensor] = {}
        # every conv input column since recording began, the last at position tokens - 1,
        # preceded by the `kernel` columns of the conv state it started from
        self.conv_record: torch.Tensor | None = None
        self._forward_start = tokens
        self.attach()

    def attach(self) -> None:
        """Point the states at the rows' slots (again, after the rows changed)."""
        conv = self.rows.state("conv_state")[self.group]
        self.conv_states[0] = conv
        self.dtype, self.device = conv.dtype, conv.device  # type: ignore[assignment]
        self.is_conv_states_initialized[0] = True
        if self.has_recurrent:
            self.recurrent_states[0] = self.rows.state("recurrent_state")[self.group]
            self.is_recurrent_states_initialized[0] = True
        self.batch_size = len(self.rows.requests)

    def lazy_initialization(
        self,
        conv_states: torch.Tensor | None = None,
        recurrent_states: torch.Tensor | list[torch.Tensor] | None = None,
        state_idx: int = 0,
        **kwargs: Any,
    ) -> None:
        return None

    def _check_idx(self, state_idx: int) -> None:
        if state_idx != 0:
            raise InvalidValueError(f"layer {self.layer_idx}: one state per layer; got {state_idx}")

    def activate_past_recording(
        self, recurrent_states_to_keep: int | None = None, **kwargs: Any
    ) -> None:
        """Keep what a crop needs from now on: with ``recurrent_states_to_keep``
        (transformers >= 5.25) the model hands that many intermediate states of a
        multi-token forward, kept here by position."""
        keep = recurrent_states_to_keep or 0
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise InvalidValueError(
                f"activate_past_recording: recurrent_states_to_keep={recurrent_states_to_keep!r}; "
                "pass a non-negative int or None"
            )
        self.record_past = True
        self.recurrent_states_to_keep = keep  # the name transformers reads
        self.forget()

    @property
    def states_to_keep(self) -> int:
        """Intermediate recurrent states asked of a forward (0: none, or not recording)."""
        return int(self.recurrent_states_to_keep or 0) if self.record_past else 0

    def forget(self) -> None:
        """Drop the kept history (after a crop, a reset, or rows that changed)."""
        self.history.clear()
        self.conv_record = None

    def get_seq_length(self) -> int:  # type: ignore[override]
        return self.tokens

    def increase_count(self, state_idx: int) -> None:
        """A decode kernel updated the conv state in place (transformers >= 5.25 says so)."""
        if state_idx == 0:
            self.tokens += 1

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        self.rows.check_live()
        self._check_idx(state_idx)
        if conv_kernel_size is not None and conv_kernel_size != self.kernel:
            raise LayoutMismatchError(
                f"layer {self.layer_idx}: conv kernel {conv_kernel_size}, pool declares {self.kernel}"
            )
        view = self.conv_states[0]
        assert view is not None
        _check_dtype(conv_states, view.dtype, "conv states", self.layer_idx)
        if not self.has_previous_state[0]:
            full = conv_states
            if full.shape[-1] < self.kernel:
                full = torch.nn.functional.pad(full, (self.kernel - full.shape[-1], 0))
            self.has_previous_state[0] = True
        else:
            full = torch.cat([view, conv_states], dim=-1)
        if self.states_to_keep:
            # `full` ends at the new tokens and starts with at least `kernel`
            # columns of context (the old state, or zero padding of a prefill).
            if self.conv_record is None:
                self.conv_record = full.detach().clone()
            else:
                self.conv_record = torch.cat([self.conv_record, conv_states.detach()], dim=-1)
        self._forward_start = self.tokens
        self.tokens += conv_states.shape[-1]
        view.copy_(full[..., -self.kernel :])
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor | list[torch.Tensor], state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.rows.check_live()
        self._check_idx(state_idx)
        view = self.recurrent_states[0]
        if view is None:
            raise LayoutMismatchError(
                f"layer {self.layer_idx}: the pool declares no recurrent state"
            )
        # transformers >= 5.25 may hand the states after each of a forward's last
        # tokens: the last is the live state, the others are history.
        states = (
            [recurrent_states]
            if isinstance(recurrent_states, torch.Tensor)
            else list(recurrent_states)
        )
        if not states:
            raise InvalidValueError(f"layer {self.layer_idx}: an empty list of recurrent states")
        last = states[-1]
        _check_dtype(last, view.dtype, "recurrent states", self.layer_idx)
        if self.states_to_keep:
            end = self.tokens
            self.history[self._forward_start] = view.detach().clone()
            for i, s in enumerate(states[:-1]):
                self.history[end - len(states) + 1 + i] = s.detach()
        view.copy_(last)
        self.has_previous_state[0] = True
        return view

    def rollback_covers(self, remove: int) -> bool:
        """Whether the kept history alone restores this layer ``remove`` tokens back."""
        if not remove:
            return True
        if not self.record_past or self.conv_record is None:
            return False
        if self.conv_record.shape[-1] < remove + self.kernel:
            return False
        return not self.has_recurrent or (self.tokens - remove) in self.history

    def roll_back(self, remove: int) -> None:
        """Restore the state ``remove`` tokens back from the kept history (checked
        by :meth:`rollback_covers` first), then drop the history."""
        if remove:
            assert self.conv_record is not None
            conv = self.conv_states[0]
            assert conv is not None
            conv.copy_(self.conv_record[..., -remove - self.kernel : -remove])
            if self.has_recurrent:
                rec = self.recurrent_states[0]
                assert rec is not None
                rec.copy_(self.history[self.tokens - remove])
            self.tokens -= remove
        self.forget()

    def reset(self) -> None:
        for t in (self.conv_states[0], self.recurrent_states[0]):
            if t is not None:
                t.zero_()
        self.has_previous_state[0] = False
        self.tokens = 0
        self.forget()

    def crop(self, tokens_to_remove: int) -> None:
        raise InvalidValueError(
            "a linear-attention state is rolled back by its cache (KvarenaCache.crop), "
            "not layer by layer"
        )
