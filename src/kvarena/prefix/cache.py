"""A prefix cache that reuses both the KV blocks and the recurrent state of a prefix.

KV blocks are shared by reference count; a state is never shared in place: a
checkpoint image (its checkpoint ranges stored into PAGE blocks of the same
pool) is copied into the new request's own slot. A lookup answers with the
contract of :mod:`kvarena.prefix.lookup` over the device and the tiers below
it; a tier object is checked in full before a byte of it is copied, and one
that fails is deleted, counted, and the answer recomputed without it. A hit
is at most ``len(tokens) - 1`` tokens. KV matched past the answer is lost,
and (branch policy) marks where the next request computing through it keeps
an image.

The block pool owns which block holds which key (a KV block its chained key,
an image's units :func:`~kvarena.prefix.records.image_key`, worthless without
the KV block ending at its boundary); its one LRU ages both, its write-down
sink (:class:`~.tiering.WriteDown`) writes each victim to the tiers while its
bytes are intact; a boundary move relocates keys and remaps holdings in place.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from ..checks import check_count, check_device, check_request_id
from ..errors import InvalidValueError
from ..locking import synchronized
from ..pools import BlockAllocationError, BoundaryMove, CachePlan, StateAllocationError
from ..pools.unified import UnifiedCache
from ..tiers import Tier, TierStack
from ..tiers.names import ImageKind, object_name
from . import records
from .answer import DeviceHeld, answer
from .keys import as_tokens, block_keys
from .placement import Placement
from .policy import CheckpointPolicy
from .records import Admission, Image, ImageState, PrefixHit, PrefixMetrics, image_key
from .tier_side import TierLoads


class PrefixCache:
    """A prefix cache over one :class:`UnifiedCache`, built from a plan (the one road)."""

    def __init__(
        self,
        plan: CachePlan,
        device: torch.device | str,
        *,
        policy: CheckpointPolicy | None = None,
        tp_rank: int = 0,
        unit_bytes: int | None = None,
        reuse: bool = True,
        tiers: TierStack | Sequence[Tier] | None = None,
    ) -> None:
        if not isinstance(plan, CachePlan):
            raise InvalidValueError(
                f"PrefixCache: plan must be a CachePlan, got {type(plan).__name__}"
            )
        self.policy = CheckpointPolicy() if policy is None else policy
        if not isinstance(self.policy, CheckpointPolicy):
            raise InvalidValueError(f"policy must be a CheckpointPolicy, got {policy!r}")
        self.policy.check_block_size(plan.block_size)
        self.namespace = records.plan_namespace(plan, tp_rank=tp_rank)
        self.root = self.namespace.digest
        check_device(device)
        if not isinstance(reuse, bool):
            raise InvalidValueError(f"reuse must be a bool, got {reuse!r}")
        self.tiers = tiers if isinstance(tiers, TierStack) else TierStack(tiers or ())
        self.cache = UnifiedCache.from_plan(plan, device)
        self.pool = self.cache.blocks  # the one book of cached blocks
        self.block_size = plan.block_size
        self.has_kv = bool(plan.page_fields)
        self.has_state = bool(plan.state_fields)
        self.spec = (
            self.cache.checkpoint_spec(unit_bytes) if self.has_kv and self.has_state else None
        )
        self.metrics = PrefixMetrics()
        self.enabled = reuse  # False: every lookup misses (prefix caching off, for comparisons)
        self._loads = TierLoads.build(
            cache=self.cache,
            tiers=self.tiers,
            spec=self.spec,
            metrics=self.metrics,
            namespace=self.namespace.to_json(),
        )
        self._write_down = self._loads.write_down
        self.pool.set_write_down(self._write_down)
        units = self.spec.units_per_image if self.spec is not None else 1
        self.placement = Placement(self.policy, plan.block_size, self.pool.capacity, units)
        self._copying: dict[bytes, Image] = {}  # images whose bytes are still being written
        self._device = DeviceHeld(pool=self.pool, copying=self._copying)
        self._running: dict[Hashable, Admission] = {}
        self._lock = threading.RLock()  # every public call holds it: see kvarena.locking

    # -- queries ---------------------------------------------------------------------
    def keys(self, tokens: object, extra: Sequence[object] = ()) -> list[bytes]:
        return block_keys(self.root, tokens, self.block_size, extra)  # chained; checks the ids

    @property
    @synchronized
    def cached_blocks(self) -> int:
        """KV blocks held under a key (live or aging), asked of the pool."""
        return sum(1 for k in self.pool.keys() if isinstance(k, bytes))

    @property
    @synchronized
    def images(self) -> int:
        """READY images the pool holds."""
        return sum(isinstance(k, tuple) and k[1] not in self._copying for k in self.pool.keys())

    @synchronized
    def held(self, keys: Sequence[bytes]) -> int:
        """Blocks of a prompt (its ``keys``) this device could resume after now, as a
        router reading its KV events knows: no tier asked, nothing taken or counted."""
        if not self.has_kv:  # a state-only model resumes at its furthest image
            return next((b for b in range(len(keys), 0, -1) if self._device.has_image(keys, b)), 0)
        return next((i for i, k in enumerate(keys) if not self._device.kv(k)), len(keys))

    @synchronized
    def running(self, request: Hashable) -> Admission:
        try:
            return self._running[request]
        except (KeyError, TypeError):
            raise InvalidValueError(f"request {request!r} is not running") from None

    # -- the lookup contract -----------------------------------------------------------
    @synchronized
    def poll(self) -> None:
        """Promote images whose copy has completed (COPYING -> READY)."""
        for key, img in list(self._copying.items()):
            if img.event is None or img.event.query():
                img.state = ImageState.READY
                img.event = None
                del self._copying[key]
                if img.writer_done:
                    self._release_image(img)

    def _settle(self) -> None:
        """Tell the placement which KV blocks the pool evicted since the last call."""
        self.placement.forgotten(self._write_down.take_gone())

    def _release_image(self, img: Image) -> None:
        """The writer's references go: the image ages in the LRU beside its KV."""
        for u in img.units:
            self.pool.release(u)

    def _answer(
        self, tokens: np.ndarray, keys: list[bytes], skip: frozenset[str] = frozenset()
    ) -> PrefixHit:
        return answer(
            self._device,
            self.tiers,
            keys,
            tokens.size if self.enabled else 0,
            block_size=self.block_size,
            has_kv=self.has_kv,
            has_state=self.has_state,
            images=self.spec is not None,
            skip=skip,
        )

    @synchronized
    def lookup(self, tokens: object, extra: Sequence[object] = ()) -> PrefixHit:
        """The longest prefix of ``tokens`` every group can resume from (takes nothing)."""
        self.poll()
        tok = as_tokens(tokens)
        keys = block_keys(self.root, tok, self.block_size, extra)
        self.metrics.lookups += 1  # counted once the call is known to be good
        return self._answer(tok, keys)

    # -- requests ----------------------------------------------------------------------
    @synchronized
    def admit(
        self,
        request: Hashable,
        tokens: object,
        *,
        reserve_tokens: int = 0,
        extra: Sequence[object] = (),
    ) -> Admission:
        """Look up, then take the hit: shared blocks (references), a new slot restored
        from the image, and new blocks for the rest of the prompt plus
        ``reserve_tokens``. All or nothing: refused (nothing taken) when the pools
        cannot hold it."""
        self.poll()
        tok = as_tokens(tokens)
        if tok.size == 0:
            raise InvalidValueError("admit: a request needs at least one token")
        reserve = check_count(reserve_tokens, "reserve_tokens")
        request = check_request_id(request)
        if request in self._running:
            raise InvalidValueError(f"request {request!r} is already running")
        keys = block_keys(self.root, tok, self.block_size, extra)
        hit = self._answer(tok, keys)
        total = self.cache.plan.blocks_for(tok.size + reserve) if self.has_kv else 0
        self._check_room(hit, total)
        payloads: dict[str, memoryview] = {}
        if any(s != "device" for s in hit.sources) or hit.image_source not in (None, "device"):
            skip: set[str] = set()
            while failed := self._loads.fetch(keys, hit, payloads):
                skip |= failed  # answered again without what no tier served
                hit = self._answer(tok, keys, frozenset(skip))
            self._check_room(hit, total)
        self.metrics.lookups += 1  # a refused admission leaves every book, counts included
        h = hit.tokens // self.block_size
        pool = self.pool
        device_blocks = [b for b in hit.blocks if b >= 0]
        units = hit.image.units if hit.image else []
        for b in [*device_blocks, *units]:
            pool.retain(b)
        new = pool.allocate(total - len(device_blocks))
        slots = self.cache.allocate_slots(request) if self.has_state else ()
        holding = self.cache.hold(request, self._loads.take_hit_blocks(keys, hit, new, payloads))
        if hit.image is not None and self.spec is not None:
            self.cache.restore(self.spec, [slots[0]], [units])
            for u in units:
                pool.release(u)  # restored: the image ages in the LRU again
        elif hit.image_source is not None and self.spec is not None:  # from a tier
            self._loads.restore_payload(
                payloads[object_name(ImageKind.STATE, keys[h - 1])], slots[0]
            )
        self.metrics.admitted(hit, tok.size, self.spec.image_bytes if self.spec else None)
        adm = Admission(
            request=request,
            tokens=tok,
            keys=keys,
            hit=hit,
            holding=holding,
            checkpoints=self._checkpoints(tok, keys, hit),
            committed=h,
            extra=tuple(extra),
        )
        self._running[request] = adm
        self._settle()
        return adm

    def _checkpoints(self, tok: np.ndarray, keys: list[bytes], hit: PrefixHit) -> list[int]:
        """The boundaries at which the policy keeps an image while this prompt computes."""
        if not (self.has_state and self.spec is not None and self.enabled):
            return []
        return self.placement.boundaries(
            tok.size,
            keys,
            hit=hit.tokens // self.block_size,
            matched=hit.matched_kv_tokens // self.block_size,
            limit=min(len(keys), max(0, (tok.size - 1) // self.block_size)),
        )

    def _check_room(self, hit: PrefixHit, total: int) -> None:
        """Refuse (nothing taken) unless the blocks and a slot for this hit fit."""
        pool = self.pool
        need = total - sum(1 for b in hit.blocks if b >= 0)
        held = [b for b in hit.blocks if b >= 0] + (hit.image.units if hit.image else [])
        evictable_held = sum(1 for b in held if pool.is_evictable(b))
        if need > pool.num_free + pool.num_evictable - evictable_held:
            raise BlockAllocationError(need, pool.num_free, pool.num_evictable - evictable_held)
        if self.has_state and self.cache.slots.num_free < self.cache.slots.entries_per_req:
            raise StateAllocationError(self.cache.slots.entries_per_req, self.cache.slots.num_free)

    # -- a request computes, then finishes ----------------------------------------------
    @synchronized
    def commit(self, request: Hashable, tokens: int) -> None:
        """The request has computed its first ``tokens`` prompt tokens: register the
        keys of the full blocks among them (a block another request already cached
        under the same key stays uncached and is freed when this one finishes)."""
        adm = self.running(request)
        n = min(check_count(tokens, "commit: tokens") // self.block_size, len(adm.keys))
        if self.has_kv:
            blocks = adm.blocks
            for i in range(adm.committed, n):
                key, block = adm.keys[i], blocks[i]
                if self.pool.blocks_of(key) is None and self.pool.key_of(block) is None:
                    self.pool.cache(key, [block], tag=i)
        adm.committed = max(adm.committed, n)

    @synchronized
    def checkpoint(
        self, request: Hashable, resume_point: int, *, event: object = None
    ) -> Image | None:
        """Keep an image of the request's state, which holds the state after
        ``resume_point`` blocks, keyed by that prefix. None when one exists already or no units fit.

        The image is visible to lookups once its bytes are written: at once on the
        CPU; on CUDA when ``event`` (by default one recorded right after the copy)
        has completed. A caller copying on its own stream passes its own event."""
        adm = self.running(request)
        if self.spec is None:
            raise InvalidValueError("this cache keeps no images (it needs PAGE and STATE fields)")
        b = check_count(resume_point, "checkpoint: resume_point", lo=1, hi=len(adm.keys))
        key = adm.keys[b - 1]
        self.placement.kept(key)
        if self.pool.blocks_of(image_key(key)) is not None:
            return None
        pool = self.pool
        if self.spec.units_per_image > pool.num_free + pool.num_evictable:
            self.metrics.images_skipped += 1
            return None
        units = pool.allocate(self.spec.units_per_image)
        self.cache.store(self.spec, [adm.slots[0]], [units])
        if event is None and self.cache.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        pool.cache(image_key(key), units, tag=b, after=key)
        self._settle()
        img = Image(key=key, resume_point=b, state=ImageState.COPYING, pool=pool, event=event)
        self._copying[key] = img
        adm.images.append(img)  # held while the request runs, like its blocks
        self.poll()
        self.metrics.images_written += 1
        self.metrics.image_bytes_written += self.spec.image_bytes
        return img

    @synchronized
    def finish(self, request: Hashable) -> None:
        """Return the request's references: cached blocks age in the LRU, the rest
        are free; its slots are free."""
        adm = self._running.pop(self.running(request).request)
        # Tail first: the LRU then evicts a prompt's last blocks before its first
        # ones, which other prompts are likelier to share (a system prompt).
        for b in reversed(adm.blocks):
            self.pool.release(b)
        for img in adm.images:
            img.writer_done = True
            if img.state is ImageState.READY:
                self._release_image(img)  # (a COPYING one is released when it is READY)
        if adm.slots:
            self.cache.release_slots(request)
        self.cache.let_go(adm.holding)

    @synchronized
    def rebalance(self, *, waiting_requests: int, blocks_needed: int) -> BoundaryMove | None:
        """Move the cache's boundary toward demand (keys and holdings follow inside it)."""
        move = self.cache.rebalance(waiting_requests=waiting_requests, blocks_needed=blocks_needed)
        self._settle()
        return move

    @synchronized
    def drain(self, batch: int = 256) -> int:
        """Write every cached block and READY image back to the tiers without
        evicting anything (a server shutting down, so the next one starts warm);
        the number of objects written."""
        self.poll()
        return self._loads.drain(set(self._copying), batch)

    @synchronized
    def publish(self, request: Hashable, store: TierStack, boundaries: Sequence[int] = ()) -> int:
        """Write what a running request computed through ``store`` (a shared store:
        others find it before this cache evicts it); the objects written."""
        adm = self.running(request)
        self.poll()
        return self._loads.publish(adm, store, boundaries, set(self._copying), kv=self.has_kv)

    @synchronized
    def check_books(self) -> None:
        """The pool's book agrees with itself, every image's units are cached under its
        key, and every running request's blocks are held (for tests)."""
        self.pool.check_books()
        units = self.spec.units_per_image if self.spec is not None else None
        for key in self.pool.keys():  # a KV block is one block, an image its units
            assert len(self.pool.blocks_of(key) or ()) == (units if isinstance(key, tuple) else 1)
        for adm in self._running.values():
            assert all(not self.pool.is_free(b) for b in adm.blocks)
