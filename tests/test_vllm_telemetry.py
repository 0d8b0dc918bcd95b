"""The engine's metrics, counted once whatever the tensor-parallel size: the
scheduler's book of its workers' parts (``telemetry``), the stats interval vLLM
merges (``KvarenaStats``) and the Prometheus families the scrape reads
(``KvarenaPromMetrics``), without an engine.

Runs in the ``.venv-vllm`` environment; skipped where vLLM is not installed.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvarena.integrations.vllm import telemetry as tele
from kvarena.integrations.vllm.metrics import (
    METRICS,
    KvarenaPromMetrics,
    KvarenaStats,
    merge,
)
from kvarena.integrations.vllm.records import Held, Timed, WorkerReport
from kvarena.integrations.vllm.telemetry import Telemetry


def test_a_load_over_two_ranks_is_one_load_its_bytes_summed_its_time_the_slowest():
    t = Telemetry(ranks=2)
    t.reported(
        WorkerReport(loads=[Timed(key="r", rank=0, seconds={"disk": 0.01}, nbytes={"disk": 100})])
    )
    got = t.take()
    assert got == {"load_bytes": {"disk": 100}}  # no time until every rank reported
    t.reported(
        WorkerReport(loads=[Timed(key="r", rank=1, seconds={"disk": 0.03}, nbytes={"disk": 100})])
    )
    assert t.take() == {"load_bytes": {"disk": 100}, "load_seconds": {"disk": [0.03]}}
    assert t.take() == {}


def test_an_object_is_saved_once_every_rank_saved_its_shard_skipped_once_any_skipped():
    t = Telemetry(ranks=2)
    t.reported(WorkerReport(saved=["kv-a", "kv-b"], skipped=["kv-c"]))
    assert t.take() == {"saves_skipped": 1}
    t.reported(WorkerReport(saved=["kv-a"], skipped=["kv-c"]))  # rank 1: a done, b not yet
    assert t.take() == {"objects_saved": 1}
    t.reported(WorkerReport(saved=["kv-b"]))
    assert t.take() == {"objects_saved": 1}


def test_a_failure_counts_once_under_its_worst_reason():
    t = Telemetry(ranks=2)
    parts = [
        Timed(key="r", rank=0, failures={"kv-a": "missing", "kv-b": "missing"}),
        Timed(key="r", rank=1, failures={"kv-a": "corrupt"}),
    ]
    t.reported(WorkerReport(loads=parts))
    assert t.take() == {"load_failures": {"corrupt": 1, "missing": 1}}


@pytest.mark.parametrize(
    ("first", "second", "counted"),
    [
        ("timeout", "timeout", "timeout"),  # every rank gave the load up
        ("missing", "timeout", "timeout"),
        ("timeout", "foreign", "foreign"),
        ("error", "missing", "error"),
        ("corrupt", "error", "corrupt"),
    ],
)
def test_every_reason_a_rank_gives_counts_once_across_ranks(first, second, counted):
    """A load given up past its deadline, or whose fetch raised, on two ranks
    (TP 2) is one failure under the worse reason: no reason a worker gives is
    unknown to the order (an unknown one raised in the scheduler)."""
    t = Telemetry(ranks=2)
    t.reported(WorkerReport(loads=[Timed(key="r", rank=0, failures={"kv-a": first})]))
    t.reported(WorkerReport(loads=[Timed(key="r", rank=1, failures={"kv-a": second})]))
    assert t.take() == {"load_failures": {counted: 1}}


def test_the_order_knows_every_reason_the_checks_give():
    from kvarena.tiers.checked import CORRUPT, failure_class

    reasons = {failure_class(None), failure_class("namespace"), *map(failure_class, CORRUPT)}
    assert reasons <= set(tele.FAILURE_ORDER)


def test_held_is_every_ranks_latest_summed_and_sent_when_it_changed():
    t = Telemetry(ranks=2)
    t.reported(WorkerReport(held=[Held(rank=0, label="host", nbytes=10, objects=1)]))
    t.reported(WorkerReport(held=[Held(rank=1, label="host", nbytes=30, objects=2)]))
    t.reported(WorkerReport(held=[Held(rank=0, label="host", nbytes=20, objects=2)]))
    assert t.take() == {"held_bytes": {"host": 50}, "held_objects": {"host": 4}}
    assert t.take() == {}


def test_a_rank_that_never_reports_does_not_grow_the_book(monkeypatch):
    monkeypatch.setattr(tele, "PENDING", 3)
    t = Telemetry(ranks=2)
    for i in range(5):
        t.reported(WorkerReport(writes=[Timed(key=f"w{i}", rank=0, seconds={"host": float(i)})]))
    # the two oldest, counted as they stood; three still awaited
    assert t.take()["save_seconds"] == {"host": [0.0, 1.0]}
    assert len(t._pending) == 3


def test_the_scheduler_counts_lookups_and_hits_by_tier():
    t = Telemetry(ranks=8)
    t.looked_up()
    t.looked_up()
    t.hit("disk", 64)
    t.hit("host", 32)
    assert t.take() == {"lookups": 2, "hit_tokens": {"disk": 64, "host": 32}}
    assert (t.lookups, t.hit_tokens, t.hit_tokens_by_tier) == (2, 96, {"disk": 64, "host": 32})


def test_an_interval_merges_counters_observations_and_the_latest_gauges():
    a = {
        "lookups": 1,
        "load_bytes": {"disk": 5},
        "load_seconds": {"disk": [0.1]},
        "held_bytes": {"host": 9},
    }
    b = {
        "lookups": 2,
        "load_bytes": {"disk": 1, "host": 2},
        "load_seconds": {"disk": [0.2]},
        "held_bytes": {"host": 4},
    }
    assert merge(a, b) == {
        "lookups": 3,
        "load_bytes": {"disk": 6, "host": 2},
        "load_seconds": {"disk": [0.1, 0.2]},
        "held_bytes": {"host": 4},
    }
    stats = KvarenaStats(data=a).aggregate(KvarenaStats(data=b))
    assert stats.reduce()["lookups"] == 3 and not stats.is_empty()
    stats.reset()
    assert stats.is_empty()


def test_the_prometheus_families_carry_vllms_labels_and_every_count():
    registry = CollectorRegistry()
    types = {k: functools.partial(k, registry=registry) for k in (Counter, Gauge, Histogram)}
    prom = KvarenaPromMetrics(
        type("VllmConfig", (), {"kv_transfer_config": None})(),  # what the base reads
        types,  # type: ignore[arg-type]
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    prom.observe(
        {
            "lookups": 3,
            "hit_tokens": {"disk": 64},
            "load_seconds": {"disk": [0.002, 0.3]},
            "load_failures": {"corrupt": 1},
            "held_objects": {"host": 7},
            "a_newer_key": 1,  # ignored, never a crash
        }
    )
    value = registry.get_sample_value
    labels = {"model_name": "tiny", "engine": "0"}
    assert value("vllm:kvarena_lookups_total", labels) == 3
    assert value("vllm:kvarena_hit_tokens_total", {**labels, "tier": "disk"}) == 64
    assert value("vllm:kvarena_load_seconds_count", {**labels, "tier": "disk"}) == 2
    assert (
        value("vllm:kvarena_load_seconds_bucket", {**labels, "tier": "disk", "le": "0.0025"}) == 1
    )
    assert value("vllm:kvarena_load_failures_total", {**labels, "reason": "corrupt"}) == 1
    assert value("vllm:kvarena_held_objects", {**labels, "tier": "host"}) == 7
    # every metric of the one list registered, and nothing else
    assert {f.name for f in registry.collect()} == {m.name.removesuffix("_total") for m in METRICS}


def test_the_docs_metrics_table_is_the_list():
    """The operator's table (docs/guides/operating.md) says what METRICS registers."""
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "guides" / "operating.md"
    rows = [line for line in page.read_text().split("\n") if line.startswith("| `vllm:kvarena_")]
    table = [tuple(c.strip().strip("`") for c in row.strip("|").split("|")) for row in rows]
    assert table == [(m.name, m.type, m.label or "", m.help) for m in METRICS]
