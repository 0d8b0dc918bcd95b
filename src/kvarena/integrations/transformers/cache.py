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

import inspect
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from ...errors import InvalidValueError, LayoutMismatchError
from ...pools import BlockTable, UnifiedCache
from .layout import LINEAR, NONE, PAGED, RING, HfLayout

if TYPE_CHECKING:
    from .pool import KvarenaPool


class _Rows:
    """The batch's requests, shared by every layer of one cache."""

    def __init__(
        self,
        cache: UnifiedCache,
        requests: list[Hashable],
        tables: list[BlockTable],
        slots: list[tuple[int, ...]],
    ) -> None:
        self.cache = cache
        self.requests = requests
        self.tables = tables
        self.slots = slots
        self._states: dict[str, torch.Tensor] = {}
        self._copies: set[str] = set()  # fields held as working copies
        self._index: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._prepared: tuple[int, int] | None = None
        self.released = False  # set once, by the cache's close(): then every use refuses
        # A window of tokens counts in the tables (and so can be committed to the
        # prefix cache) only once every paged layer wrote it: a forward that
        # raises in layer 5 leaves the tables where the last whole forward left them.
        self.paged_layers = 0
        self._wrote: dict[int, int] = {}  # window end -> paged layers that wrote it
        # Each row's first rollback entry, where a crop finds the state from
        # before the last forward (None: the pool keeps no rollback entries).
        self.rollback_index = (
            torch.tensor([g[1] for g in slots], device=cache.device)
            if slots and len(slots[0]) > 1
            else None
        )

    def check_live(self) -> None:
        if self.released:
            raise InvalidValueError(
                "this KvarenaCache was released to its pool: its blocks and slots may belong "
                "to another cache now; make a new cache (pool.new_cache or pool.prefill)"
            )

    def wrote(self, end: int) -> None:
        """One paged layer wrote its tokens up to ``end``; the last of them advances
        every row's table to ``end``."""
        n = self._wrote.get(end, 0) + 1
        if n < self.paged_layers:
            self._wrote[end] = n
            return
        self._wrote.pop(end, None)
        for t in self.tables:
            t.tokens = max(t.tokens, end)

    @property
    def live_slots(self) -> list[int]:
        return [s[0] for s in self.slots]

    # -- states --------------------------------------------------------------
    def state(self, name: str) -> torch.Tensor:
        """``[layers, B, *shape]`` of a STATE field over the rows' live slots."""
        t = self._states.get(name)
        if t is None:
            t = self.cache.state_rows(name, self.live_slots)
            if t is None:  # scattered slots: a working copy, written back by sync()
                t = self.cache.gather_states(name, self.live_slots)
                self._copies.add(name)
            self._states[name] = t
        return t

    def sync(self) -> None:
        """Write working copies back into the slots (views need nothing)."""
        for name in self._copies:
            self.cache.scatter_states(name, self.live_slots, self._states[name])

    def reload(self) -> None:
        """Forget views and copies (the slots' bytes changed under them)."""
        self._states.clear()
        self._copies.clear()

    # -- blocks --------------------------------------------------------------
    def prepare(self, start: int, end: int) -> None:
        """Blocks for tokens ``[start, end)`` of every row, private (copied on write)."""
        if self._prepared == (start, end):
            return
        changed = False
        for t in self.tables:
            held = len(t.blocks)
            changed |= bool(t.prepare_write(start, end)) or len(t.blocks) != held
        if changed:  # block ids moved: cached index tensors are stale
            self._index.clear()
        self._prepared = (start, end)

    def index(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block, row)`` index tensors ``[B, end - start]`` of the tokens."""
        bs = self.cache.block_size
        key = (start, end)
        got = self._index.get(key)
        if got is None:
            flat = torch.stack([t.token_index(start, end) for t in self.tables])
            flat = flat.to(self.cache.device)
            got = self._index[key] = (flat // bs, flat % bs)
        return got

    def blocks(self, tokens: int) -> tuple[torch.Tensor, int]:
        """The rows' first ``ceil(tokens / block_size)`` blocks, row after row, as
        one index tensor, and that count: a read gathers whole blocks (one
        contiguous run per block and layer), not single tokens."""
        n = -(-tokens // self.cache.block_size)
        key = (-1, n)
        got = self._index.get(key)
        if got is None:
            ids = [b for t in self.tables for b in t.blocks[:n]]
            got = self._index[key] = (torch.tensor(ids, device=self.cache.device), torch.empty(0))
        return got[0], n

    def changed(self) -> None:
        self._index.clear()
        self._prepared = None


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

    def __init__(self, rows: _Rows, index: int, group: int, tokens: int) -> None:
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

    def __init__(self, rows: _Rows, index: int, group: int, tokens: int, window: int) -> None:
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
    """A linear-attention layer whose conv and recurrent states are the rows' slots."""

    def __init__(self, rows: _Rows, index: int, group: int, started: bool) -> None:
        super().__init__(number_of_states=1)
        self.rows, self.layer_idx, self.group = rows, index, group
        fields = {f.name: f for f in rows.cache.state_fields}
        self.kernel = fields["conv_state"].shape[-1]
        self.has_recurrent = "recurrent_state" in fields
        self.fields = ["conv_state", *(["recurrent_state"] if self.has_recurrent else [])]
        self.conv_kernel_size[0] = self.kernel
        self.has_previous_state[0] = started
        self.batch_size = len(rows.requests)
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
        recurrent_states: torch.Tensor | None = None,
        state_idx: int = 0,
    ) -> None:
        return None

    def _check_idx(self, state_idx: int) -> None:
        if state_idx != 0:
            raise InvalidValueError(f"layer {self.layer_idx}: one state per layer; got {state_idx}")

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
        view.copy_(full[..., -self.kernel :])
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.rows.check_live()
        self._check_idx(state_idx)
        view = self.recurrent_states[0]
        if view is None:
            raise LayoutMismatchError(
                f"layer {self.layer_idx}: the pool declares no recurrent state"
            )
        _check_dtype(recurrent_states, view.dtype, "recurrent states", self.layer_idx)
        view.copy_(recurrent_states)
        self.has_previous_state[0] = True
        return view

    def reset(self) -> None:
        for t in (self.conv_states[0], self.recurrent_states[0]):
            if t is not None:
                t.zero_()
        self.has_previous_state[0] = False

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


def linear_mixers(model: Any, layers: set[int]) -> dict[int, Any]:
    """The module of each linear-attention layer that takes ``(hidden_states,
    cache, attention_mask)`` and keeps the layer's state: the deepest module
    carrying that ``layer_idx`` (the mixer, not the block around it)."""
    found: dict[int, tuple[int, Any]] = {}
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if idx not in layers:
            continue
        params = inspect.signature(module.forward).parameters
        if not {"hidden_states", "cache", "attention_mask"} <= set(params):
            continue
        depth = name.count(".")
        if idx not in found or depth > found[idx][0]:
            found[idx] = (depth, module)
    missing = sorted(layers - set(found))
    if missing:
        raise InvalidValueError(
            f"the model has no linear-attention mixer for layers {missing[:4]}: is it the "
            "model this pool was built for?"
        )
    return {i: m for i, (_, m) in found.items()}


class _Replay:
    """Rolls linear-attention states back by replaying accepted tokens.

    transformers' kernels hand the cache only a layer's final state, never
    one per token, so a crop cannot pick an earlier state out of a forward.
    Instead, while the cache records (assisted decoding), each mixer's input
    of the last forward is kept and its state from before that forward is
    copied into the request's rollback entry (one slot per request, kvarena's
    rollback copy). ``crop`` restores that entry and runs the mixer over the
    tokens that were accepted: the state the forward would have left had it
    stopped there. Hooks sit on the model's own mixers and are removed on
    release."""

    def __init__(self, cache: KvarenaCache, model: Any) -> None:
        self.cache = cache
        self.linear = {
            layer.layer_idx: layer for layer in cache.layers if isinstance(layer, LinearLayer)
        }
        self.mixers = linear_mixers(model, set(self.linear))
        self.inputs: dict[int, tuple[torch.Tensor, Any, bool]] = {}
        self.replaying = False
        self.handles = [
            m.register_forward_pre_hook(self._before, with_kwargs=True)
            for m in self.mixers.values()
        ]

    def _before(self, module: Any, args: tuple, kwargs: dict) -> None:
        names = ("hidden_states", "cache", "attention_mask")
        bound = dict(zip(names, args, strict=False)) | {k: kwargs[k] for k in names if k in kwargs}
        if bound.get("cache") is not self.cache or not self.cache.recording or self.replaying:
            return
        layer = self.linear[module.layer_idx]
        rows = self.cache.rows
        saved = rows.rollback_index
        assert saved is not None  # a replay is made only over rollback entries
        for name in layer.fields:
            live = rows.state(name)[layer.group]  # [B, ...]
            rows.cache.state_view(name)[layer.group].index_copy_(0, saved, live)
        hidden = bound["hidden_states"]
        self.inputs[module.layer_idx] = (
            hidden.detach().clone(),
            bound.get("attention_mask"),
            bool(layer.has_previous_state[0]),
        )

    def check(self, tokens_to_remove: int) -> None:
        """Refuse (nothing changed) a bad crop, or one longer than the last forward."""
        _cropped(1 << 62, tokens_to_remove)
        unrecorded = sorted(set(self.linear) - set(self.inputs))
        if tokens_to_remove and unrecorded:
            raise InvalidValueError(
                f"crop({tokens_to_remove}): layer {unrecorded[0]} kept no state from before its "
                "last forward (recording was off, or that forward was cropped already)"
            )
        for idx, (hidden, _, _) in self.inputs.items():
            if -tokens_to_remove > hidden.shape[1]:
                raise InvalidValueError(
                    f"crop({tokens_to_remove}): layer {idx} can roll back only the "
                    f"{hidden.shape[1]} tokens of its last forward"
                )

    def roll_back(self, remove: int) -> None:
        rows = self.cache.rows
        index = rows.rollback_index
        assert index is not None
        for idx, (hidden, mask, started) in self.inputs.items():
            if remove == 0:
                continue
            layer = self.linear[idx]
            for name in layer.fields:
                saved = rows.cache.state_view(name)[layer.group].index_select(0, index)
                rows.state(name)[layer.group].copy_(saved)
            layer.has_previous_state[0] = started
            keep = hidden.shape[1] - remove
            if keep:
                if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                    mask = mask[:, -hidden.shape[1] :][:, :keep]
                self.replaying = True
                try:
                    with torch.no_grad():
                        self.mixers[idx](
                            hidden_states=hidden[:, :keep], cache=self.cache, attention_mask=mask
                        )
                finally:
                    self.replaying = False
        self.inputs.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.inputs.clear()


class KvarenaCache(Cache):
    """A batch of requests in a :class:`KvarenaPool`, as transformers' ``Cache``.

    Made by ``pool.new_cache(batch_size)`` or ``pool.prefill(...)``; given back
    with ``pool.release(cache)`` (``generate`` never frees a cache passed in).
    """

    def __init__(
        self, pool: KvarenaPool, rows: _Rows, tokens: int, started: bool, model: Any = None
    ) -> None:
        self.pool = pool
        self.rows = rows
        self.recording = False
        layout: HfLayout = pool.layout
        layers: list[Any] = []
        for i, (kind, g) in enumerate(zip(layout.kinds, layout.group, strict=True)):
            if kind == PAGED:
                layers.append(PagedLayer(rows, i, g, tokens))
            elif kind == RING:
                layers.append(RingLayer(rows, i, g, tokens, layout.window))
            elif kind == LINEAR:
                layers.append(LinearLayer(rows, i, g, started))
            else:
                assert kind == NONE
                layers.append(NoneLayer())
        super().__init__(layers=layers)
        rows.paged_layers = sum(1 for x in layers if isinstance(x, PagedLayer))
        self._replay: _Replay | None = None
        if model is not None and any(isinstance(x, LinearLayer) for x in layers):
            if rows.rollback_index is None:
                raise InvalidValueError(
                    "this pool keeps no rollback entry: build it with rollback_tokens > 0 "
                    "for crop (assisted decoding) on linear-attention layers"
                )
            self._replay = _Replay(self, model)

    def activate_past_recording(self) -> None:
        """transformers asks before a draft is verified: from now on the cache keeps
        what ``crop`` needs (the linear layers' inputs and earlier states)."""
        self.recording = True
        super().activate_past_recording()

    def close(self) -> None:
        """Remove the hooks this cache placed on the model, and refuse every later
        use (the pool calls it on release, before it gives the blocks and slots back)."""
        if self._replay is not None:
            self._replay.close()
            self._replay = None
        self.rows.released = True

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
        self._check_live()
        if any(isinstance(layer, (PagedLayer, RingLayer)) for layer in self.layers):
            return super().get_seq_length(layer_idx)
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
        linear = [layer.layer_idx for layer in self.layers if isinstance(layer, LinearLayer)]
        if linear and self._replay is None:
            raise InvalidValueError(
                f"crop: layers {linear[:4]} are linear attention, whose state cannot roll back "
                "without a rollback entry (KvarenaPool(..., rollback_tokens=N) and "
                "new_cache(..., model=model))"
            )
        if self._replay is not None:
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
        if self._replay is not None:
            self._replay.roll_back(-tokens_to_remove)

    @property
    def is_croppable(self) -> bool:
        return all(
            (self._replay is not None)
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
