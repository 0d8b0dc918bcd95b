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

from ...checks import check_count, check_device, check_int
from ...errors import InvalidValueError
from ...pools import BlockTable, BoundaryMove, CachePlan, Holding, plan_cache
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
        self._live: dict[int, KvarenaCache] = {}  # caches handed out, not yet released

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
    def _rows(self, holdings: list[Holding], tokens: int = 0) -> Rows:
        """Rows over the requests' holdings, with PAGE fields a block table over each
        holding ``tokens`` computed tokens."""
        tables = (
            [BlockTable(self.cache, h, tokens=tokens) for h in holdings]
            if self.cache.page_fields
            else []
        )
        return Rows(self.cache, holdings, tables)

    def new_cache(self, batch_size: int, *, model: Any = None) -> KvarenaCache:
        """An empty cache for ``batch_size`` new requests: each row gets a block
        table and a state slot (the batch's slots consecutive where they can be).

        ``model`` (with a pool built with ``rollback_tokens``) lets ``crop``
        roll linear-attention states back — what assisted decoding needs: the
        cache then watches the model's linear-attention mixers (hooks removed
        on release)."""
        n = check_count(batch_size, "batch_size", lo=1, hi=self.plan.max_seqs)
        requests: list[Hashable] = [("hf", next(self._ids)) for _ in range(n)]
        if self.cache.state_fields:
            self.cache.allocate_slots_batch(requests)
        holdings = [self.cache.hold(r) for r in requests]
        try:
            cache = KvarenaCache(self.layout, self._rows(holdings), 0, False, model=model)
        except BaseException:
            for h in holdings:
                if self.cache.state_fields:
                    self.cache.release_slots(h.request)
                self.cache.let_go(h)
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
        rows = self._rows([adm.holding], hit)
        cache = self._track(KvarenaCache(self.layout, rows, hit, hit > 0))
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
        if self.cache.page_fields:
            self.cache.blocks.check_held(blocks, "adopt: blocks", writing=True)
            check_count(n, "adopt: tokens", lo=1, hi=len(blocks) * self.cache.block_size)
        if self.cache.state_fields:
            if tuple(self.cache.slots.held_by(owner)) != tuple(slots):
                raise InvalidValueError(f"adopt: {owner!r} does not hold slots {tuple(slots)}")
        rows = self._rows([self.cache.hold(owner, list(blocks))], n)
        return self._track(KvarenaCache(self.layout, rows, n, True))

    def _track(self, cache: KvarenaCache) -> KvarenaCache:
        self._live[id(cache)] = cache
        return cache

    # -- the boundary, moved under live caches ----------------------------------------
    def _moving(self) -> None:
        """Before a move: every live cache's working copies go into their slots."""
        for cache in self._live.values():
            cache.sync()

    def _moved(self, move: BoundaryMove | None) -> BoundaryMove | None:
        """After a move: every live cache remakes its views from the remapped ids."""
        if move is not None:
            for cache in self._live.values():
                cache.follow()
        return move

    def move_boundary(self, slots: int) -> BoundaryMove:
        """Give ``slots`` more slots to STATE (``slots > 0``, relocating live blocks)
        or back to PAGE (``slots < 0``, relocating live states), under the caches
        in use: their blocks and slots move as whole entries and every cache
        goes on where it was (tokens identical to a cache that never moved)."""
        n = check_int(slots, "move_boundary: slots")
        self._moving()
        move = self.cache.grow_state(n) if n >= 0 else self.cache.shrink_state(-n)
        self._moved(move)
        return move

    def rebalance(self, *, waiting_requests: int, blocks_needed: int) -> BoundaryMove | None:
        """The cache's rebalance policy (:meth:`UnifiedCache.rebalance`), under the
        caches in use as :meth:`move_boundary`."""
        self._moving()
        return self._moved(
            self.prefix.rebalance(waiting_requests=waiting_requests, blocks_needed=blocks_needed)
        )

    def release(self, cache: KvarenaCache) -> None:
        """Give back every block and slot of ``cache``; the computed blocks of an
        admitted prompt stay in the prefix cache for later prompts."""
        if isinstance(cache, KvarenaCache) and cache.released:
            raise InvalidValueError("release: this cache was released already")
        if not isinstance(cache, KvarenaCache) or self._live.get(id(cache)) is not cache:
            raise InvalidValueError("release: not a KvarenaCache of this pool")
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
            if rows.has_slots:
                self.cache.release_slots(request)
            self.cache.let_go(rows.holdings[r])
        self._live.pop(id(cache), None)

    @property
    def live_caches(self) -> int:
        """Caches handed out and not released."""
        return len(self._live)
