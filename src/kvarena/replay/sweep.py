"""``replay --sweep``: hit tokens against the budget, one real replay per point.

Every point is a whole replay of the trace at one budget under one policy of
:func:`~.policies.policy_runs`, in bookkeeping mode (a ``meta``-device cache:
real allocators, keys, lookups, evictions and boundary moves, no bytes), so
a sweep up to hundreds of GiB costs what the bookkeeping costs. Points are
independent and deterministic, so they run in parallel processes where cores
allow and each equals the replay :func:`~.run.replay` gives alone.

The trace reaches each worker process once (through the pool's initializer,
kept in that process for its jobs), not once per point: an expanded Mooncake
trace is hundreds of MB of token ids.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any

from ..checks import parse_bytes
from ..errors import InvalidValueError
from ..models import ModelCache
from ..pools import plan_cache
from .policies import PolicyRun, infinite_bound, policy_runs
from .run import ReplayConfig, ReplayResult, replay
from .trace import TraceRequest

MAX_POINTS = 64
"""Budgets in one sweep beyond this are refused (a curve, not a scan)."""


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """One replay of the sweep: a policy at a budget, and its share of the bound."""

    budget_bytes: int
    policy: str
    result: ReplayResult
    bound_tokens: int  # the infinite cache's hit tokens on the same trace

    @property
    def hit_tokens(self) -> int:
        return self.result.hit_tokens

    @property
    def share_of_bound(self) -> float:
        return self.hit_tokens / self.bound_tokens if self.bound_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = self.result.to_dict()
        d.pop("timeline", None)
        return {
            "budget_bytes": self.budget_bytes,
            "policy": self.policy,
            "hit_tokens": self.hit_tokens,
            "share_of_bound": self.share_of_bound,
            "result": d,
        }


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """Every point of a sweep, by budget then policy, and the bound they are measured against."""

    budgets: tuple[int, ...]
    policies: tuple[str, ...]
    points: tuple[SweepPoint, ...]
    bound: ReplayResult

    def curve(self, policy: str) -> list[SweepPoint]:
        return [p for p in self.points if p.policy == policy]

    def to_dict(self) -> dict[str, Any]:
        return {
            "budgets": list(self.budgets),
            "policies": list(self.policies),
            "bound_hit_tokens": self.bound.hit_tokens,
            "prompt_tokens": self.bound.prompt_tokens,
            "points": [p.to_dict() for p in self.points],
        }


def parse_budgets(text: object) -> tuple[int, ...]:
    """``"4GiB,8GiB,16GiB"`` as byte counts: at least one, strictly increasing."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidValueError(f"--sweep: expected budgets like 4GiB,8GiB,16GiB, got {text!r}")
    parts = [p.strip() for p in text.split(",")]
    if any(not p for p in parts):
        raise InvalidValueError(f"--sweep: an empty budget in {text!r}")
    if len(parts) > MAX_POINTS:
        raise InvalidValueError(f"--sweep: {len(parts)} budgets; at most {MAX_POINTS}")
    budgets = tuple(parse_bytes(p) for p in parts)
    for a, b, pa, pb in zip(budgets, budgets[1:], parts, parts[1:], strict=False):
        if b <= a:
            raise InvalidValueError(
                f"--sweep: budgets must be strictly increasing; {pb} does not exceed {pa}"
            )
    return budgets


def plan_sweep(
    model: ModelCache,
    cfg: ReplayConfig,
    budgets: Sequence[int],
    *,
    compare: bool,
    vllm_model: ModelCache | None,
) -> list[tuple[int, PolicyRun]]:
    """Every (budget, policy) of the sweep, each planned once here so that a
    budget that fits no request is refused before any replay starts."""
    if cfg.verify or cfg.tiers:
        raise InvalidValueError(
            "a sweep replays in bookkeeping mode, one cache per point: --verify and --tier "
            "are for a single replay"
        )
    jobs = []
    for budget in budgets:
        at = replace(cfg, budget_bytes=budget, timeline=False)
        runs = (
            policy_runs(model, at, vllm_model=vllm_model)
            if compare
            else [PolicyRun(label=f"kvarena ({at.policy.describe()})", model=model, cfg=at)]
        )
        for run in runs:
            plan_cache(run.model, budget_bytes=budget, max_seqs=run.cfg.max_seqs)
            jobs.append((budget, run))
    return jobs


_worker_trace: list[Sequence[TraceRequest]] = []  # a worker process's copy of the trace


def _take_trace(trace: Sequence[TraceRequest]) -> None:
    _worker_trace[:] = [trace]


class SweepError(InvalidValueError):
    """A point of a sweep failed in its worker; the message names the point."""


def _replay_in_worker(run: PolicyRun) -> ReplayResult:
    # What reaches the parent is pickled: an exception is sent as one line
    # naming its point, since not every exception type survives the trip.
    try:
        return replay(run.model, _worker_trace[0], run.cfg, label=run.label)
    except Exception as exc:
        raise SweepError(
            f"sweep: {run.label} at {run.cfg.budget_bytes:,} B failed: {type(exc).__name__}: {exc}"
        ) from None


def default_workers() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def sweep(
    model: ModelCache,
    trace: Sequence[TraceRequest],
    cfg: ReplayConfig,
    budgets: Sequence[int],
    *,
    compare: bool = False,
    vllm_model: ModelCache | None = None,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Sweep:
    """Replay ``trace`` at every budget (kvarena's policy, or every policy of
    :func:`~.policies.policy_runs` with ``compare``), ``workers`` at a time.

    ``progress(done, total)`` is called as points complete. Every budget is
    planned before the first replay, so a budget that fits no request is
    refused with nothing run.
    """
    if not isinstance(model, ModelCache):
        raise InvalidValueError(f"sweep: model must be a ModelCache, got {type(model).__name__}")
    if not budgets:
        raise InvalidValueError("sweep: no budgets")
    budgets = tuple(budgets)
    jobs = plan_sweep(model, cfg, budgets, compare=compare, vllm_model=vllm_model)
    n = min(len(jobs), default_workers() if workers is None else max(1, int(workers)))
    results: dict[int, ReplayResult] = {}
    if n == 1:
        for i, (_, run) in enumerate(jobs):
            results[i] = replay(run.model, trace, run.cfg, label=run.label)
            if progress:
                progress(len(results), len(jobs))
    else:
        # spawn, not fork: a forked child of a process that has used torch's
        # thread pool can deadlock in its first parallel region.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            max_workers=n, mp_context=ctx, initializer=_take_trace, initargs=(trace,)
        ) as pool:
            futures = {pool.submit(_replay_in_worker, run): i for i, (_, run) in enumerate(jobs)}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if progress:
                    progress(len(results), len(jobs))
    bound = infinite_bound(trace, model.block_size)
    points = tuple(
        SweepPoint(
            budget_bytes=budget, policy=run.label, result=results[i], bound_tokens=bound.hit_tokens
        )
        for i, (budget, run) in enumerate(jobs)
    )
    policies = tuple(dict.fromkeys(p.policy for p in points))
    return Sweep(budgets=budgets, policies=policies, points=points, bound=bound)
