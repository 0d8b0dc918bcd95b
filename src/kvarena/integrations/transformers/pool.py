"""``KvarenaPool``: one kvarena allocation serving a transformers model.

The pool walks the one road — :func:`hf_layout` declares the model's cache,
:func:`kvarena.plan_cache` sizes it in a budget, and a
:class:`~kvarena.PrefixCache` builds the :class:`~kvarena.UnifiedCache` from
that plan — and hands out :class:`KvarenaCache` objects, one request per row.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Hashable
from typing import Any

import torch

from ...checks import check_count, check_device
from ...errors import InvalidValueError
from ...pools import BlockTable, CachePlan, plan_cache
from ...prefix import CheckpointPolicy, PrefixCache
from .cache import KvarenaCache
from .layout import HfLayout, hf_layout
from .rows import Rows


def forward_with(model: Any, input_ids: torch.Tensor, cache: Any) -> Any:
    """``model``'s forward over ``input_ids`` with ``cache`` (transformers 5.x
    renamed ``past_key_values`` to ``cache``; the older name is used where a
    model still takes only it)."""
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"
    return model(input_ids=input_ids, use_cache=True, **{name: cache})


def _check_vocabulary(model: Any, input_ids: torch.Tensor, what: str) -> None:
    """Token ids the model's embedding holds (torch's own IndexError from inside the
    forward would leave a half-computed cache behind)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embed, "num_embeddings", None) or getattr(
        getattr(model, "config", None), "vocab_size", None
    )
    if not isinstance(vocab, int) or input_ids.device.type == "meta":
        if input_ids.device.type == "meta":
            raise InvalidValueError(f"{what}: input_ids on the meta device hold no token ids")
        return
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise InvalidValueError(
            f"{what}: token id {bad} is outside the model's vocabulary 0..{vocab - 1}"
        )


def _check_prompt(input_ids: Any, what: str) -> None:
    """One prompt: token ids of shape ``[1, tokens]``, at least one token."""
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.shape[0] != 1
        or input_ids.shape[1] < 1
        or input_ids.dtype not in (torch.int64, torch.int32)
    ):
        got = (
            f"{tuple(input_ids.shape)} {input_ids.dtype}"
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise InvalidValueError(
            f"{what} takes one prompt: integer input_ids of shape [1, tokens]; got {got}"
        )


class KvarenaPool:
    """Blocks and slots for a model's requests, with a prefix cache over them."""

    def __init__(self, layout: HfLayout, plan: CachePlan, prefix: PrefixCache) -> None:
        self.layout = layout
        self.plan = plan
        self.prefix = prefix
        self.cache = prefix.cache
        self._ids = itertools.count()
        self._prompts: dict[Hashable, int] = {}  # admitted request -> prompt tokens
        self._live: set[int] = set()  # ids of caches not yet released

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        budget_bytes: int,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        max_seqs: int = 8,
        dtype: torch.dtype | str | None = None,
        policy: CheckpointPolicy | None = None,
        rollback_tokens: int = 0,
    ) -> KvarenaPool:
        """A pool for the model ``config`` describes, in ``budget_bytes`` on
        ``device``, for up to ``max_seqs`` concurrent requests.

        ``dtype`` is the dtype the model computes in (default: the config's,
        else torch's default — what ``from_config`` builds a model in).
        ``rollback_tokens`` lets ``crop`` roll sliding-window layers back that
        far (assisted decoding drafts at most that many tokens minus one)."""
        dev = check_device(device)
        check_count(block_size, "block_size", lo=1, hi=1 << 20)
        layout = hf_layout(
            config, dtype=dtype, block_size=block_size, rollback_tokens=rollback_tokens
        )
        plan = plan_cache(layout.model, budget_bytes=budget_bytes, max_seqs=max_seqs)
        return cls(layout, plan, PrefixCache(plan, dev, policy=policy))

    @property
    def device(self) -> torch.device:
        return self.cache.device

    # -- caches ----------------------------------------------------------------------
    def _rows(
        self, requests: list[Hashable], tables: list[BlockTable], slots: list[tuple[int, ...]]
    ) -> Rows:
        return Rows(self.cache, requests, tables, slots)

    def new_cache(self, batch_size: int, *, model: Any = None) -> KvarenaCache:
        """An empty cache for ``batch_size`` new requests: each row gets a block
        table and a state slot (the batch's slots consecutive where they can be).

        ``model`` (with a pool built with ``rollback_tokens``) lets ``crop``
        roll linear-attention states back — what assisted decoding needs: the
        cache then watches the model's linear-attention mixers (hooks removed
        on release)."""
        n = check_count(batch_size, "batch_size", lo=1, hi=self.plan.max_seqs)
        requests: list[Hashable] = [("hf", next(self._ids)) for _ in range(n)]
        slots = self.cache.allocate_states(requests) if self.cache.state_fields else []
        tables = [BlockTable(self.cache) for _ in requests] if self.cache.page_fields else []
        rows = self._rows(requests, tables, slots)
        try:
            cache = KvarenaCache(self, rows, 0, False, model=model)
        except BaseException:
            for r in requests:
                if slots:
                    self.cache.free_state(r)
            raise
        return self._track(cache)

    def prefill(self, model: Any, input_ids: torch.Tensor) -> KvarenaCache:
        """A cache for one prompt that reuses what the prefix cache holds of it.

        The prompt's longest cached prefix (whole blocks, at most ``len - 1``
        tokens, so ``generate`` still has a token to feed) comes back as shared
        blocks and a restored state; the prompt is then computed up to each
        checkpoint boundary the policy asks for, where an image of the state
        is kept for later prompts. ``generate(input_ids, cache=cache)``
        computes the rest."""
        _check_prompt(input_ids, "prefill")
        _check_vocabulary(model, input_ids, "prefill")
        tokens = input_ids[0].tolist()
        request: Hashable = ("hf", next(self._ids))
        adm = self.prefix.admit(request, tokens)
        hit = adm.hit.tokens
        tables = [BlockTable(self.cache, adm.blocks, tokens=hit)] if self.cache.page_fields else []
        rows = self._rows([request], tables, [adm.slots] if adm.slots else [])
        cache = self._track(KvarenaCache(self, rows, hit, hit > 0))
        self._prompts[request] = len(tokens)
        bs, done = self.cache.block_size, hit
        try:
            with torch.no_grad():
                for b in adm.checkpoints:
                    end = b * bs
                    if end > len(tokens) - 1:
                        break
                    forward_with(model, input_ids[:, done:end], cache)
                    cache.sync()
                    self.prefix.checkpoint(request, b)
                    self.prefix.commit(request, end)
                    done = end
        except BaseException:
            self.release(cache)
            raise
        return cache

    def prefill_remote(self, model: Any, input_ids: torch.Tensor) -> tuple[KvarenaCache, int]:
        """The prefill half of a disaggregated request: compute the whole prompt
        (one row) into a new cache and return it with the first token (greedy).
        Ship ``cache.block_tables[0].blocks`` and ``cache.slots[0][:1]`` to the
        decode side, which continues with :meth:`adopt`."""
        _check_prompt(input_ids, "prefill_remote")
        _check_vocabulary(model, input_ids, "prefill_remote")
        cache = self.new_cache(1)
        try:
            with torch.no_grad():
                logits = forward_with(model, input_ids, cache).logits
        except BaseException:
            self.release(cache)
            raise
        cache.sync()
        return cache, int(logits[0, -1].argmax())

    def adopt(
        self, blocks: list[int], slots: tuple[int, ...], owner: Hashable, tokens: int
    ) -> KvarenaCache:
        """A one-row cache over blocks and slots that arrived from another process
        (:meth:`kvarena.DecodeReceiver.take`), holding ``tokens`` computed tokens.
        The pool frees them on release."""
        n = check_count(tokens, "adopt: tokens", lo=1)
        tables = [BlockTable(self.cache, list(blocks), tokens=n)] if self.cache.page_fields else []
        if self.cache.state_fields:
            if tuple(self.cache.slots.slots_of(owner)) != tuple(slots):
                raise InvalidValueError(f"adopt: {owner!r} does not hold slots {tuple(slots)}")
        rows = self._rows([owner], tables, [tuple(slots)] if slots else [])
        return self._track(KvarenaCache(self, rows, n, True))

    def _track(self, cache: KvarenaCache) -> KvarenaCache:
        self._live.add(id(cache))
        return cache

    def release(self, cache: KvarenaCache) -> None:
        """Give back every block and slot of ``cache``; the computed blocks of an
        admitted prompt stay in the prefix cache for later prompts."""
        if not isinstance(cache, KvarenaCache) or cache.pool is not self:
            raise InvalidValueError("release: not a KvarenaCache of this pool")
        if cache.released:
            raise InvalidValueError("release: this cache was released already")
        cache.sync()
        cache.close()  # every later use of it refuses; then its blocks and slots go back
        rows = cache.rows
        for r, request in enumerate(rows.requests):
            prompt = self._prompts.pop(request, None)
            if prompt is not None:
                written = rows.tables[r].tokens if rows.tables else prompt
                self.prefix.commit(request, min(prompt, written))
                self.prefix.finish(request)
                continue
            if rows.tables:
                rows.tables[r].release()
            if rows.slots:
                self.cache.free_state(request)
        self._live.discard(id(cache))

    @property
    def live_caches(self) -> int:
        """Caches handed out and not released."""
        return len(self._live)
