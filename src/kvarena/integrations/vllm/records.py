"""What the scheduler's half tells the workers each step, and what they answer.

A step's plan lists loads (a hit's KV blocks and its state image, into the
block ids vLLM allocated) and saves (blocks this step fills, states at the
boundary this step reaches, read from the exact blocks vLLM names). Every
entry carries its key, so a worker never hashes tokens; block ids are per
group, in the order of the connector's KV groups and state groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True, kw_only=True)
class BlockCopy:
    """One object's blocks: a KV image (``index``: the block's position in the
    prompt) or a state image (``index``: the boundary, in blocks)."""

    index: int
    key: bytes
    blocks: tuple[int, ...]  # one block id per group of the object's kind
    level: int | None = None  # the stack level the scheduler found it in (loads only)


@dataclass(frozen=True, kw_only=True)
class Load:
    request: str
    kv: tuple[BlockCopy, ...]
    state: BlockCopy | None

    @property
    def block_ids(self) -> set[int]:
        """Every block this load writes (what vLLM recomputes if it fails)."""
        ids = {b for c in self.kv for b in c.blocks}
        if self.state is not None:
            ids.update(self.state.blocks)
        return ids


@dataclass(kw_only=True)
class StepPlan(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    kv_saves: list[BlockCopy] = field(default_factory=list)
    state_saves: list[BlockCopy] = field(default_factory=list)


@dataclass(kw_only=True)
class WorkerReport(KVConnectorWorkerMetadata):
    """A worker's news for the scheduler since its last report: host-tier names
    it put and dropped (this rank's objects, as its host tier names them), and
    the prefix objects it saved and those a load could not use (missing
    everywhere, or failing its checks: then dropped from its tier), by the
    prefix object's name whichever rank's shard it was.
    The scheduler's lookups skip a failed name until it is saved again, so a
    recomputed request is not sent back to the same bad object."""

    host_added: list[str] = field(default_factory=list)
    host_dropped: list[str] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WorkerReport)
        return WorkerReport(
            host_added=self.host_added + other.host_added,
            host_dropped=self.host_dropped + other.host_dropped,
            saved=self.saved + other.saved,
            failed=self.failed + other.failed,
        )
