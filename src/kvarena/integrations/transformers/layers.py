"""The layers of a ``KvarenaCache``: paged attention over block tables, sliding rings
in the rows' slots, and layers that cache nothing (linear attention: ``linear.py``)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

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
