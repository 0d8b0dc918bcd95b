"""A prefix cache that reuses both the KV blocks and the recurrent state of a prefix.

KV blocks are shared by reference count; a state is never shared in place: a
checkpoint image (the state's checkpoint ranges, stored into PAGE blocks of
the same pool by :meth:`UnifiedCache.store`) is copied into the new request's
own slot. The lookup returns the longest prefix that EVERY layer group can
resume from:

- a full-attention group (every paged layer: one kvarena block holds all of
  them) needs every block up to the boundary;
- a state group needs a READY image taken exactly at that boundary. Sliding
  windows are such state here: kvarena keeps a window as a per-request ring
  (Gemma-3's local layers, DeepSeek-V4's SWA), so "the blocks of the last
  window" are the ring's bytes in the image.

With tiers below the device (:mod:`kvarena.tiers`), a block or an image the
device lacks may come from the first tier holding it: the same contract, the
same groups, over the union of the levels. A tier object is checked in full
(checksum, namespace, key, span, length) before a byte of it is copied; one
that fails is deleted, counted, and the answer is recomputed without it.
Evictions write back: the allocator's ``before_evict`` hands each batch of
victims — KV blocks and image units, while their bytes are intact — to the
top tier, whose own evictions flow down.

The groups' answers are combined by repeating until none shrinks; no boundary
that satisfies every group means 0, never a partial restore; a hit is at most
``len(tokens) - 1`` tokens (something must be computed to produce logits).
KV matched past the answer is reported as lost, and (branch policy) marks the
boundary where the next request to compute through it keeps an image.

Unreferenced cached blocks and unreferenced images share the block
allocator's one LRU (an image holds its units); evicting a unit drops its
image; evicting a block drops its key, which makes every descendant
unreachable (they age out of the LRU in time). Boundary moves evict through
the same path, and relocations are followed through the cache's move
listener, so no caller keeps books for the prefix cache.
"""

from __future__ import annotations

import enum
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ..checks import check_count, check_device, check_request_id
from ..errors import InvalidValueError
from ..locking import synchronized
from ..pools import BlockAllocationError, BoundaryMove, CachePlan, StateAllocationError
from ..pools.unified import UnifiedCache
from ..tiers import Tier, TierStack
from ..tiers.image import (
    Expected,
    ImageKind,
    ImageMismatch,
    TierObject,
    decode,
    encode,
    object_name,
)
from .keys import Namespace, as_tokens, block_keys
from .policy import CheckpointPolicy


def _host_view(t: torch.Tensor) -> memoryview:
    """A uint8 tensor's bytes as a host memoryview (a device tensor is copied once)."""
    return memoryview(t.detach().cpu().contiguous().numpy())  # type: ignore[arg-type]


def _host_bytes(data: memoryview) -> torch.Tensor:
    """A read-only host buffer as a uint8 tensor to copy FROM (never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns on read-only buffers
        return torch.frombuffer(data, dtype=torch.uint8)


class ImageState(enum.Enum):
    COPYING = "copying"  # bytes still being written: invisible to lookups
    READY = "ready"


@dataclass(eq=False, kw_only=True)
class Image:
    """A checkpoint image of a state at a block boundary, held in PAGE units."""

    key: bytes
    boundary: int  # in blocks
    units: list[int]
    state: ImageState
    event: Any = None  # a CUDA event while COPYING on a device; None on CPU
    writer_done: bool = False  # the request that wrote it finished: its references go
    tiered: bool = False  # written back to the tiers already


@dataclass(frozen=True, kw_only=True)
class PrefixHit:
    tokens: int  # hit tokens: blocks x block_size, at most len(tokens) - 1
    blocks: tuple[int, ...]  # the hit's device KV blocks, in order; -1 where a tier serves it
    image: Image | None  # the device image restored into the new slot
    matched_kv_tokens: int  # tokens of KV matched by the full-attention group
    lost_tokens: int  # matched KV given up for want of a checkpoint
    sources: tuple[str, ...] = ()  # per hit block: "device" or the tier that serves it
    image_source: str | None = None  # "device", a tier's name, or None (no state restored)


@dataclass(kw_only=True)
class PrefixMetrics:
    requests: int = 0
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    lost_tokens: int = 0
    images_written: int = 0
    image_bytes_written: int = 0
    images_read: int = 0
    image_bytes_read: int = 0
    images_skipped: int = 0  # wanted but no room for the units
    evicted_blocks: int = 0
    evicted_images: int = 0
    tier_blocks_written: int = 0  # KV blocks written back to the tiers
    tier_images_written: int = 0
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)  # hit tokens by tier
    tier_images_read: dict[str, int] = field(default_factory=dict)
    tier_rejected: dict[str, int] = field(default_factory=dict)  # bad objects by reason

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class Admission:
    """A running request: what it hit, what it holds, where it keeps images."""

    request: Hashable
    tokens: np.ndarray
    keys: list[bytes]
    hit: PrefixHit
    blocks: list[int]
    slots: tuple[int, ...]
    checkpoints: list[int]  # block counts at which to keep an image while computing
    committed: int = 0  # leading blocks whose keys are registered
    extra: tuple[object, ...] = field(default=())
    images: list[Image] = field(default_factory=list)  # written by this request, held by it


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """``method``, called through a weak reference to its object.

    The prefix cache owns its :class:`UnifiedCache`; a callback holding the
    prefix cache strongly would close a cycle (prefix cache -> cache ->
    allocator -> callback -> prefix cache) that only Python's cyclic collector
    frees, and the cache's buffer with it: three replays of a 2 GiB budget in
    a row held 6 GiB until a collection ran. Once the prefix cache is gone,
    nothing is left to tell."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


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
        self.namespace = Namespace.of(plan, tp_rank=tp_rank)
        self.root = self.namespace.digest
        check_device(device)
        self.tiers = tiers if isinstance(tiers, TierStack) else TierStack(tiers or ())
        self.cache = UnifiedCache.from_plan(
            plan,
            device,
            on_evict=_weakly(self._evicted),
            before_evict=_weakly(self._evicting) if self.tiers else None,
        )
        self.cache.add_move_listener(_weakly(self._moved))
        self.block_size = plan.block_size
        self.has_kv = bool(plan.page_fields)
        self.has_state = bool(plan.state_fields)
        self.spec = (
            self.cache.checkpoint_spec(unit_bytes) if self.has_kv and self.has_state else None
        )
        self.metrics = PrefixMetrics()
        if not isinstance(reuse, bool):
            raise InvalidValueError(f"reuse must be a bool, got {reuse!r}")
        self.enabled = reuse  # False: every lookup misses (prefix caching off, for comparisons)
        self._ns = self.namespace.to_json()
        self._elided = self.cache.device.type == "meta"  # no bytes: tier images are headers
        self._block_of: dict[bytes, int] = {}  # key -> cached block
        self._depth: dict[bytes, int] = {}  # key -> its block's index in the prompt
        self._key_of: dict[int, bytes] = {}  # cached block -> key
        self._images: dict[bytes, Image] = {}  # boundary key -> image
        self._image_of_unit: dict[int, Image] = {}
        self._copying: list[Image] = []
        self._wanted: set[bytes] = set()  # branch points
        self._running: dict[Hashable, Admission] = {}
        self._lock = threading.RLock()  # every public call holds it: see kvarena.locking

    # -- queries ---------------------------------------------------------------------
    def keys(self, tokens: object, extra: Sequence[object] = ()) -> list[bytes]:
        return block_keys(self.root, as_tokens(tokens), self.block_size, extra)

    @property
    @synchronized
    def cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    @synchronized
    def images(self) -> int:
        return sum(1 for i in self._images.values() if i.state is ImageState.READY)

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
        still = []
        for img in self._copying:
            if img.event is None or img.event.query():
                img.state = ImageState.READY
                img.event = None
                if img.writer_done:
                    self._release_image(img)
            else:
                still.append(img)
        self._copying = still

    def _release_image(self, img: Image) -> None:
        """The writer's references go: the image ages in the LRU beside its KV."""
        for u in img.units:
            self.cache.blocks.release(u)

    def _image_at(self, keys: list[bytes], b: int) -> Image | None:
        if b < 1:
            return None
        img = self._images.get(keys[b - 1])
        return img if img is not None and img.state is ImageState.READY else None

    def _answer(
        self, tokens: np.ndarray, keys: list[bytes], skip: frozenset[str] = frozenset()
    ) -> PrefixHit:
        limit = min(len(keys), max(0, (tokens.size - 1) // self.block_size))
        if not self.enabled:
            limit = 0
        full = 0
        while full < limit and keys[full] in self._block_of:
            full += 1
        tier_kv: dict[int, int] = {}  # block index -> tier serving it
        tier_state: dict[int, int] = {}  # boundary -> tier serving its image
        if self.tiers and limit:
            full = self._locate(keys, full, limit, skip, tier_kv, tier_state)
        cand = full if self.has_kv else limit
        while True:  # each group answers "the largest boundary <= cand I can resume from"
            new = cand
            if self.has_state:
                while new > 0 and self._image_at(keys, new) is None and new not in tier_state:
                    new -= 1
            if new == cand:
                break
            cand = new
        image = self._image_at(keys, cand) if self.has_state else None
        names = self.tiers.names
        image_source = None
        if self.has_state and cand:
            image_source = "device" if image is not None else names[tier_state[cand]]
        matched = full if self.has_kv else cand
        kv = range(cand) if self.has_kv else range(0)
        return PrefixHit(
            tokens=cand * self.block_size,
            blocks=tuple(-1 if i in tier_kv else self._block_of[keys[i]] for i in kv),
            image=image,
            matched_kv_tokens=matched * self.block_size,
            lost_tokens=(matched - cand) * self.block_size,
            sources=tuple(names[tier_kv[i]] if i in tier_kv else "device" for i in kv),
            image_source=image_source,
        )

    def _locate(
        self,
        keys: list[bytes],
        full: int,
        limit: int,
        skip: frozenset[str],
        tier_kv: dict[int, int],
        tier_state: dict[int, int],
    ) -> int:
        """Extend the device's KV run with blocks the tiers hold, then find the
        boundaries up to it whose image a tier holds.

        KV is probed in windows that double while every block is found (32, 64,
        128...): a prompt that misses costs one small probe per tier, not one
        name per block of the prompt; a long hit costs log2(its length) probes."""
        if self.has_kv:
            window = 32
            while full < limit:
                todo = range(full, min(limit, full + window))
                wanted = [i for i in todo if keys[i] not in self._block_of]
                names = [object_name(ImageKind.KV_BLOCK, keys[i]) for i in wanted]
                for i, name, where in zip(wanted, names, self.tiers.locate(names), strict=True):
                    if where is not None and name not in skip:
                        tier_kv[i] = where
                start = full
                while full < limit and (keys[full] in self._block_of or full in tier_kv):
                    full += 1
                if full < start + len(todo):
                    break  # a gap: the run ends here
                window *= 2
        for i in [i for i in tier_kv if i >= full]:
            del tier_kv[i]
        top = full if self.has_kv else limit
        if self.has_state and self.spec is not None and top:
            st_at = [b for b in range(1, top + 1) if self._image_at(keys, b) is None]
            names = [object_name(ImageKind.STATE, keys[b - 1]) for b in st_at]
            for b, name, where in zip(st_at, names, self.tiers.locate(names), strict=True):
                if where is not None and name not in skip:
                    tier_state[b] = where
        return full

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
        total = -(-(tok.size + reserve) // self.block_size) if self.has_kv else 0
        self._check_room(hit, total)
        payloads: dict[str, memoryview] = {}
        if any(s != "device" for s in hit.sources) or hit.image_source not in (None, "device"):
            hit, payloads = self._load(tok, keys, hit)
            self._check_room(hit, total)
        self.metrics.lookups += 1  # a refused admission leaves every book, counts included
        h = hit.tokens // self.block_size
        blocks_b = self.cache.blocks
        device_blocks = [b for b in hit.blocks if b >= 0]
        for b in [*device_blocks, *(hit.image.units if hit.image else ())]:
            blocks_b.retain(b)
        new = blocks_b.allocate(total - len(device_blocks))
        slots = self.cache.allocate_state(request) if self.has_state else ()
        blocks = self._take_hit_blocks(keys, hit, new, payloads)
        if hit.image is not None and self.spec is not None:
            self.cache.restore(self.spec, [hit.image.units], [slots[0]])
            for u in hit.image.units:
                blocks_b.release(u)  # restored: the image ages in the LRU again
        elif hit.image_source is not None and self.spec is not None:  # from a tier
            self._restore_payload(payloads[object_name(ImageKind.STATE, keys[h - 1])], slots[0])
            src = hit.image_source
            self.metrics.tier_images_read[src] = self.metrics.tier_images_read.get(src, 0) + 1
        if hit.image_source is not None and self.spec is not None:
            self.metrics.images_read += 1
            self.metrics.image_bytes_read += self.spec.image_bytes
        checkpoints: list[int] = []
        if self.has_state and self.spec is not None and self.enabled:
            checkpoints = self.policy.boundaries(tok.size, self.block_size, h)
            if self.policy.branch:
                if hit.lost_tokens:
                    self._wanted.add(keys[hit.matched_kv_tokens // self.block_size - 1])
                full = tok.size // self.block_size
                checkpoints = sorted(
                    set(checkpoints)
                    | {b for b in range(h + 1, full + 1) if keys[b - 1] in self._wanted}
                )
        self.metrics.requests += 1
        self.metrics.hits += bool(h)
        self.metrics.hit_tokens += hit.tokens
        self.metrics.lost_tokens += hit.lost_tokens
        self.metrics.computed_tokens += tok.size - hit.tokens
        adm = Admission(
            request=request,
            tokens=tok,
            keys=keys,
            hit=hit,
            blocks=blocks,
            slots=tuple(slots),
            checkpoints=checkpoints,
            committed=h,
            extra=tuple(extra),
        )
        self._running[request] = adm
        return adm

    def _check_room(self, hit: PrefixHit, total: int) -> None:
        """Refuse (nothing taken) unless the blocks and a slot for this hit fit."""
        blocks_b = self.cache.blocks
        need = total - sum(1 for b in hit.blocks if b >= 0)
        held = [b for b in hit.blocks if b >= 0] + (hit.image.units if hit.image else [])
        evictable_held = sum(1 for b in held if blocks_b.is_evictable(b))
        if need > blocks_b.num_free + blocks_b.num_evictable - evictable_held:
            raise BlockAllocationError(
                need, blocks_b.num_free, blocks_b.num_evictable - evictable_held
            )
        if self.has_state and self.cache.slots.num_free < self.cache.slots.entries_per_req:
            raise StateAllocationError(self.cache.slots.entries_per_req, self.cache.slots.num_free)

    # -- tiers -------------------------------------------------------------------------
    def _expected(self, kind: ImageKind, keys: list[bytes], b: int) -> Expected:
        """What the image of block ``b`` (KV) or of boundary ``b`` (STATE) must be."""
        bs = self.block_size
        if kind is ImageKind.KV_BLOCK:
            return Expected(
                kind=kind,
                key=keys[b],
                namespace=self._ns,
                start=b * bs,
                end=(b + 1) * bs,
                payload_bytes=self.cache.block_bytes,
                elided=self._elided,
            )
        return Expected(
            kind=kind,
            key=keys[b - 1],
            namespace=self._ns,
            start=0,
            end=b * bs,
            payload_bytes=self.spec.image_bytes if self.spec else 0,
            elided=self._elided,
        )

    def _load(
        self, tok: np.ndarray, keys: list[bytes], hit: PrefixHit
    ) -> tuple[PrefixHit, dict[str, memoryview]]:
        """Fetch and check every tier object ``hit`` uses; an object that fails
        is deleted and counted, and the answer recomputed without it."""
        tier_of = {n: i for i, n in enumerate(self.tiers.names)}
        good: dict[str, memoryview] = {}
        skip: set[str] = set()
        while True:
            wanted: dict[int, list[tuple[str, Expected]]] = {}
            for i, src in enumerate(hit.sources):
                if src != "device":
                    name = object_name(ImageKind.KV_BLOCK, keys[i])
                    wanted.setdefault(tier_of[src], []).append(
                        (name, self._expected(ImageKind.KV_BLOCK, keys, i))
                    )
            if hit.image_source not in (None, "device"):
                b = hit.tokens // self.block_size
                name = object_name(ImageKind.STATE, keys[b - 1])
                wanted.setdefault(tier_of[hit.image_source], []).append(  # type: ignore[index]
                    (name, self._expected(ImageKind.STATE, keys, b))
                )
            failed = False
            for t, items in wanted.items():
                todo = [(n, e) for n, e in items if n not in good]
                for (name, exp), data in zip(
                    todo, self.tiers.fetch(t, [n for n, _ in todo]), strict=True
                ):
                    if data is None:
                        failed = True
                        skip.add(name)
                        continue
                    try:
                        good[name] = decode(data, exp)
                    except ImageMismatch as exc:
                        r = self.metrics.tier_rejected
                        r[exc.reason] = r.get(exc.reason, 0) + 1
                        self.tiers.drop(t, [name])
                        failed = True
                        skip.add(name)
            if not failed:
                return hit, good
            hit = self._answer(tok, keys, frozenset(skip))

    def _take_hit_blocks(
        self, keys: list[bytes], hit: PrefixHit, new: list[int], payloads: dict[str, memoryview]
    ) -> list[int]:
        """The request's blocks: the device's hit blocks (retained), then tier
        blocks copied into new ones and cached at once, then the rest."""
        out: list[int] = []
        fresh = iter(new)
        for i, b in enumerate(hit.blocks):
            if b >= 0:
                out.append(b)
                continue
            blk = next(fresh)
            if not self._elided:
                src = _host_bytes(payloads[object_name(ImageKind.KV_BLOCK, keys[i])])
                self.cache.block_bytes_of(blk).copy_(src)
            self._cache_block(keys[i], i, blk)
            out.append(blk)
            name = hit.sources[i]
            self.metrics.tier_hit_tokens[name] = (
                self.metrics.tier_hit_tokens.get(name, 0) + self.block_size
            )
        out.extend(fresh)
        return out

    def _restore_payload(self, payload: memoryview, slot: int) -> None:
        """A state image's bytes (its checkpoint ranges, in order) into ``slot``."""
        if self._elided or self.spec is None:
            return
        src = _host_bytes(payload)
        raw = self.cache.slot_bytes_of(slot)
        pos = 0
        for o, n in self.spec.ranges:
            raw[o : o + n].copy_(src[pos : pos + n])
            pos += n

    def _cache_block(self, key: bytes, index: int, block: int) -> None:
        self._block_of[key] = block
        self._key_of[block] = key
        self._depth[key] = index
        self.cache.blocks.set_cached(block)

    def _kv_object(self, key: bytes, block: int) -> TierObject:
        i = self._depth[key]
        payload = None if self._elided else (_host_view(self.cache.block_bytes_of(block)),)
        return encode(
            kind=ImageKind.KV_BLOCK,
            namespace=self._ns,
            key=key,
            start=i * self.block_size,
            end=(i + 1) * self.block_size,
            payload=payload,
            payload_bytes=self.cache.block_bytes,
        )

    def _state_object(self, img: Image) -> TierObject:
        spec = self.spec
        assert spec is not None
        parts: list[memoryview] | None = None
        if not self._elided:
            parts, left = [], spec.image_bytes
            stride = self.cache.block_stride
            for u in img.units:
                n = min(spec.unit_bytes, left)
                parts.append(_host_view(self.cache.buf[u * stride : u * stride + n]))
                left -= n
        return encode(
            kind=ImageKind.STATE,
            namespace=self._ns,
            key=img.key,
            start=0,
            end=img.boundary * self.block_size,
            payload=parts,
            payload_bytes=spec.image_bytes,
        )

    def _evicting(self, blocks: list[int]) -> None:
        """The allocator's ``before_evict``: write the victims' KV and images back."""
        objects: list[TierObject] = []
        for b in blocks:
            key = self._key_of.get(b)
            if key is not None:
                objects.append(self._kv_object(key, b))
                self.metrics.tier_blocks_written += 1
            img = self._image_of_unit.get(b)
            if (
                img is not None
                and not img.tiered
                and img.state is ImageState.READY
                and self._images.get(img.key) is img
            ):
                img.tiered = True
                objects.append(self._state_object(img))
                self.metrics.tier_images_written += 1
        if objects:
            self.tiers.write_back(objects)

    @synchronized
    def drain(self, batch: int = 256) -> int:
        """Write every cached block and READY image back to the tiers without
        evicting anything (a server shutting down, so the next one starts warm);
        the number of objects written."""
        batch = check_count(batch, "drain: batch", lo=1)
        if not self.tiers:
            return 0
        self.poll()
        objects: list[TierObject] = []
        n = 0
        for key, block in list(self._block_of.items()):
            objects.append(self._kv_object(key, block))
            if len(objects) >= batch:
                self.tiers.write_back(objects)
                n, objects = n + len(objects), []
        for img in list(self._images.values()):
            if img.state is ImageState.READY and not img.tiered:
                img.tiered = True
                objects.append(self._state_object(img))
                if len(objects) >= batch:
                    self.tiers.write_back(objects)
                    n, objects = n + len(objects), []
        self.tiers.write_back(objects)
        return n + len(objects)

    @synchronized
    def commit(self, request: Hashable, tokens: int) -> None:
        """The request has computed its first ``tokens`` prompt tokens: register the
        keys of the full blocks among them (a block another request already cached
        under the same key stays uncached and is freed when this one finishes)."""
        adm = self.running(request)
        n = min(check_count(tokens, "commit: tokens") // self.block_size, len(adm.keys))
        if not self.has_kv:
            adm.committed = max(adm.committed, n)
            return
        for i in range(adm.committed, n):
            key, block = adm.keys[i], adm.blocks[i]
            if key not in self._block_of:
                self._cache_block(key, i, block)
        adm.committed = max(adm.committed, n)

    @synchronized
    def checkpoint(self, request: Hashable, boundary: int, *, event: Any = None) -> Image | None:
        """Keep an image of the request's state, which holds the state at ``boundary``
        blocks, keyed by that prefix. None when one exists already or no units fit.

        The image is visible to lookups once its bytes are written: at once on the
        CPU; on CUDA when ``event`` (by default one recorded right after the copy)
        has completed. A caller copying on its own stream passes its own event."""
        adm = self.running(request)
        if self.spec is None:
            raise InvalidValueError("this cache keeps no images (it needs PAGE and STATE fields)")
        b = check_count(boundary, "checkpoint: boundary", lo=1, hi=len(adm.keys))
        key = adm.keys[b - 1]
        self._wanted.discard(key)
        if key in self._images:
            return None
        blocks_b = self.cache.blocks
        if self.spec.units_per_image > blocks_b.num_free + blocks_b.num_evictable:
            self.metrics.images_skipped += 1
            return None
        units = blocks_b.allocate(self.spec.units_per_image)
        img = Image(key=key, boundary=b, units=units, state=ImageState.COPYING)
        self.cache.store(self.spec, [adm.slots[0]], [units])
        if event is None and self.cache.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        img.event = event
        for u in units:
            blocks_b.set_cached(u)
            self._image_of_unit[u] = img
        self._images[key] = img
        self._copying.append(img)
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
            self.cache.blocks.release(b)
        for img in adm.images:
            img.writer_done = True
            if img.state is ImageState.READY:
                self._release_image(img)  # (a COPYING one is released when it is READY)
        if adm.slots:
            self.cache.free_state(request)

    # -- books kept in step with the cache -------------------------------------------------
    def _evicted(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            del self._depth[key]
            self.metrics.evicted_blocks += 1
            # The image at this block's boundary can no longer be resumed from (its
            # last KV block is gone): give its units back now, not when they age out.
            img = self._images.get(key)
            if img is not None and img.state is ImageState.READY:
                unit = img.units[0]
                if self.cache.blocks.is_evictable(unit):
                    self.cache.blocks.evict(unit)
        img = self._image_of_unit.pop(block, None)
        if img is not None and self._images.get(img.key) is img:
            del self._images[img.key]
            self.metrics.evicted_images += 1
            for u in img.units:  # the rest of the image is worthless now
                if self._image_of_unit.pop(u, None) is img and self.cache.blocks.is_evictable(u):
                    self.cache.blocks.evict(u)

    def _moved(self, move: BoundaryMove) -> None:
        remap = move.block_remap
        if remap:
            moved_keys = {remap[b]: self._key_of.pop(b) for b in list(self._key_of) if b in remap}
            self._key_of.update(moved_keys)
            for b, k in moved_keys.items():
                self._block_of[k] = b
            moved_units = {
                remap[u]: self._image_of_unit.pop(u)
                for u in list(self._image_of_unit)
                if u in remap
            }
            self._image_of_unit.update(moved_units)
            for img in {id(i): i for i in moved_units.values()}.values():
                img.units = [remap.get(u, u) for u in img.units]
            for adm in self._running.values():
                adm.blocks = [remap.get(b, b) for b in adm.blocks]
        if move.slot_remap:
            for adm in self._running.values():
                adm.slots = tuple(move.slot_remap.get(s, s) for s in adm.slots)

    # -- boundary moves through the prefix cache's own books -----------------------------
    @synchronized
    def rebalance(self, *, waiting_requests: int, blocks_needed: int) -> BoundaryMove | None:
        return self.cache.rebalance(waiting_requests=waiting_requests, blocks_needed=blocks_needed)

    @synchronized
    def check_books(self) -> None:
        """Every cached key maps a block the allocator holds (live or evictable), every
        image's units are cached, and no two keys share a block (for tests)."""
        b = self.cache.blocks
        assert len(self._block_of) == len(self._key_of) == len(self._depth)
        for k, blk in self._block_of.items():
            assert self._key_of[blk] == k and not b.is_free(blk) and b.is_cached(blk)
        for img in self._images.values():
            for u in img.units:
                assert self._image_of_unit.get(u) is img and not b.is_free(u) and b.is_cached(u)
        assert not set(self._key_of) & set(self._image_of_unit)
