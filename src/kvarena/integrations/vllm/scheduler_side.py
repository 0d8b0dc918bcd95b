"""The scheduler's half of the connector: lookups, and what each step loads and saves.

A lookup is kvarena's contract (:mod:`kvarena.prefix.lookup`) over what the
tiers hold: the longest block boundary where every full-attention group has
every block and each state group has its image taken exactly there; at most
``len(prompt) - 1`` tokens, so vLLM always computes the last prompt token
itself and never feeds a recurrent state a token it already holds.

Saves follow vLLM's own book: a KV block is saved in the step that fills it
(its block id read from the scheduler's table that step), a state in the step
vLLM offers its boundary block (``kv_connector_block_state``) — the only
moment that block is known to hold exactly that boundary's state.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from ...prefix.keys import key_root
from ...prefix.lookup import TierFinds, locate_in_tiers, resume_point
from ...tiers.names import ImageKind, object_name
from ...tiers.stack import tier_labels
from .asked import AskedBefore
from .catalogue import Catalogue
from .chains import WINDOW, RequestKeys, cacheable, request_extra, saved_tail
from .events import TierEvents
from .groups import Group
from .key_memo import KeyMemo
from .pace import LOADS_IN_FLIGHT, LoadPace
from .ranks import AllRanks
from .records import BlockCopy, Load, StepPlan, WorkerReport
from .telemetry import Telemetry
from .tensors import payload_bytes


@dataclass(frozen=True, kw_only=True)
class Found:
    """A lookup's answer, kept until vLLM allocates the blocks to load into."""

    local: int  # blocks vLLM holds itself
    resume_point: int  # blocks the request resumes after
    finds: TierFinds
    keys: RequestKeys
    tail: BlockCopy | None = None  # a partial block after them (its blocks not known yet)
    rows: int = 0  # the tokens of ``tail`` the hit uses
    in_step: bool = False  # loaded in the step vLLM schedules it in (its synchronous path)
    part: bool = False  # KV blocks alone: a prefill engine's read brings the rest


class SchedulerSide:
    def __init__(
        self,
        *,
        groups: list[Group],
        namespace: bytes,
        catalogue: Catalogue,
        block_size: int,
        ranks: int = 1,
        events: TierEvents | None = None,
        memo: KeyMemo | None = None,
    ) -> None:
        """``namespace``: the engine's (all ranks'); ``ranks``: its tensor-parallel size;
        ``events``: the KV events book, where vLLM publishes them."""
        self.groups = groups
        self.kv_groups = [g for g in groups if g.kind == "kv"]
        self.state_groups = [g for g in groups if g.kind == "state"]
        self.block_size = block_size
        self.root = key_root(namespace)
        self.catalogue = catalogue
        self._objects = AllRanks(catalogue, ranks)  # what a lookup asks
        self.asked = AskedBefore(catalogue, self._objects)  # waiting requests' last lookups
        self._requests: dict[str, Any] = {}
        self._keys: dict[str, RequestKeys] = {}
        self._memo = memo  # keys by vLLM's block hashes (None: each request hashed here)
        self._found: dict[str, Found] = {}
        # KV blocks below this are in the tiers (loaded from them, or planned to be saved)
        self._saved_upto: dict[str, int] = {}
        self._floor: dict[str, int] = {}  # state boundaries up to this are in the tiers
        self._loads: list[Load] = []
        self.telemetry = Telemetry(ranks)  # what the engine's metrics count
        self._inflight: dict[str, float] = {}  # loads not reported done: when each was planned
        self._running: set[str] = set()  # scheduled last step, not finished since
        self.events = events
        self.pace = LoadPace()  # step, host copy and asynchronous wait times, as measured
        kinds = catalogue.kinds
        self._host = tier_labels(kinds)[0] if kinds and kinds[0] == "host" else None
        self._kv_bytes = payload_bytes(self.kv_groups)  # one KV object's payload, one rank

    # -- keys ---------------------------------------------------------------------
    def _chain(self, request: Any) -> RequestKeys:
        """The request's keys (hashed as far as asked, never rehashed)."""
        chain = self._keys.get(request.request_id)
        if chain is None:
            extra, bs = request_extra(request), self.block_size
            chain = RequestKeys(self.root, request, bs, extra, self._memo)
            self._keys[request.request_id] = chain
        return chain

    # -- lookups ------------------------------------------------------------------
    def matched(
        self, request: Any, num_computed: int, *, part: bool = False
    ) -> tuple[int | None, bool]:
        """Hit tokens beyond ``num_computed``, and whether they load asynchronously
        (None: ask again). ``part``: the hit is the first part of a request whose
        prefill engine offers the rest (:mod:`.pd_scheduler`): whole KV blocks
        alone, no state (the rest's read brings the state at its end), loaded
        off the step."""
        self._found.pop(request.request_id, None)
        if not cacheable(request):
            return 0, False
        bs = self.block_size
        local = num_computed // bs
        limit = (request.num_tokens - 1) // bs
        tails = self._tails_served and not part
        if limit < local or (limit == local and not tails):
            return 0, False
        if request.request_id not in self.asked:  # a request counts once, however often asked
            self.telemetry.looked_up()
        keys = self._chain(request)
        had = keys.known(limit)
        start, known, walked, since = self.asked.start(request.request_id, keys, local, limit, had)
        finds = locate_in_tiers(
            self._objects,
            keys,
            kv_end=start,
            limit=limit,
            has_kv=bool(self.kv_groups),
            has_state=bool(self.state_groups),
            device_kv=None,
            device_image=None,
            skip=self.asked.skip,
            names=keys.names,
            window=WINDOW,
            known=had,
            walked=walked,
            below=known,  # the levels below ``start`` (shared, never changed)
        )
        self.asked.found(request.request_id, keys, local, finds, since)
        point = (
            finds.kv_end
            if part
            else resume_point(finds.kv_end, bool(self.state_groups), lambda b: b in finds.state)
        )
        tail, rows = (
            saved_tail(self._objects, request, keys, limit, self.asked.skip)
            if tails and point == limit
            else (None, 0)
        )
        if point * bs + rows <= num_computed:
            return 0, False
        if len(self._inflight) >= LOADS_IN_FLIGHT:
            return None, False  # ask again: no load starts past the bound
        in_step = not part and self._in_step(finds, local, point, tail)
        self._found[request.request_id] = Found(
            local=local,
            resume_point=point,
            finds=finds,
            keys=keys,
            tail=tail,
            rows=rows,
            in_step=in_step,
            part=part,
        )
        # Loaded between steps, never inside the forward that resumes from it:
        # vLLM copies a resumed request's Mamba state to its running block
        # before the step's loads start, so a load must have landed a step
        # earlier (the request waits for it, then is scheduled).
        return point * bs + rows - num_computed, not in_step

    def _in_step(self, finds: TierFinds, local: int, point: int, tail: BlockCopy | None) -> bool:
        """Whether a hit (blocks ``local`` to ``point``, and ``tail``) loads in the step
        vLLM schedules it in: where a host tier on top holds every object and the
        copy fits what is left of the step's budget as measured (:mod:`.pace`:
        a share of a step while other requests run, the asynchronous way's wait
        while none does); for an attention-only model of one group (vLLM maps a
        failed synchronous load's block ids back to requests for one group alone,
        and a state must land a step before the forward resuming from it)."""
        n = point - local + (tail is not None)
        if self._host is None or len(self.groups) != 1 or self.state_groups or not n:
            return False
        cost = self.pace.fits(n * self._kv_bytes, idle=not self._running)
        if cost is None:  # before the levels: mostly no
            return False
        levels = [finds.kv.get(i) for i in range(local, point)] + ([tail.level] if tail else [])
        if levels.count(0) != n:
            return False
        self.pace.spend(cost)
        return True

    @property
    def _tails_served(self) -> bool:
        """Partial blocks are hit where every group is full attention: a state is
        exact only at a block boundary, so a hybrid resumes at one."""
        return bool(self.kv_groups) and not self.state_groups

    def allocated(self, request: Any, block_ids: tuple[list[int], ...], external: int) -> None:
        rid = request.request_id
        self._requests[rid] = request
        found = self._found.pop(rid, None)
        if external == 0 or found is None:
            return
        local, b, keys = found.local, found.resume_point, found.keys
        kv = tuple(
            BlockCopy(
                index=i,
                key=keys[i],
                blocks=tuple(block_ids[g.index][i] for g in self.kv_groups),
                level=found.finds.kv.get(i),
            )
            for i in (range(local, b) if self.kv_groups else ())
        )
        upto = b
        if found.tail is not None:
            blocks = tuple(block_ids[g.index][b] for g in self.kv_groups)
            kv += (dataclasses.replace(found.tail, blocks=blocks),)
            if found.tail.tokens is None:  # a full block, used but for its last token
                upto = b + 1
        state = None
        if self.state_groups and not found.part:
            ids = tuple(block_ids[g.index][b - 1] for g in self.state_groups)
            state = BlockCopy(index=b, key=keys[b - 1], blocks=ids, level=found.finds.state.get(b))
        load = Load(request=rid, kv=kv, state=state, in_step=found.in_step, joined=found.part)
        if 0 in load.block_ids:
            raise RuntimeError(
                f"kvarena connector: request {rid}: vLLM allocated the null block where a hit "
                f"of {b} blocks loads (block ids {block_ids}); refusing to load"
            )
        self._loads.append(load)
        if not load.in_step:  # vLLM waits for word of it
            self._inflight[rid] = time.monotonic()
        for kind, n in self.hit_sources(request, external).items():
            self.telemetry.hit(kind, n)
        self._saved_upto[rid] = upto  # what the tiers hold is not saved again
        self._floor[rid] = 0 if found.part else b

    def hit_sources(self, request: Any, tokens: int) -> dict[str, int]:
        """Hit tokens by the outermost tier that serves each block of the load."""
        load = next((x for x in self._loads if x.request == request.request_id), None)
        if load is None or tokens == 0:
            return {}
        levels = [c.level for c in load.kv] + ([load.state.level] if load.state is not None else [])
        deepest = max((x for x in levels if x is not None), default=None)
        kinds = self.catalogue.kinds
        return {kinds[deepest] if deepest is not None else "external": tokens}

    # -- each step ----------------------------------------------------------------
    def plan(self, scheduler_output: Any) -> StepPlan:
        # fetched loads land in what the step's budget leaves (its in-step loads spent first)
        idle = not scheduler_output.num_scheduled_tokens
        plan = StepPlan(loads=self._loads, land_bytes=self.pace.land_bytes(idle=idle))
        self._loads = []
        cached = scheduler_output.scheduled_cached_reqs
        self.pace.stepped(time.monotonic(), busy=bool(cached.req_ids))
        self._running = set(scheduler_output.num_scheduled_tokens)
        bs = self.block_size
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        ends: dict[str, int] = {}  # requests whose step ends on a block boundary: that boundary
        tails: list[BlockCopy] = []  # partial blocks that prompts end in, this step
        for rid, count in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            if request is None or not cacheable(request) or rid not in starts:
                continue
            start = starts[rid]
            end = start + count
            if self.state_groups and end % bs == 0 and 0 < end <= len(request.all_token_ids):
                ends[rid] = end // bs
            if end % bs and end == getattr(request, "num_prompt_tokens", None):
                tail = self._tail_save(request, end, block_state)
                if tail is not None:
                    tails.append(tail)
            first = self._saved_upto.setdefault(rid, start // bs)
            self._floor.setdefault(rid, start // bs)
            upto = min(start + count, len(request.all_token_ids)) // bs
            if upto <= first:
                continue
            self._saved_upto[rid] = upto
            if not self.kv_groups or block_state is None:
                continue
            ids = block_state.get_block_ids(rid)
            if ids is None:
                continue
            keys = self._chain(request).upto(upto)
            for i in range(first, upto):
                blocks = tuple(ids[g.index][i] for g in self.kv_groups)
                if 0 not in blocks:
                    copy = BlockCopy(index=i, key=keys[i], blocks=blocks)
                    plan.kv_saves.append(copy)
                    if self.events is not None:
                        self.events.planned(request, ImageKind.KV_BLOCK, copy)
        plan.kv_saves += tails
        for rid, at in self._state_points(block_state, ends).items():
            request = self._requests[rid]
            for b in sorted(at):
                if b * bs > len(request.all_token_ids) or b <= self._floor.get(rid, 0):
                    continue
                key = self._chain(request).upto(b)[b - 1]
                blocks = tuple(at[b][g.index] for g in self.state_groups)
                copy = BlockCopy(index=b, key=key, blocks=blocks)
                plan.state_saves.append(copy)
                if self.events is not None:
                    self.events.planned(request, ImageKind.STATE, copy)
        return plan

    def _tail_save(self, request: Any, end: int, block_state: Any) -> BlockCopy | None:
        """The partial block a prompt ends in, as this step leaves it: what the
        same prompt asked again, or one that only adds to it, hits up to its
        last token; not where the tiers hold it already. Its page is saved as
        the kernel left it: past its ``end % bs`` tokens it holds what the block
        held before, which no attention reads (vLLM computes those positions
        after a load) and no kvarena check looks into (kvarena never interprets
        a page's layout, which is the attention backend's). One held that
        failed a load is saved again (the lookups skip it until then)."""
        if not self._tails_served or block_state is None:
            return None
        ids = block_state.get_block_ids(request.request_id)
        full, tokens = divmod(end, self.block_size)
        if full < 1 or ids is None or any(len(ids[g.index]) <= full for g in self.kv_groups):
            return None  # (a prompt under one block: its prefill costs less than a load)
        blocks = tuple(ids[g.index][full] for g in self.kv_groups)
        key = self._chain(request).tail(full, tokens)
        name = object_name(ImageKind.KV_BLOCK, key)
        held = self._objects.locate([name])[0] is not None and name not in self.asked.skip
        if 0 in blocks or held:
            return None
        return BlockCopy(index=full, key=key, blocks=blocks, tokens=tokens)

    def _state_points(
        self, block_state: Any, ends: dict[str, int]
    ) -> dict[str, dict[int, dict[int, int]]]:
        """Where this step leaves each request's state exactly at a block boundary,
        with each state group's block holding it: the boundaries vLLM offers
        (``boundary_state_offloads``), and the one a step ends on (a prompt's end
        above all: where the next turn of a conversation resumes), whose state is
        in the block of the boundary's last token. Only boundaries every state
        group holds in a real block."""
        if block_state is None:
            return {}
        bs = self.block_size
        state_ids = {g.index for g in self.state_groups}
        out: dict[str, dict[int, dict[int, int]]] = {}
        for rid, entries in block_state.boundary_state_offloads.items():
            request = self._requests.get(rid)
            if request is None or not cacheable(request):
                continue
            for group, block, tokens in entries:
                if group in state_ids and block != 0 and tokens % bs == 0 and tokens > 0:
                    out.setdefault(rid, {}).setdefault(tokens // bs, {})[group] = block
        for rid, b in ends.items():
            ids = block_state.get_block_ids(rid)
            if ids is None or b in out.get(rid, {}):
                continue  # vLLM's offer of the same boundary stands
            blocks = {
                g.index: ids[g.index][b - 1] for g in self.state_groups if len(ids[g.index]) >= b
            }
            if len(blocks) == len(state_ids) and 0 not in blocks.values():
                out.setdefault(rid, {})[b] = blocks
        return {
            rid: {b: g for b, g in at.items() if len(g) == len(state_ids)}
            for rid, at in out.items()
        }

    def reported(self, report: Any) -> None:
        if isinstance(report, WorkerReport):
            for part in report.loads:  # the host tier's loads: what paces loads in the step
                if self._host is not None and set(part.nbytes) == {self._host}:
                    self.pace.loaded(part.nbytes[self._host], part.seconds.get(self._host, 0.0))
            for nbytes, seconds in report.landed:
                self.pace.landed(nbytes, seconds)
            completed = self.telemetry.reported(report)
            if self.events is not None:
                self.events.reported(report, completed)
            self.catalogue.hosted(report.host_added, report.host_dropped)
            self.catalogue.written(report.written)
            # the connector names each kind once; a name a tier refused is not held
            for label, name, *_ in [*report.dropped, *report.refused]:
                self.catalogue.reported(label, (), [name])
            self.asked.reported(report.failed, report.saved)

    def loaded(self, requests: set[str]) -> None:
        """vLLM's word that these requests' loads are done (or failed)."""
        now = time.monotonic()
        for rid in requests:
            since = self._inflight.pop(rid, None)
            if since is not None:
                self.pace.waited(now - since)

    def finished(self, request: Any) -> None:
        rid = request.request_id
        self._inflight.pop(rid, None)
        self._running.discard(rid)
        self.asked.forget(rid)
        for book in (self._requests, self._keys, self._found, self._saved_upto, self._floor):
            book.pop(rid, None)
