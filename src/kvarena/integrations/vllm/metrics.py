"""The connector's metrics on vLLM's ``/metrics``, as ``vllm:kvarena_*``.

vLLM asks a connector for its stats every step (``get_kv_connector_stats``),
ships them to its stats loggers and hands them to the connector's own
Prometheus metrics (``build_prom_metrics``), which carry vLLM's labels
(``model_name``, ``engine``) beside the connector's own (``tier``,
``reason``). The counts are the scheduler's (:mod:`.telemetry`): once per
engine, whatever its tensor-parallel size.

:data:`METRICS` is the one list: it registers the metrics, merges a stats
interval, and is the table in the docs (a test holds them equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""From a host-tier read of one block (well under a millisecond) to a slow
shared store's whole prefix (seconds)."""


@dataclass(frozen=True, kw_only=True)
class Metric:
    """One metric: its key in the stats data, its Prometheus name and type,
    its own label (beyond vLLM's), and what it counts."""

    key: str
    name: str
    type: str  # counter, histogram or gauge
    label: str | None
    help: str


METRICS = (
    Metric(
        key="lookups",
        name="vllm:kvarena_lookups_total",
        type="counter",
        label=None,
        help=(
            "Requests whose prompt the connector looked up in its tiers"
            " (once each, however often vLLM asks while it waits)"
        ),
    ),
    Metric(
        key="hit_tokens",
        name="vllm:kvarena_hit_tokens_total",
        type="counter",
        label="tier",
        help="Prompt tokens loaded from the tiers instead of computed, by the deepest tier a load reads",
    ),
    Metric(
        key="load_bytes",
        name="vllm:kvarena_load_bytes_total",
        type="counter",
        label="tier",
        help="Stored bytes loads read from each tier, all ranks",
    ),
    Metric(
        key="save_bytes",
        name="vllm:kvarena_save_bytes_total",
        type="counter",
        label="tier",
        help="Stored bytes saves wrote to each tier, all ranks",
    ),
    Metric(
        key="load_seconds",
        name="vllm:kvarena_load_seconds",
        type="histogram",
        label="tier",
        help="Seconds one load spent on a tier (reads and checks), its slowest rank",
    ),
    Metric(
        key="save_seconds",
        name="vllm:kvarena_save_seconds",
        type="histogram",
        label="tier",
        help="Seconds one step's saves took to write to a tier, its slowest rank",
    ),
    Metric(
        key="load_failures",
        name="vllm:kvarena_load_failures_total",
        type="counter",
        label="reason",
        help=(
            "Objects a load could not use (missing, corrupt, foreign, timeout, error); "
            "vLLM recomputes their tokens"
        ),
    ),
    Metric(
        key="objects_saved",
        name="vllm:kvarena_objects_saved_total",
        type="counter",
        label=None,
        help="Objects (KV blocks and states) saved to every tier by every rank",
    ),
    Metric(
        key="saves_skipped",
        name="vllm:kvarena_saves_skipped_total",
        type="counter",
        label=None,
        help="Objects not saved because the writer's backlog was full (save_backlog)",
    ),
    Metric(
        key="held_bytes",
        name="vllm:kvarena_held_bytes",
        type="gauge",
        label="tier",
        help="Bytes the engine's local tiers (host, disk) hold now, all ranks",
    ),
    Metric(
        key="held_objects",
        name="vllm:kvarena_held_objects",
        type="gauge",
        label="tier",
        help="Objects the engine's local tiers (host, disk) hold now, all ranks",
    ),
)
BY_KEY = {m.key: m for m in METRICS}


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two intervals' stats as one: counters add, histogram observations join,
    gauges take the later value."""
    out = dict(a)
    for key, value in b.items():
        m = BY_KEY.get(key)
        if m is None or key not in out or m.type == "gauge":
            out[key] = value
        elif m.label is None:
            out[key] = out[key] + value
        else:
            book = dict(out[key])
            for label, v in value.items():
                book[label] = book[label] + v if label in book else v
            out[key] = book
    return out


class KvarenaStats(KVConnectorStats):
    """One interval's counts (``data``: :meth:`.telemetry.Telemetry.take`)."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return KvarenaStats(data=merge(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        """The interval in one line of vLLM's log."""
        d = self.data

        def total(key: str) -> int:
            v = d.get(key, 0)
            return int(sum(v.values())) if isinstance(v, dict) else int(v)

        return {
            "lookups": total("lookups"),
            "hit_tokens": total("hit_tokens"),
            "loaded_MB": round(total("load_bytes") / 1e6, 3),
            "saved_MB": round(total("save_bytes") / 1e6, 3),
            "objects_saved": total("objects_saved"),
            "load_failures": total("load_failures"),
            "saves_skipped": total("saves_skipped"),
        }

    def is_empty(self) -> bool:
        return not self.data


class KvarenaPromMetrics(KVConnectorPromMetrics):
    """The metrics of :data:`METRICS`, registered once per server, one child per
    engine and label value."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for m in METRICS:
            names = self._labelnames + ([m.label] if m.label else [])
            if m.type == "counter":
                family = self._counter_cls(name=m.name, documentation=m.help, labelnames=names)
            elif m.type == "histogram":
                family = self._histogram_cls(
                    name=m.name, documentation=m.help, labelnames=names, buckets=SECONDS_BUCKETS
                )
            else:
                family = self._gauge_cls(
                    name=m.name,
                    documentation=m.help,
                    labelnames=names,
                    multiprocess_mode="mostrecent",
                )
            self._families[m.key] = family
        self._children: dict[tuple[int, str, str | None], Any] = {}

    def _child(self, engine: int, m: Metric, label: str | None) -> Any:
        key = (engine, m.key, label)
        child = self._children.get(key)
        if child is None:
            values = list(self.per_engine_labelvalues[engine]) + ([label] if label else [])
            child = self._children[key] = self._families[m.key].labels(*values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            m = BY_KEY.get(key)
            if m is None:
                continue  # a key a newer kvarena added: no metric here to put it on
            items = value.items() if m.label else [(None, value)]
            for label, v in items:
                child = self._child(engine_idx, m, label)
                if m.type == "counter":
                    child.inc(v)
                elif m.type == "histogram":
                    for seconds in v:
                        child.observe(seconds)
                else:
                    child.set(v)
