"""KV events for routers: what kvarena's tiers store and drop, in vLLM's own schema.

A router that sends each request to the engine holding its prefix (llm-d's
KV-cache indexer, Dynamo's router, vllm-router's event policy) reads vLLM's
KV events (``--kv-events-config``). vLLM publishes its device cache's; a
connector adds its own through ``take_events``. kvarena announces every object
its tiers hold as vLLM announces a device block: ``BlockStored`` with vLLM's
block hash (the one a router computes from the tokens), the parent hash, the
block's token ids, its KV cache group and the group's kind, once per tier
with the tier's medium and locality — host ``CPU``/``LOCAL``, disk
``STORAGE``/``LOCAL``, a shared store ``STORAGE``/``REMOTE`` (vLLM's mediums:
``GPU``, ``CPU``, ``STORAGE``) — and ``ownership`` ``kvarena:<tier label>``;
``BlockRemoved`` when the host or disk tier drops it. An object is announced
once every rank holds its shard (a lookup needs them all), in the tiers that
stored it on every rank (a full disk, a store out of memory: refused there),
and removed once any rank dropped one. A shared store evicts on its server, unseen: a router
learns of that as a miss, as the engine does.

A KV object stands for one block of every full-attention group (one event
per group); a state object for the state at a resume point, announced in
each state group under the hash of the block that ends there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from ...tiers.names import ImageKind, object_name
from .ranks import rank_names
from .records import BlockCopy, WorkerReport

MEDIA = {"host": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"), "redis": ("STORAGE", "REMOTE")}
"""Each tier kind's medium and locality in vLLM's KV events."""

REMEMBERED = 1 << 20
"""Objects whose events the book keeps for their removal; past it the oldest
is forgotten (its removal then goes unannounced: a router learns of it as a
miss)."""


@dataclass(frozen=True, kw_only=True)
class _Block:
    """What the events of one object say."""

    hash: Any
    parent: Any
    tokens: list[int]
    groups: tuple[tuple[int, str], ...]  # (group index, vLLM's kind of it)
    lora_id: int | None
    lora_name: str | None


class TierEvents:
    """The scheduler's book of announced objects and the events not yet taken.

    ``tiers``: each tier's (label, kind), top first; ``groups``: each KV cache
    group's vLLM kind by index, and which of them the KV objects and the state
    objects stand for; ``hash_block_size``: the tokens each of vLLM's request
    block hashes covers (a divisor of ``block_size``)."""

    def __init__(
        self,
        *,
        tiers: list[tuple[str, str]],
        kv_groups: list[tuple[int, str]],
        state_groups: list[tuple[int, str]],
        block_size: int,
        hash_block_size: int,
        ranks: int,
    ) -> None:
        self.tiers = [(label, *MEDIA.get(kind, ("STORAGE", "REMOTE"))) for label, kind in tiers]
        self.kv_groups, self.state_groups = tuple(kv_groups), tuple(state_groups)
        self.block_size, self.ranks = block_size, ranks
        self.scale = block_size // hash_block_size if block_size % hash_block_size == 0 else 0
        self._planned: OrderedDict[str, _Block] = OrderedDict()  # saved, not yet on every rank
        self._held: OrderedDict[str, _Block] = OrderedDict()  # announced, by prefix name
        self._prefix_of: dict[str, str] = {}  # each rank's object name -> prefix name
        self._removed: set[tuple[str, str]] = set()  # (label, prefix) announced gone
        self._refused: dict[str, set[str]] = {}  # planned prefix -> labels a rank's tier refused
        self._events: list[Any] = []

    def _vllm_hash(self, request: Any, blocks: int) -> Any:
        """vLLM's hash of the request's first ``blocks`` blocks (at our block size:
        the hash of the last hash block inside it, as vLLM itself views it)."""
        i = blocks * self.scale - 1
        hashes = getattr(request, "block_hashes", None)
        if i < 0 or hashes is None or i >= len(hashes):
            return None
        return maybe_convert_block_hash(hashes[i])

    def planned(self, request: Any, kind: ImageKind, copy: BlockCopy) -> None:
        """A save the step plans: remember what its events will say."""
        if not self.scale:
            return
        end = copy.index + 1 if kind is ImageKind.KV_BLOCK else copy.index  # blocks up to it
        block_hash = self._vllm_hash(request, end)
        if block_hash is None:
            return
        lora = getattr(request, "lora_request", None)
        bs = self.block_size
        self._planned[object_name(kind, copy.key)] = _Block(
            hash=block_hash,
            parent=self._vllm_hash(request, end - 1) if end > 1 else None,
            tokens=list(request.all_token_ids[(end - 1) * bs : end * bs]),
            groups=self.kv_groups if kind is ImageKind.KV_BLOCK else self.state_groups,
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
        )
        while len(self._planned) > REMEMBERED:
            self._refused.pop(self._planned.popitem(last=False)[0], None)

    def reported(self, report: WorkerReport, completed: list[str]) -> None:
        """A worker's report: what its tiers refused (first: a prefix is announced
        only in the tiers that hold it on every rank), the prefixes every rank
        has now saved (``completed``), and what its tiers dropped."""
        for label, _, prefix in report.refused:
            self.refused(label, prefix)
        for prefix in completed:
            self.stored(prefix)
        self.dropped("host", report.host_dropped)
        for label, name in report.dropped:
            self.dropped(label, [name])

    def refused(self, label: str, prefix: str) -> None:
        """A rank's tier ``label`` did not store its shard of ``prefix``: not
        announced there (or announced gone, where every rank had reported it)."""
        if prefix in self._held:
            self._gone(label, prefix)
        elif prefix in self._planned:
            self._refused.setdefault(prefix, set()).add(label)

    def stored(self, prefix: str) -> None:
        """Every rank has saved ``prefix``: announce it, tier by tier, in every
        tier no rank's refused (:meth:`refused`)."""
        block = self._planned.pop(prefix, None)
        if block is None:
            return
        self._held[prefix] = block
        for name in rank_names(prefix, self.ranks):
            self._prefix_of[name] = prefix
        refused = self._refused.pop(prefix, set())
        for label, medium, locality in self.tiers:
            self._removed.discard((label, prefix))
            if label in refused:  # a rank's shard is missing there: not held
                self._removed.add((label, prefix))
                continue
            for group, spec_kind in block.groups:
                self._events.append(
                    BlockStored(
                        block_hashes=[block.hash],
                        parent_block_hash=block.parent,
                        token_ids=block.tokens,
                        block_size=self.block_size,
                        lora_id=block.lora_id,
                        medium=medium,
                        lora_name=block.lora_name,
                        group_idx=group,
                        kv_cache_spec_kind=spec_kind,
                        locality=locality,
                        ownership=f"kvarena:{label}",
                    )
                )
        while len(self._held) > REMEMBERED:
            self._forget(next(iter(self._held)))

    def _forget(self, prefix: str) -> None:
        """Drop every book entry of ``prefix`` (its removal goes unannounced after)."""
        self._held.pop(prefix, None)
        for name in rank_names(prefix, self.ranks):
            self._prefix_of.pop(name, None)
        for label, _, _ in self.tiers:
            self._removed.discard((label, prefix))

    def dropped(self, label: str, names: list[str]) -> None:
        """A rank's tier ``label`` dropped these objects (its own names)."""
        for name in names:
            prefix = self._prefix_of.get(name)
            if prefix is not None:
                self._gone(label, prefix)

    def _gone(self, label: str, prefix: str) -> None:
        """Announce ``prefix`` gone from tier ``label``, once."""
        tier = next((t for t in self.tiers if t[0] == label), None)
        block = self._held.get(prefix)
        if tier is None or block is None or (label, prefix) in self._removed:
            return
        _, medium, locality = tier
        self._removed.add((label, prefix))
        for group, _ in block.groups:
            self._events.append(
                BlockRemoved(
                    block_hashes=[block.hash],
                    medium=medium,
                    group_idx=group,
                    locality=locality,
                    ownership=f"kvarena:{label}",
                )
            )
        if all((t[0], prefix) in self._removed for t in self.tiers if t[0] != "redis"):
            self._forget(prefix)  # gone from every tier that reports drops

    def take(self) -> list[Any]:
        events, self._events = self._events, []
        return events
