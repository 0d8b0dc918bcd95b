"""What the scheduler's half tells the workers each step, and what they answer.

A step's plan lists loads (a hit's KV blocks and its state image, into the
block ids vLLM allocated) and saves (blocks this step fills, states at the
boundary this step reaches, read from the exact blocks vLLM names). Every
entry carries its key, so a worker never hashes tokens; block ids are per
group, in the order of the connector's KV groups and state groups.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True, kw_only=True)
class BlockCopy:
    """One object's blocks: a KV image (``index``: the block's position in the
    prompt; a partial block's ``tokens``: how many tokens it holds, from its first)
    or a state image (``index``: the boundary, in blocks)."""

    index: int
    key: bytes
    blocks: tuple[int, ...]  # one block id per group of the object's kind
    level: int | None = None  # the stack level the scheduler found it in (loads only)
    tokens: int | None = None  # a partial KV block: how many tokens it holds


@dataclass(frozen=True, kw_only=True)
class Load:
    """A hit's objects, into the blocks vLLM allocated for them. ``in_step``: vLLM
    schedules the request in the step that loads it (its synchronous path), so
    the load lands before that step's forward, from the host tier alone, and a
    failure is reported by its blocks; otherwise the request waits until the
    load is reported done (or failed)."""

    request: str
    kv: tuple[BlockCopy, ...]
    state: BlockCopy | None
    in_step: bool = False
    joined: bool = False  # a read of the prefill engine brings the rest (:mod:`.joins`)

    @property
    def block_ids(self) -> set[int]:
        """Every block this load writes (what vLLM recomputes if it fails)."""
        ids = {b for c in self.kv for b in c.blocks}
        if self.state is not None:
            ids.update(self.state.blocks)
        return ids


@dataclass(frozen=True, kw_only=True)
class Pull:
    """A decode engine's read of a prefill engine's blocks (disaggregation):
    KV objects (one block id per KV group, here and there, by position) and
    the state at the prefill's end (one per state group), from the engine at
    ``host``:``port`` that holds ``remote_request``. ``refused``: why it cannot
    be read (set: the worker fails it at once, vLLM recomputes it)."""

    request: str
    engine_id: str
    remote_request: str
    host: str
    port: int
    kv_local: tuple[tuple[int, ...], ...] = ()
    kv_remote: tuple[tuple[int, ...], ...] = ()
    state_local: tuple[int, ...] = ()
    state_remote: tuple[int, ...] = ()
    refused: str = ""
    lease_end: float = 0.0  # time.monotonic() (the machine's clock) past which it is given up

    @property
    def block_ids(self) -> set[int]:
        """Every block this pull writes (what vLLM recomputes if it fails)."""
        return {b for ids in self.kv_local for b in ids} | set(self.state_local)


@dataclass(kw_only=True)
class StepPlan(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    kv_saves: list[BlockCopy] = field(default_factory=list)
    state_saves: list[BlockCopy] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)  # reads from prefill engines
    offers: list[str] = field(default_factory=list)  # requests held for a decode engine
    expired: list[str] = field(default_factory=list)  # offers no longer held: free them
    peers: dict[str, dict[int, Any]] = field(default_factory=dict)  # new prefill engines' hellos
    # the most bytes of fetched asynchronous loads a worker copies in this step
    # (the first always lands; None: no bound): :mod:`.pace`
    land_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class HelloMeta(KVConnectorHandshakeMetadata):
    """A worker's :class:`~.pd_channel.Hello`, as data, on its way to the scheduler."""

    hello: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Timed:
    """One rank's part of one load (``key``: the request) or of one write of a
    step's saves (``key``: its first prefix object's name): seconds and stored
    bytes by tier label, and for a load the prefix objects it could not use,
    each with why (``missing``, ``corrupt``, ``foreign``: what the checks
    found; ``timeout``: the load passed its deadline; ``error``: its fetch
    raised; :data:`~.telemetry.FAILURE_ORDER`)."""

    key: str
    rank: int
    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Held:
    """What one rank's tier holds now (tiers that know it locally: host, disk)."""

    rank: int
    label: str
    nbytes: int
    objects: int


@dataclass(kw_only=True)
class WorkerReport(KVConnectorWorkerMetadata):
    """A worker's news for the scheduler since its last report: host-tier names
    it put and dropped (this rank's objects, as its host tier names them), and
    the prefix objects it saved and those a load could not use (missing
    everywhere, or failing its checks: then dropped from its tier), by the
    prefix object's name whichever rank's shard it was.
    The scheduler's lookups skip a failed name until it is saved again, so a
    recomputed request is not sent back to the same bad object.

    For the engine's metrics, counted once in the scheduler whatever the
    number of ranks (:mod:`.telemetry`): each load's and each write's part
    (``loads``, ``writes``), the prefix objects whose save the backlog skipped
    (``skipped``), and what the rank's local tiers hold (``held``). For KV
    events and the scheduler's book of the tiers below the host, what this
    rank wrote through (``written``: its own names) and what those tiers
    evicted or dropped (``dropped``), and what a tier did not store
    (``refused``: its tier's label, this rank's name, the prefix object's
    name), which no book may count as held. For the pace of landing loads, the bytes
    and seconds of each fetched load's copy into vLLM's tensors (``landed``)."""

    host_added: list[str] = field(default_factory=list)
    host_dropped: list[str] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    loads: list[Timed] = field(default_factory=list)
    writes: list[Timed] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (tier label, name), not host
    written: list[str] = field(default_factory=list)  # written through, below the host too
    refused: list[tuple[str, str, str]] = field(default_factory=list)  # (label, name, prefix)
    landed: list[tuple[int, float]] = field(default_factory=list)  # async loads' copy-ins: (B, s)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WorkerReport)
        return WorkerReport(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


class News:
    """A worker's news since its last report, gathered from its step and from its
    writer thread (thread-safe): lists accumulate, ``held`` is the latest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._report = WorkerReport()

    def add(self, **parts: list[Any]) -> None:
        with self._lock:
            for name, items in parts.items():
                if name == "held":
                    self._report.held = list(items)
                else:
                    getattr(self._report, name).extend(items)

    def take(self) -> WorkerReport | None:
        """The news (None if there is none), and a clean slate."""
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return report if any(getattr(report, f.name) for f in fields(report)) else None
