"""The layers of a ``KvarenaCache``: paged attention over block tables, sliding rings
and linear-attention states in the rows' slots, and layers that cache nothing."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from ...errors import InvalidValueError, LayoutMismatchError
from .rows import Rows


def _check_dtype(t: torch.Tensor, want: torch.dtype, what: str, layer: int) -> None:
    if t.dtype != want:
        raise LayoutMismatchError(
            f"layer {layer}: the model hands {what} in {t.dtype} but the pool declares {want}; "
            "build the pool with the model's dtype (KvarenaPool.from_config(..., dtype=model.dtype))"
        )


class _InPool:
    """What every kvarena layer answers alike: its bytes stay in the pool (no
    offload or prefetch), and beams are reordered once for all layers by
    :meth:`KvarenaCache.reorder_cache`, not layer by layer."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        return None

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None


class PagedLayer(_InPool, CacheLayerMixin):
    """A full-attention layer over block tables."""

    is_sliding = False
    is_croppable = True

    def __init__(self, rows: Rows, index: int, group: int, tokens: int) -> None:
        super().__init__()
        self.rows, self.layer_idx, self.group = rows, index, group
        self.tokens = tokens
        self.is_initialized = True
        self.k = rows.cache.page_view("k")[group]  # [blocks, block, heads, dim]
        self.v = rows.cache.page_view("v")[group]
        self.device = self.k.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.rows.check_live()
        _check_dtype(key_states, self.k.dtype, "keys", self.layer_idx)
        _check_dtype(value_states, self.v.dtype, "values", self.layer_idx)
        n, t = self.tokens, key_states.shape[-2]
        self.rows.prepare(n, n + t)
        if t == 1:  # a decode step: one token per row, written by plain indexing
            bs = self.rows.cache.block_size
            for r, table in enumerate(self.rows.tables):
                b, o = table.blocks[n // bs], n % bs
                self.k[b, o].copy_(key_states[r, :, 0])
                self.v[b, o].copy_(value_states[r, :, 0])
        else:
            blk, row = self.rows.index(n, n + t)
            self.k.index_put_((blk, row), key_states.transpose(1, 2))
            self.v.index_put_((blk, row), value_states.transpose(1, 2))
        self.tokens = n + t
        self.rows.wrote(n + t)
        ids, nb = self.rows.blocks(n + t)
        b = key_states.shape[0]
        return self._read(self.k, ids, b, nb, n + t), self._read(self.v, ids, b, nb, n + t)

    def _read(
        self, pages: torch.Tensor, ids: torch.Tensor, b: int, nb: int, s: int
    ) -> torch.Tensor:
        """``[B, heads, s, dim]`` from whole blocks (``[blocks, block, heads, dim]``)."""
        got = pages.index_select(0, ids)  # [B * nb, block, heads, dim], one run per block
        return got.view(b, nb * got.shape[1], *got.shape[2:])[:, :s].transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        self.tokens = _cropped(self.tokens, tokens_to_remove)


def _cropped(tokens: int, remove: int) -> int:
    """The length left by transformers' ``crop(remove)``: a negative ``remove``
    takes that many tokens off, 0 takes none; a positive one (the old "final
    length" spelling) is refused, as transformers refuses it."""
    if isinstance(remove, bool) or not isinstance(remove, int) or remove > 0:
        raise InvalidValueError(
            f"crop({remove!r}): pass a negative int, the number of tokens to remove"
        )
    if -remove > tokens:
        raise InvalidValueError(f"crop({remove}) of a {tokens}-token cache removes too much")
    return tokens + remove


class RingLayer(_InPool, CacheLayerMixin):
    """A sliding-window layer: a ring of ``window + rollback`` tokens in each
    row's slot.

    It answers transformers' sliding contract: attention sees the last
    ``window - 1`` cached tokens plus the new ones; token ``p`` lives in ring
    row ``p % rows``. The ``rollback`` extra rows still hold the tokens just
    before the window, so ``crop`` can take back up to ``rollback + 1``
    tokens and find the window it must keep intact."""

    is_sliding = True

    def __init__(self, rows: Rows, index: int, group: int, tokens: int, window: int) -> None:
        super().__init__()
        self.rows, self.layer_idx, self.group = rows, index, group
        self.tokens, self.window = tokens, window
        self.ring = {f.name: f for f in rows.cache.state_fields}["k_window"].shape[0]
        self.written = tokens  # the ring holds positions [written - ring, written)
        # Rollback rows past the window make a crop possible.
        self.is_croppable = self.ring > self.window
        self.is_initialized = True
        self.sliding_window = window
        self.cumulative_length = tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.rows.check_live()
        kr = self.rows.state("k_window")[self.group]  # [B, ring, heads, dim]
        vr = self.rows.state("v_window")[self.group]
        _check_dtype(key_states, kr.dtype, "keys", self.layer_idx)
        n, t, w, ring = self.tokens, key_states.shape[-2], self.window, self.ring
        kept = min(n, w - 1)
        old = torch.arange(n - kept, n, device=kr.device) % ring
        full_k = torch.cat([kr[:, old].transpose(1, 2), key_states], dim=-2)
        full_v = torch.cat([vr[:, old].transpose(1, 2), value_states], dim=-2)
        m = min(t, ring)
        new = torch.arange(n + t - m, n + t, device=kr.device) % ring
        kr[:, new] = key_states[:, :, t - m :].transpose(1, 2)
        vr[:, new] = value_states[:, :, t - m :].transpose(1, 2)
        self.tokens = self.cumulative_length = self.written = n + t
        return full_k, full_v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        n, w = self.tokens, self.window
        if n >= w:
            return w - 1 + query_length, n - w + 1
        return n + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens

    def get_max_length(self) -> int:
        return self.window

    def reset(self) -> None:
        self.tokens = self.cumulative_length = self.written = 0

    def crop(self, tokens_to_remove: int) -> None:
        keep = _cropped(self.tokens, tokens_to_remove)
        # The window ending at `keep` must still be in the ring: its oldest
        # token (keep - window + 1) not yet overwritten (written - ring).
        oldest = max(keep - self.window + 1, 0)
        if keep < self.tokens and oldest < self.written - self.ring:
            raise InvalidValueError(
                f"crop to {keep} tokens: the sliding ring of layer {self.layer_idx} holds "
                f"{self.ring} rows for a {self.window}-token window, so it rolls back at most "
                f"{self.ring - self.window + 1} tokens; build the pool with a larger rollback_tokens"
            )
        self.tokens = self.cumulative_length = keep


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
        states = [recurrent_states] if isinstance(recurrent_states, torch.Tensor) else list(
            recurrent_states
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


class NoneLayer(_InPool, CacheLayerMixin):
    """A layer that keeps nothing (MLP / MoE / a KV-sharing consumer)."""

    supports_early_init = False
    is_compileable = True
    is_croppable = True

    def __init__(self) -> None:
        super().__init__()
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise InvalidValueError("this layer keeps no cache")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        return None

    def crop(self, tokens_to_remove: int) -> None:
        return None
