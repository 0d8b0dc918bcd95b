"""The same trace under several policies, and the bound no cache can pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..errors import InvalidValueError
from ..models import ModelCache
from ..prefix import CheckpointPolicy
from ..prefix.keys import block_keys
from .run import ReplayConfig, ReplayResult, replay
from .trace import TraceRequest


def infinite_bound(trace: Sequence[TraceRequest], block_size: int) -> ReplayResult:
    """Hit tokens with an infinite cache: every earlier full prompt block is kept."""
    root = b"\x00" * 16
    seen: set[bytes] = set()
    r = ReplayResult(label="infinite cache")
    hits = 0
    for req in trace:
        keys = block_keys(root, req.tokens, block_size)
        limit = min(len(keys), (req.tokens.size - 1) // block_size)
        h = 0
        while h < limit and keys[h] in seen:
            h += 1
        seen.update(keys)
        r.requests += 1
        r.admitted += 1
        r.prompt_tokens += req.tokens.size
        r.requests_with_hit += bool(h)
        hits += h * block_size
    r.metrics = {"hit_tokens": hits, "computed_tokens": r.prompt_tokens - hits}
    return r


@dataclass(frozen=True, kw_only=True)
class PolicyRun:
    """One policy of a comparison: the model it replays and the configuration."""

    label: str
    model: ModelCache
    cfg: ReplayConfig


def policy_runs(
    model: ModelCache, cfg: ReplayConfig, *, vllm_model: ModelCache | None = None
) -> list[PolicyRun]:
    """The policies :func:`compare` (and a sweep) replays, in order.

    kvarena's policy; vLLM's align policy (only the last block boundary before
    each prompt end keeps a state, at vLLM's unified block size when
    ``vllm_model`` is given); no state reuse (hybrid prefix caching off); the
    same model's KV with no state at all (what a pure-attention model of the
    same KV size would hit). The ones a model has no use for (no state, no
    KV) are left out.
    """
    if cfg.tiers:
        raise InvalidValueError(
            "compare runs several policies over one trace; with tiers they would share (and "
            "warm) the same disk and store. Replay with --tier without --compare"
        )
    runs = [PolicyRun(label=f"kvarena ({cfg.policy.describe()})", model=model, cfg=cfg)]
    if model.state_fields and model.page_fields:
        align = replace(cfg, policy=CheckpointPolicy(end=True, branch=False, learn=False))
        vm = vllm_model or model
        runs.append(
            PolicyRun(label=f"vLLM align ({vm.block_size}-token blocks)", model=vm, cfg=align)
        )
        runs.append(PolicyRun(label="no state reuse", model=model, cfg=replace(cfg, reuse=False)))
    if model.page_fields:
        kv_only = ModelCache.from_fields(
            model.page_fields, [], block_size=model.block_size, name=f"{model.name} (KV only)"
        )
        runs.append(PolicyRun(label="KV only (no state)", model=kv_only, cfg=cfg))
    return runs


def compare(
    model: ModelCache,
    trace: Sequence[TraceRequest],
    cfg: ReplayConfig,
    *,
    vllm_model: ModelCache | None = None,
) -> list[ReplayResult]:
    """The same trace and budget under every policy of :func:`policy_runs`, side
    by side, and the infinite-cache bound last."""
    rows = [
        replay(r.model, trace, r.cfg, label=r.label)
        for r in policy_runs(model, cfg, vllm_model=vllm_model)
    ]
    rows.append(infinite_bound(trace, model.block_size))
    return rows
