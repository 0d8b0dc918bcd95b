"""A fleet: one trace over N engines, each with its own device cache and tiers,
over a store shared by all of them or none.

A shared tier is bought for a fleet, and what it buys depends on how many
engines share it and how requests reach them: with one engine a host tier
holds what the store would; spread over many engines by a plain balancer, a
conversation's turns land on engines that never saw its earlier turns, and
only a store below all of them (or a router that sends each turn back where
its prefix lives) turns that into hits. This replays the same trace under
each arrangement so the difference is measured before a fleet is bought.

Routers:

- ``round-robin``: the i-th request to engine ``i mod N`` (a plain balancer).
- ``prefix``: to the engine whose device holds the longest prefix of the
  request, in blocks (what a router reading every engine's KV events knows:
  vLLM publishes each device block stored and removed); ties to the engine
  with the fewest requests running or waiting, then the lowest number.

Every engine runs the single replay's time model (:mod:`.run`) on its own
device cache and its own tiers (``ReplayConfig.tiers``: a host tier each),
all in one clock. The store's tiers are opened once and placed below every
engine's own, so what one engine writes down another hits. A fleet's run
ends without draining: the store holds what serving wrote, no more.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..checks import check_count
from ..errors import InvalidValueError
from ..models import ModelCache
from ..pools import plan_cache
from ..tiers import TierStack
from ..tiers.redact import redacted
from ..tiers.spec import TierSpec
from .host_memory import check_host_memory
from .run import EngineRun, ReplayConfig, ReplayResult, frame_bytes
from .trace import TraceRequest

ROUTERS = ("round-robin", "prefix")
MAX_ENGINES = 1024


def arrangement(router: str, shared: bool) -> str:
    """A fleet's name in rows and pictures: its router, and whether a store is shared."""
    return f"{router}{' + shared' if shared else ''}"


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    """How many engines, how requests reach them, and the store below them
    (tier specs; empty: none)."""

    engines: int
    router: str = "round-robin"
    shared: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_count(self.engines, "engines", lo=1, hi=MAX_ENGINES)
        if self.router not in ROUTERS:
            raise InvalidValueError(
                f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}"
            )
        if isinstance(self.shared, str) or not all(isinstance(s, str) for s in self.shared):
            raise InvalidValueError(f"shared must be a tuple of tier specs, got {self.shared!r}")

    @property
    def arrangement(self) -> str:
        return arrangement(self.router, bool(self.shared))


@dataclass(kw_only=True)
class FleetResult:
    engines: int
    router: str
    shared: str  # the store's specs, "" where none
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_by_source: dict[str, int] = field(default_factory=dict)  # device, own tiers, shared
    shared_objects: int = 0  # what the store holds at the end
    shared_bytes: int = 0
    shared_put_bytes: int = 0  # written to the store by all engines
    shared_get_bytes: int = 0  # read from it
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    per_engine: list[ReplayResult] = field(default_factory=list)

    @property
    def arrangement(self) -> str:
        return arrangement(self.router, bool(self.shared))

    @property
    def hit_fraction(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_engine"] = [r.to_dict() for r in self.per_engine]
        d["arrangement"] = self.arrangement
        d["hit_fraction"] = self.hit_fraction
        return d


def _pick(fleet: FleetConfig, engines: list[EngineRun], index: int, req: TraceRequest) -> int:
    if fleet.router == "round-robin":
        return index % len(engines)
    keys = engines[0].pc.keys(req.tokens)  # one namespace: every engine's keys are these
    held = [e.pc.held(keys) for e in engines]
    return min(range(len(engines)), key=lambda i: (-held[i], engines[i].busy, i))


def replay_fleet(
    model: ModelCache, trace: Sequence[TraceRequest], cfg: ReplayConfig, fleet: FleetConfig
) -> FleetResult:
    """Replay ``trace`` over ``fleet.engines`` engines, each planned for ``model``
    in ``cfg.budget_bytes`` with ``cfg.tiers`` of its own, over ``fleet.shared``."""
    if not isinstance(model, ModelCache):
        raise InvalidValueError(f"replay: model must be a ModelCache, got {type(model).__name__}")
    if not isinstance(fleet, FleetConfig):
        raise InvalidValueError(f"replay: fleet must be a FleetConfig, got {fleet!r}")
    check_host_memory(cfg.budget_bytes, verify=cfg.verify, engines=fleet.engines)
    plan = plan_cache(model, budget_bytes=cfg.budget_bytes, max_seqs=cfg.max_seqs)
    store = TierStack.from_specs(fleet.shared, frame_bytes=frame_bytes(plan))
    engines: list[EngineRun] = []
    try:
        for i in range(fleet.engines):
            engines.append(EngineRun(model, trace, cfg, f"engine {i}", None, below=store.tiers))
        return _run(fleet, trace, engines, store)
    finally:
        for e in engines:
            e.close()
        store.close()


def _run(
    fleet: FleetConfig, trace: Sequence[TraceRequest], engines: list[EngineRun], store: TierStack
) -> FleetResult:
    wall = time.perf_counter()
    arrivals = deque(range(len(trace)))
    now = 0.0
    while arrivals or any(e.events or e.queue for e in engines):
        next_arrival = trace[arrivals[0]].arrival_ms / 1000 if arrivals else float("inf")
        first = min(engines, key=lambda e: e.next_event)
        if first.events and first.next_event <= next_arrival:
            now = first.advance()
        elif arrivals:
            now = next_arrival
            index = arrivals.popleft()
            engines[_pick(fleet, engines, index, trace[index])].arrive(index, now)
        else:  # queued requests with nothing running anywhere: drop what never fits
            for e in engines:
                e.settle(now)
    wall_s = time.perf_counter() - wall
    out = FleetResult(engines=fleet.engines, router=fleet.router, shared=" ".join(fleet.shared))
    own = len(engines[0].tiers) - len(store)
    for e in engines:
        r = e.summed(now, wall_s, drain=False)
        out.per_engine.append(r)
        out.requests += r.requests
        out.prompt_tokens += r.prompt_tokens
        out.hit_tokens += r.hit_tokens
        by = out.hit_by_source
        tiers = r.metrics.get("tier_hit_tokens", {})
        for j, label in enumerate(e.tiers.labels):
            source = label if j < own else "shared"
            by[source] = by.get(source, 0) + tiers.get(label, 0)
        by["device"] = by.get("device", 0) + r.hit_tokens - sum(tiers.values())
    out.shared_objects = sum(len(t) for t in store.tiers)
    out.shared_bytes = sum(t.used_bytes for t in store.tiers)
    out.shared_put_bytes = sum(t.metrics.put_bytes for t in store.tiers)
    out.shared_get_bytes = sum(t.metrics.get_bytes for t in store.tiers)
    out.sim_seconds, out.wall_seconds = now, wall_s
    return out


def point_store(shared: Sequence[str], engines: int, router: str) -> tuple[str, ...]:
    """The store of one point of a sweep, empty as every point's must be: a
    disk tier in a directory of its own under the one given, a host tier
    fresh anyway; a server's store (Redis) cannot be emptied for one point
    without touching what else it holds, so it is refused in a sweep."""
    out = []
    for text in shared:
        spec = TierSpec.parse(text)
        if spec.kind == "disk":
            spec = TierSpec(
                kind="disk", size=spec.size, directory=f"{spec.directory}/{router}-{engines}"
            )
        elif spec.kind != "host":
            raise InvalidValueError(
                f"a sweep over engine counts needs an empty store at each point; {redacted(text)!r} "
                "cannot be emptied for one: give host:SIZE or disk:DIR:SIZE"
            )
        out.append(str(spec))
    return tuple(out)


def parse_counts(text: object) -> tuple[int, ...]:
    """``--engines``: one engine count, or a comma list of them, ascending."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidValueError(f"engines must be a count or a comma list of counts, got {text!r}")
    counts = []
    for part in text.split(","):
        try:
            n = int(part.strip())
        except ValueError:
            raise InvalidValueError(f"engines: {part.strip()!r} is not a count") from None
        counts.append(check_count(n, "engines", lo=1, hi=MAX_ENGINES))
    if counts != sorted(set(counts)):
        raise InvalidValueError(f"engines: give distinct counts in ascending order, got {text!r}")
    return tuple(counts)


def parse_routers(text: object) -> tuple[str, ...]:
    """``--router``: one router, or a comma list of them."""
    if not isinstance(text, str):
        raise InvalidValueError(f"router must be a string, got {text!r}")
    routers = tuple(r.strip() for r in text.split(","))
    for r in routers:
        if r not in ROUTERS:
            raise InvalidValueError(f"router must be one of {', '.join(ROUTERS)}, got {r!r}")
    if len(set(routers)) != len(routers):
        raise InvalidValueError(f"router: {text!r} names a router twice")
    return routers


def fleet_points(
    counts: Sequence[int], routers: Sequence[str], shared: Sequence[str] = ()
) -> list[FleetConfig]:
    """The fleets to replay: one engine count and one router make one fleet, over
    the store as given (warm where it holds objects); more make a sweep, each
    router alone and over the store (where one is given) at every count,
    each point over an empty store of its own."""
    if not counts or not routers:
        raise InvalidValueError("a fleet needs an engine count and a router")
    if len(counts) == 1 and len(routers) == 1:
        return [FleetConfig(engines=counts[0], router=routers[0], shared=tuple(shared))]
    stores = [(), tuple(shared)] if shared else [()]
    return [
        FleetConfig(engines=n, router=r, shared=point_store(s, n, r) if s else ())
        for r in routers
        for s in stores
        for n in counts
    ]
