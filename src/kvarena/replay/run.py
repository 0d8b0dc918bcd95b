"""One replay: a request trace through the real prefix cache and pools.

A trace is one JSON object a line: the Mooncake FAST'25 format
(``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` — one per
512-token block, expanded here into 512 deterministic token ids each, so equal
ids give equal token blocks and the cache's own hashing finds the reuse), or a
plain format with explicit ``tokens``.

The time model, stated: requests arrive at their timestamps and wait in FIFO
order until the pools can hold them (their prompt's and output's blocks and
their state slots; a refused admission first asks the cache to move its
boundary toward the demand); an admitted request prefills its computed
tokens at ``prefill_tokens_per_s``, its blocks and image checkpoints become
visible when the prefill ends, and it holds everything until its output is
decoded at ``decode_tokens_per_s`` and it finishes.

Two modes. Bookkeeping (default): the cache lives on torch's ``meta`` device —
real allocators, keys, lookups, evictions and boundary moves, no bytes — so an
80 GiB budget replays on a laptop. ``verify``: real bytes on the CPU with a
deterministic stand-in model: a block's KV is one 8-byte word derived from its
key and a boundary's state another, both pure functions of the token prefix,
so every restored block and state is checked byte for byte.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import InvalidValueError
from ..models import ModelCache
from ..pools import BlockAllocationError, CachePlan, StateAllocationError, blocks_for, plan_cache
from ..prefix import CheckpointPolicy, PrefixCache
from ..prefix.records import Admission, plan_namespace
from ..tiers import TierStack
from ..tiers.base import Tier
from ..tiers.image import object_bytes
from .host_memory import check_host_memory
from .timeline import Sample
from .trace import TraceRequest


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    budget_bytes: int
    max_seqs: int
    policy: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 50.0
    verify: bool = False
    reuse: bool = True
    tiers: tuple[str, ...] = ()  # tier specs below the device (host:SIZE, disk:DIR:SIZE, redis://)
    timeline: bool = False  # record a Sample after every event (replay --timeline)


@dataclass(kw_only=True)
class ReplayResult:
    label: str
    requests: int = 0
    admitted: int = 0
    dropped: int = 0  # larger than the whole cache
    prompt_tokens: int = 0
    requests_with_hit: int = 0
    boundary_moves: int = 0
    verified_blocks: int = 0
    verified_states: int = 0
    mismatches: int = 0
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    admission_us: float = 0.0  # lookup + admission per request
    blocks: int = 0
    slots: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    verified_by_source: dict[str, int] = field(default_factory=dict)  # device or a tier's name
    tiers: list[dict[str, Any]] = field(default_factory=list)
    drained: int = 0  # objects written to the tiers at the end of the run
    timeline: list[Sample] = field(default_factory=list)  # with ReplayConfig(timeline=True)

    @property
    def hit_tokens(self) -> int:
        return self.metrics.get("hit_tokens", 0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["timeline"] = [s.to_dict() for s in self.timeline]
        if not self.timeline:
            del d["timeline"]  # recorded only when asked (ReplayConfig.timeline)
        d["hit_fraction"] = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return d


def _state_word(key: bytes) -> int:
    digest = hashlib.blake2b(key + b"/state", digest_size=8).digest()
    return int(np.frombuffer(digest, dtype=np.int64)[0])


def _block_word(key: bytes) -> int:
    return int(np.frombuffer(key[:8], dtype=np.int64)[0])


class EngineRun:
    """One engine's replay of a trace: the prefix cache and tiers it builds, and
    the requests it is given run through them in its time model. :meth:`run`
    drives it alone over the whole trace; a fleet (:mod:`.fleet`) drives
    several in one clock through :meth:`arrive`, :meth:`advance` and
    :meth:`settle`."""

    def __init__(
        self,
        model: ModelCache,
        trace: Sequence[TraceRequest],
        cfg: ReplayConfig,
        label: str,
        checkpoints: Sequence[Sequence[int]] | None,
        below: Sequence[Tier] = (),
    ) -> None:
        """``below``: tiers under this engine's own (``cfg.tiers``), opened and
        closed by the caller: a fleet's store, shared by its engines, which
        each prefill's blocks and images are also written through to."""
        self.trace, self.cfg, self.checkpoints = trace, cfg, checkpoints
        plan = plan_cache(model, budget_bytes=cfg.budget_bytes, max_seqs=cfg.max_seqs)
        device = torch.device("cpu" if cfg.verify else "meta")
        own = TierStack.from_specs(cfg.tiers, frame_bytes=frame_bytes(plan))
        self._own = own.tiers
        self.tiers = TierStack([*own.tiers, *below]) if below else own
        self._store = TierStack(below) if below else None
        try:
            self.pc = PrefixCache(
                plan, device, policy=cfg.policy, reuse=cfg.reuse, tiers=self.tiers
            )
        except BaseException:
            own.close()
            raise
        self.bs = plan.block_size
        self.result = ReplayResult(label=label)
        self.queue: deque[int] = deque()
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.admit_seconds = 0.0
        self.finished = 0

    # -- the stand-in model (verify mode) ------------------------------------------------
    def _verify_hit(self, adm: Admission) -> None:
        h = adm.hit.tokens // self.bs
        c = self.pc.cache
        by = self.result.verified_by_source
        for i in range(h if self.pc.has_kv else 0):
            ok = bool(
                (
                    c.block_bytes_of(adm.blocks[i]).view(torch.int64) == _block_word(adm.keys[i])
                ).all()
            )
            self.result.verified_blocks += 1
            self.result.mismatches += not ok
            by[adm.hit.sources[i]] = by.get(adm.hit.sources[i], 0) + 1
        if h and adm.slots and self.pc.spec is not None:
            src = f"{adm.hit.image_source} (states)"
            by[src] = by.get(src, 0) + 1
            raw = c.slot_bytes_of(adm.slots[0])
            word = _state_word(adm.keys[h - 1])
            ok = all(
                bool((raw[o : o + n].view(torch.int64) == word).all())
                for o, n in self.pc.spec.ranges
            )
            self.result.verified_states += 1
            self.result.mismatches += not ok

    def _compute(self, index: int) -> None:
        """The prefill's end: KV for the new prompt blocks, images at the boundaries."""
        adm = self.pc.running(index)
        h = adm.hit.tokens // self.bs
        full = adm.tokens.size // self.bs
        c = self.pc.cache
        if self.cfg.verify and self.pc.has_kv:
            for i in range(h, full):
                c.block_bytes_of(adm.blocks[i]).view(torch.int64).fill_(_block_word(adm.keys[i]))
        wanted = adm.checkpoints
        if self.checkpoints is not None:  # told where, not the policy's choice
            wanted = [b for b in self.checkpoints[index] if h < b <= full]
        for b in wanted:
            if self.cfg.verify:
                raw = c.slot_bytes_of(adm.slots[0])
                word = _state_word(adm.keys[b - 1])
                for o, n in self.pc.spec.ranges:  # type: ignore[union-attr]
                    raw[o : o + n].view(torch.int64).fill_(word)
            self.pc.checkpoint(adm.request, b)
        self.pc.commit(adm.request, adm.tokens.size)
        if self._store is not None:
            self.pc.publish(adm.request, self._store, wanted)

    # -- the time model ------------------------------------------------------------------
    def _push(self, t: float, kind: str, index: int) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, index))
        self.seq += 1

    def _try_admit(self, now: float) -> None:
        while self.queue:
            index = self.queue[0]
            req = self.trace[index]
            adm = self._admit(index, req)
            if adm is None:
                running = any(kind == "finish" for _, _, kind, _ in self.events)
                if running:
                    return  # wait for a request to finish
                self.queue.popleft()  # larger than the whole cache, even empty
                self.result.dropped += 1
                continue
            self.queue.popleft()
            self.result.admitted += 1
            if adm.hit.tokens:
                self.result.requests_with_hit += 1
            computed = req.tokens.size - adm.hit.tokens
            prefill = computed / self.cfg.prefill_tokens_per_s
            decode = req.output_tokens / self.cfg.decode_tokens_per_s
            self._push(now + prefill, "prefill", index)
            self._push(now + prefill + decode, "finish", index)

    def _admit(self, index: int, req: TraceRequest) -> Admission | None:
        for attempt in range(2):
            start = time.perf_counter()
            try:
                adm = self.pc.admit(index, req.tokens, reserve_tokens=req.output_tokens)
            except (BlockAllocationError, StateAllocationError) as exc:
                self.admit_seconds += time.perf_counter() - start
                if attempt:
                    return None
                slots_short = isinstance(exc, StateAllocationError)
                need = blocks_for(req.tokens.size + req.output_tokens, self.bs)
                move = self.pc.rebalance(waiting_requests=int(slots_short), blocks_needed=need)
                if move is None:
                    return None
                self.result.boundary_moves += 1
                continue
            self.admit_seconds += time.perf_counter() - start
            if self.cfg.verify:
                self._verify_hit(adm)
            return adm
        return None

    def _sample(self, now: float) -> None:
        c, m = self.pc.cache, self.pc.metrics
        self.result.timeline.append(
            Sample(
                t=now,
                blocks=c.num_blocks,
                live_blocks=c.blocks.num_live,
                cached_blocks=c.blocks.num_evictable,
                slots=c.num_slots,
                live_slots=c.slots.num_live,
                running=self.result.admitted - self.finished,
                waiting=len(self.queue),
                hit_tokens=m.hit_tokens,
                prompt_tokens=self.result.prompt_tokens,
                evicted_blocks=m.evicted_blocks,
                evicted_images=m.evicted_images,
            )
        )

    # -- one engine's part of a run (a fleet drives several, in one clock) ----------------
    @property
    def next_event(self) -> float:
        """When this engine's next prefill ends or request finishes (inf: none)."""
        return self.events[0][0] if self.events else float("inf")

    @property
    def busy(self) -> int:
        """Requests admitted and not finished, and those waiting."""
        return self.result.admitted - self.finished + len(self.queue)

    def arrive(self, index: int, now: float) -> None:
        self.result.requests += 1
        self.result.prompt_tokens += self.trace[index].tokens.size
        self.queue.append(index)
        self.settle(now)

    def advance(self) -> float:
        """Take this engine's next event; its time."""
        now, _, kind, index = heapq.heappop(self.events)
        if kind == "prefill":
            self._compute(index)
        else:
            self.pc.finish(index)
            self.finished += 1
        self.settle(now)
        return now

    def settle(self, now: float) -> None:
        """Admit what the pools hold now (with nothing running, drop what never fits)."""
        self._try_admit(now)
        if self.cfg.timeline:
            self._sample(now)

    def run(self) -> ReplayResult:
        try:
            wall = time.perf_counter()
            arrivals = deque(range(len(self.trace)))
            now = 0.0
            while arrivals or self.events or self.queue:
                next_arrival = (
                    self.trace[arrivals[0]].arrival_ms / 1000 if arrivals else float("inf")
                )
                if self.events and self.next_event <= next_arrival:
                    now = self.advance()
                elif arrivals:
                    now = next_arrival
                    self.arrive(arrivals.popleft(), now)
                else:
                    self.settle(now)
            return self.summed(now, time.perf_counter() - wall)
        finally:
            self.close()

    def close(self) -> None:
        """Close this engine's own tiers (those below it are its caller's)."""
        TierStack(self._own).close()

    def summed(self, now: float, wall_seconds: float, *, drain: bool = True) -> ReplayResult:
        """The result at the end of a run (``drain``: write what the device still
        caches down to the tiers, as a server shutting down does)."""
        r = self.result
        r.sim_seconds = now
        r.wall_seconds = wall_seconds
        r.admission_us = 1e6 * self.admit_seconds / max(1, r.admitted)
        r.blocks, r.slots = self.pc.cache.num_blocks, self.pc.cache.num_slots
        r.metrics = self.pc.metrics.to_dict()
        if self.tiers:
            # so the next run over the same disk or store starts warm
            r.drained = self.pc.drain() if drain else 0
            r.tiers = self.tiers.report()
            m = self.pc.metrics
            for row in r.tiers:
                row["hit_tokens"] = m.tier_hit_tokens.get(str(row["tier"]), 0)
                row["images_read"] = m.tier_images_read.get(str(row["tier"]), 0)
        return r


def frame_bytes(plan: CachePlan) -> int:
    """A host tier's frame: one KV block's object, so a block takes exactly one."""
    return object_bytes(plan_namespace(plan).to_json(), plan.block_bytes)


def replay(
    model: ModelCache,
    trace: Sequence[TraceRequest],
    cfg: ReplayConfig,
    *,
    label: str = "kvarena",
    checkpoints: Sequence[Sequence[int]] | None = None,
) -> ReplayResult:
    """Replay ``trace`` through a prefix cache planned for ``model`` in ``cfg.budget_bytes``.

    ``checkpoints``, one sequence of block boundaries per request in trace order,
    replaces the policy's choice of where each request keeps images (the
    clairvoyant bound, :mod:`.clairvoyant`); boundaries inside the hit are skipped."""
    if not isinstance(model, ModelCache):
        raise InvalidValueError(f"replay: model must be a ModelCache, got {type(model).__name__}")
    if checkpoints is not None:
        _check_checkpoints(checkpoints, trace)
    check_host_memory(cfg.budget_bytes, verify=cfg.verify)
    return EngineRun(model, trace, cfg, label, checkpoints).run()


def _check_checkpoints(checkpoints: Sequence[Sequence[int]], trace: Sequence[TraceRequest]) -> None:
    if len(checkpoints) != len(trace):
        raise InvalidValueError(
            f"replay: checkpoints has {len(checkpoints)} entries for {len(trace)} requests; "
            "give one sequence of boundaries per request"
        )
    for i, bs in enumerate(checkpoints):
        for b in bs:
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise InvalidValueError(
                    f"replay: checkpoints[{i}] holds {b!r}; a boundary is a block count >= 1"
                )
