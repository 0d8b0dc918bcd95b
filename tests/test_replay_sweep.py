"""A sweep's points are real replays: each equals the replay at that budget alone."""

import pytest
from test_replay import SMALL, synthetic_lines

import kvarena as kv
from kvarena.replay import ReplayConfig, infinite_bound, parse_trace, replay
from kvarena.replay.policies import policy_runs
from kvarena.replay.sweep import parse_budgets, plan_sweep, sweep

TIMING = ("wall_seconds", "admission_us")


def _same(a, b):
    da, db = a.to_dict(), b.to_dict()
    for k in TIMING:
        da.pop(k), db.pop(k)
    assert da == db


@pytest.fixture(scope="module")
def trace():
    return parse_trace(synthetic_lines(3, conversations=25))


BUDGETS = (1 << 20, 3 << 19, 2 << 20, 4 << 20)


@pytest.mark.parametrize("workers", [1, 2])
def test_points_equal_separate_replays(trace, workers):
    cfg = ReplayConfig(budget_bytes=1, max_seqs=4, decode_tokens_per_s=200.0)
    seen = []
    sw = sweep(
        SMALL,
        trace,
        cfg,
        BUDGETS,
        compare=True,
        workers=workers,
        progress=lambda done, total: seen.append((done, total)),
    )
    runs = policy_runs(SMALL, cfg)
    assert sw.policies == tuple(r.label for r in runs)
    assert len(sw.points) == len(BUDGETS) * len(runs)
    assert seen[-1] == (len(sw.points), len(sw.points)) and len(seen) == len(sw.points)
    bound = infinite_bound(trace, SMALL.block_size)
    for p in sw.points:
        (run,) = [
            r
            for r in policy_runs(
                SMALL,
                ReplayConfig(budget_bytes=p.budget_bytes, max_seqs=4, decode_tokens_per_s=200.0),
            )
            if r.label == p.policy
        ]
        _same(p.result, replay(run.model, trace, run.cfg, label=run.label))
        assert p.bound_tokens == bound.hit_tokens
        assert p.share_of_bound == p.hit_tokens / bound.hit_tokens
    for policy in sw.policies:
        assert [p.budget_bytes for p in sw.curve(policy)] == list(BUDGETS)
    assert min(p.hit_tokens for p in sw.points if p.policy != "no state reuse") > 0
    doc = sw.to_dict()
    assert doc["bound_hit_tokens"] == bound.hit_tokens and len(doc["points"]) == len(sw.points)
    assert all("timeline" not in pt["result"] for pt in doc["points"])


def test_kvarena_policy_alone_without_compare(trace):
    cfg = ReplayConfig(budget_bytes=1, max_seqs=4)
    sw = sweep(SMALL, trace, cfg, BUDGETS[:2], workers=1)
    assert len(sw.policies) == 1 and sw.policies[0].startswith("kvarena (")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "expected budgets"),
        ("4GiB,,8GiB", "an empty budget"),
        ("8GiB,4GiB", "strictly increasing; 4GiB does not exceed 8GiB"),
        ("4GiB,4GiB", "strictly increasing"),
        ("4GiB,lots", "'lots' is not a size"),
        (",".join(["1GiB"] * 65), "at most 64"),
    ],
)
def test_bad_budget_lists_are_refused(text, words):
    with pytest.raises(kv.InvalidValueError, match=words):
        parse_budgets(text)


def test_budgets_parse_in_order():
    assert parse_budgets("4GiB, 8GiB,16GiB") == (4 << 30, 8 << 30, 16 << 30)


def test_a_budget_that_fits_no_request_is_refused_before_any_replay():
    cfg = ReplayConfig(budget_bytes=1, max_seqs=4)
    with pytest.raises(kv.PoolBudgetError):
        plan_sweep(SMALL, cfg, (1 << 10, 1 << 20), compare=True, vllm_model=None)
    for bad in ({"verify": True}, {"tiers": ("host:1MiB",)}):
        with pytest.raises(kv.InvalidValueError, match="bookkeeping mode"):
            plan_sweep(
                SMALL,
                ReplayConfig(budget_bytes=1, max_seqs=4, **bad),
                (1 << 20,),
                compare=False,
                vllm_model=None,
            )
