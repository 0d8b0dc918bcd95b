"""A worker's half of disaggregation: vLLM's registered cache on a NIXL agent.

On a prefill engine the agent only serves: a decode worker READs the blocks
the scheduler holds for it (an *offer*), and the READ's notification
(``kvarena-pulled:<request>``) tells this worker the blocks may be freed —
reported to vLLM as ``finished_sending``, as is an offer whose hold expired.

On a decode engine the scheduler has fetched the prefill worker's hello
(:mod:`.pd_channel`, once per engine, handed to the workers in a step's plan)
and a lease on the request's blocks before a *pull* (:class:`~.records.Pull`)
reaches a worker; the worker posts one NIXL READ of every span of its
objects, paired span for span from both span tables (:mod:`.pd_table`) and
merged where they continue each other on both sides, and sees it end on a
later step. Nothing here waits, and nothing needs a thread of the worker's
own (under ``vllm serve`` on a CPU they starve: see :class:`~.pd_channel.Asker`). A pull
that is refused, fails, or passes its deadline is reported failed and vLLM
recomputes its tokens; a READ NIXL cannot cancel is reported only once no
byte of it can move any more, so nothing lands in a block vLLM has moved on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...transfer.endpoint import nixl_api
from .groups import namespace_diff
from .pd_channel import ChannelError, Hello
from .pd_table import SpanTable, pair
from .records import Pull
from .tensors import CachePages

log = logging.getLogger("vllm.kvarena")

NOTIF = b"kvarena-pulled:"
EARLY_KEPT = 4096  # READ notifications kept for offers not yet known to this worker
PUMP_S = 0.001
PUMP_IDLE_S = 0.01
"""How often the pump drives the agent while this worker holds offers, and
otherwise: a READ moves only while its target's UCX worker is driven (here:
it stalled without), and an engine holding offers may have nothing to step —
an offline engine does not even step to tell its workers what it holds.
NIXL's own progress thread polls without pause (a whole core per worker,
measured); the pump costs about what an idle engine does."""


class _OneCallAtATime:
    """A NIXL agent that two threads (the step and the pump) call one at a time.
    The lock is Python's, which waits without the GIL: NIXL's own thread sync
    waits inside its bindings with the GIL held, and a decode worker hung
    there (``add_remote_agent`` on the step against the pump's
    ``get_new_notifs``)."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._agent, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return fn(*args, **kwargs)

        return call


@dataclass(kw_only=True, eq=False)
class _Pulling:
    pull: Pull
    deadline: float
    xfer: Any = None  # the NIXL handle, once posted
    descriptors: int = 0
    nbytes: int = 0
    began: float = field(default_factory=time.perf_counter)
    abandoned: str = ""  # why it failed, while NIXL could not release it yet


@dataclass(frozen=True, kw_only=True)
class PullDone:
    """One finished pull: descriptors posted, bytes read, seconds from submit."""

    request: str
    descriptors: int
    nbytes: int
    seconds: float


class PdWorker:
    """This worker's NIXL agent over vLLM's registered cache, as a prefill
    engine's server and a decode engine's reader."""

    def __init__(
        self, pages: CachePages, *, namespace: bytes, rank: int, ranks: int, timeout_s: float
    ) -> None:
        os.environ.setdefault("UCX_MODULES", "^ib")  # see transfer.endpoint
        nixl_agent, nixl_agent_config = nixl_api()
        self.rank, self.ranks = rank, ranks
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.table = SpanTable.of(pages)
        self.mem_type = "VRAM" if pages.device.type == "cuda" else "DRAM"
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False)
        self.agent = _OneCallAtATime(nixl_agent(f"kvarena-{rank}-{uuid.uuid4().hex[:12]}", config))
        rows = self.table.regions()
        self._reg = self.agent.register_memory(rows, self.mem_type) if len(rows) else None
        self._lock = threading.Lock()
        self._hellos: dict[str, Hello] = {}  # prefill engine id -> its worker's of this rank
        self._agents: dict[str, str] = {}  # engine id -> its remote agent's name
        self._pulling: list[_Pulling] = []
        self._offered: set[str] = set()
        self._early: OrderedDict[str, None] = OrderedDict()
        self._sent: set[str] = set()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._errors: set[int] = set()
        self._inbox: list[bytes] = []  # notifications the pump took
        self._holding = threading.Event()  # offers are held: the pump runs
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._drive, name="kvarena-pd-pump", daemon=True)
        self._pump.start()
        self.finished: list[PullDone] = []  # for the report
        self.failures = 0  # pulls failed (recomputed)

    def hello(self) -> Hello:
        return Hello(
            rank=self.rank,
            agent=self.agent.get_agent_metadata(),
            table=self.table.to_dict(),
            namespace=self.namespace,
        )

    # -- prefill side ---------------------------------------------------------------
    def _drive(self) -> None:
        """The pump: drive the agent and keep its notifications while offers are held."""
        while not self._stop.is_set():
            got = self._take()
            if got:
                with self._lock:
                    self._inbox += got
            self._stop.wait(PUMP_S if self._holding.is_set() or got else PUMP_IDLE_S)

    def _take(self) -> list[bytes]:
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def offered(self, requests: list[str]) -> None:
        for rid in requests:
            if self._early.pop(rid, "absent") is None:
                self._sent.add(rid)  # read before this worker heard of the offer
            else:
                self._offered.add(rid)
        if self._offered:
            self._holding.set()

    def expired(self, requests: list[str]) -> None:
        for rid in requests:
            if rid in self._offered:
                self._offered.discard(rid)
                self._sent.add(rid)
                if self.rank == 0:
                    log.warning("kvarena: request %s was not read by a decode engine; freed", rid)

    # -- decode side ----------------------------------------------------------------
    def submit(self, pulls: list[Pull]) -> None:
        for pull in pulls:
            if pull.refused:
                self._fail(pull, pull.refused)
                continue
            # given up before its lease ends (the clock is the machine's, as the
            # scheduler's that took the lease)
            deadline = min(time.monotonic() + self.timeout_s, pull.lease_end)
            self._pulling.append(_Pulling(pull=pull, deadline=deadline))

    def learn(self, peers: dict[str, dict[int, dict]]) -> None:
        """Prefill engines' hellos, as the scheduler fetched them: this rank's."""
        for engine, hellos in peers.items():
            if self.rank in hellos:
                self._hellos[engine] = Hello.from_dict(hellos[self.rank])

    def _agent_of(self, pull: Pull, hello: Hello) -> tuple[str, SpanTable]:
        """The peer's agent (added once) and span table, after checking that its
        bytes mean what ours do; refused (``ChannelError``) naming both sides."""
        theirs = SpanTable.from_dict(hello.table)
        if hello.namespace != self.namespace:
            raise ChannelError(
                f"prefill engine {pull.engine_id} rank {self.rank} caches another namespace: "
                + namespace_diff(hello.namespace, self.namespace)
            )
        problems = self.table.mismatches(theirs)
        if problems:
            raise ChannelError(
                f"prefill engine {pull.engine_id} lays its cache out otherwise: "
                + "; ".join(problems)
            )
        name = self._agents.get(pull.engine_id)
        if name is None:
            added = self.agent.add_remote_agent(hello.agent)
            name = self._agents[pull.engine_id] = (
                added.decode() if isinstance(added, bytes) else added
            )
        return name, theirs

    def _post(self, p: _Pulling) -> None:
        pull = p.pull
        hello = self._hellos.get(pull.engine_id)
        if hello is None:
            raise ChannelError(
                f"no hello from prefill engine {pull.engine_id} for rank {self.rank}"
            )
        name, theirs = self._agent_of(pull, hello)
        parts = []
        for kind, local, remote in (
            ("kv", pull.kv_local, pull.kv_remote),
            (
                "state",
                pull.state_local and (pull.state_local,),
                pull.state_remote and (pull.state_remote,),
            ),
        ):
            if local:
                parts.append(pair(self.table, theirs, kind, np.array(local), np.array(remote)))
        mine = np.concatenate([a for a, _ in parts])
        peer = np.concatenate([b for _, b in parts])
        p.descriptors, p.nbytes = len(mine), int(mine[:, 1].sum())
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(mine, self.mem_type),
            self.agent.get_xfer_descs(peer, self.mem_type),
            name,
            NOTIF + pull.remote_request.encode(),
        )
        p.xfer = handle
        if self.agent.transfer(handle) == "ERR":
            raise ChannelError("NIXL refused to post the READ")

    def _fail(self, pull: Pull, why: str) -> None:
        self.failures += 1
        self._done.add(pull.request)
        self._failed.add(pull.request)
        self._errors |= pull.block_ids
        log.warning(
            "kvarena: request %s: reading its prefill from engine %s failed (%s); "
            "vLLM computes it here",
            pull.request,
            pull.engine_id,
            why,
        )

    def _release(self, p: _Pulling, why: str) -> bool:
        """Give a posted READ up; True once NIXL released it (no byte moves any more)."""
        try:
            self.agent.release_xfer_handle(p.xfer)
        except Exception:
            p.abandoned = why
            return False
        return True

    def _advance(self, p: _Pulling, now: float) -> bool:
        """One look at a pull; True once it is over (done or failed)."""
        if p.abandoned:
            if self._release(p, p.abandoned):
                self._fail(p.pull, p.abandoned)
                return True
            return False
        if p.xfer is None:
            if now > p.deadline:  # its lease may be over: a READ now could be late
                self._fail(p.pull, "its lease ended before its READ was posted")
                return True
            try:
                self._post(p)
            except Exception as exc:
                if p.xfer is not None and not self._release(p, str(exc)):
                    return False
                self._fail(p.pull, f"{type(exc).__name__}: {exc}")
                return True
            return False
        try:
            state = self.agent.check_xfer_state(p.xfer)
        except Exception as exc:
            state, why = "ERR", f"{type(exc).__name__}: {exc}"
        else:
            why = f"the READ ended in state {state}"
        if state == "PROC" and now <= p.deadline:
            return False
        if state == "DONE":
            self._release(p, "")
            self._done.add(p.pull.request)
            self.finished.append(
                PullDone(
                    request=p.pull.request,
                    descriptors=p.descriptors,
                    nbytes=p.nbytes,
                    seconds=time.perf_counter() - p.began,
                )
            )
            return True
        if state == "PROC":
            why = f"the READ passed its {self.timeout_s:g} s deadline"
        if self._release(p, why):
            self._fail(p.pull, why)
            return True
        return False

    # -- both -----------------------------------------------------------------------
    def progress(self) -> None:
        """Take the READ notifications (prefill side) and move every pull on."""
        with self._lock:
            got, self._inbox = self._inbox + self._take(), []
        for msg in got:
            if not msg.startswith(NOTIF):
                continue
            rid = msg[len(NOTIF) :].decode(errors="replace")
            if rid in self._offered:
                self._offered.discard(rid)
                self._sent.add(rid)
            else:
                self._early[rid] = None
                while len(self._early) > EARLY_KEPT:
                    self._early.popitem(last=False)
        if not self._offered:
            self._holding.clear()
        now = time.monotonic()
        self._pulling = [p for p in self._pulling if not self._advance(p, now)]

    def take(self) -> tuple[set[str], set[str], set[str], set[int]]:
        """Since the last call: offers done (read or expired), pulls over, pulls
        failed, and the blocks the failed ones were to write."""
        out = (self._sent, self._done, self._failed, self._errors)
        self._sent, self._done, self._failed, self._errors = set(), set(), set(), set()
        return out

    def close(self) -> None:
        self._stop.set()
        self._pump.join()
        for name in self._agents.values():
            try:
                self.agent.remove_remote_agent(name)
            except Exception:
                pass
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
