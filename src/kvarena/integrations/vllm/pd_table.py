"""Where a request's blocks lie in an engine's registered memory, as data a peer can use.

A decode engine READs a prefill engine's blocks into its own. Both describe
their objects the same way the tiers' copies do (:class:`~.tensors.CachePages`:
for each object kind, every span of every layer's page, by the storage it
lies in, its place in the object's payload, its place in block 0 and its
block step). That table travels in the handshake (:class:`SpanTable`), so the
reader computes the peer's addresses from the peer's own numbers (its
storages' addresses, its block count behind K/V) and pairs them span for span
with its own, by payload offset.

Two tables pair only where every kind's payload is cut into the same spans
(:meth:`SpanTable.mismatches`): the same bytes mean the same thing on both
sides, whatever each engine's memory size. Spans that continue each other on
both sides are one descriptor (:func:`pair`): in a block-major layout a
block of every layer of a group is one range, so one descriptor per block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .tensors import CachePages

COLUMNS = ("storage", "group", "payload", "at", "step", "length")


@dataclass(frozen=True, kw_only=True, eq=False)
class SpanTable:
    """An engine's spans: ``bases`` (each registered storage's address and size)
    and, for each object kind, rows of :data:`COLUMNS` in payload order."""

    bases: tuple[tuple[int, int], ...]
    kinds: Mapping[str, np.ndarray]  # kind -> int64 [rows, 6]
    device: int = 0  # the storages' device index (NIXL's device id; 0 on a CPU)

    @classmethod
    def of(cls, pages: CachePages) -> SpanTable:
        storages: dict[int, tuple[int, int]] = {}
        kinds = {}
        for kind in ("kv", "state"):
            rows = []
            for s in pages.spans(kind):
                ptr = int(s.storage.data_ptr())
                index = list(storages).index(ptr) if ptr in storages else len(storages)
                storages.setdefault(ptr, (ptr, int(s.storage.numel())))
                n = len(s.payload)
                rows.append(
                    np.stack(
                        [np.full(n, index), s.group, s.payload, s.at, s.step, s.length], axis=1
                    )
                )
            table = np.concatenate(rows) if rows else np.zeros((0, 6), np.int64)
            kinds[kind] = table[np.argsort(table[:, 2], kind="stable")].astype(np.int64)
        where = pages.device
        return cls(
            bases=tuple(storages.values()),
            kinds=kinds,
            device=int(where.index or 0) if where.type == "cuda" else 0,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "bases": [list(b) for b in self.bases],
            "kinds": {k: t.tolist() for k, t in self.kinds.items()},
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpanTable:
        return cls(
            bases=tuple((int(a), int(n)) for a, n in data["bases"]),
            kinds={
                k: np.asarray(rows, dtype=np.int64).reshape(-1, len(COLUMNS))
                for k, rows in data["kinds"].items()
            },
            device=int(data.get("device", 0)),
        )

    def mismatches(self, other: SpanTable) -> list[str]:
        """Why ``other``'s objects cannot be paired span for span with these
        (empty: they can): each kind's spans must have the same payload offsets,
        lengths and groups."""
        out = []
        for kind in sorted(set(self.kinds) | set(other.kinds)):
            mine = self.kinds.get(kind, np.zeros((0, 6), np.int64))[:, 1:3]
            theirs = other.kinds.get(kind, np.zeros((0, 6), np.int64))[:, 1:3]
            lengths = (
                self.kinds.get(kind, np.zeros((0, 6), np.int64))[:, 5],
                other.kinds.get(kind, np.zeros((0, 6), np.int64))[:, 5],
            )
            if mine.shape != theirs.shape:
                out.append(f"{kind} objects: {len(mine)} spans here, {len(theirs)} there")
            elif not (np.array_equal(mine, theirs) and np.array_equal(*lengths)):
                out.append(f"{kind} objects: spans cut differently (payload offsets or lengths)")
        return out

    def regions(self) -> np.ndarray:
        """NIXL registration rows ``[n, 3]`` (address, size, device): the storages."""
        rows = [[addr, size, self.device] for addr, size in self.bases]
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    def addresses(self, kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(address, length) of every span of objects of ``kind`` at ``blocks``
        (``[objects, groups]``), object after object, each in payload order;
        refused (``ValueError``) where a span falls outside its storage."""
        t = self.kinds[kind]
        bases = np.asarray([b for b, _ in self.bases], dtype=np.int64)
        sizes = np.asarray([n for _, n in self.bases], dtype=np.int64)
        blocks = np.asarray(blocks, dtype=np.int64).reshape(len(blocks), -1)
        offset = t[None, :, 3] + blocks[:, t[:, 1]] * t[None, :, 4]
        length = np.broadcast_to(t[None, :, 5], offset.shape)
        if (offset < 0).any() or (offset + length > sizes[t[:, 0]][None, :]).any():
            raise ValueError(f"{kind} blocks {blocks.tolist()[:4]}... lie outside the storages")
        return (bases[t[:, 0]][None, :] + offset).reshape(-1), length.reshape(-1).copy()


def pair(
    local: SpanTable,
    remote: SpanTable,
    kind: str,
    local_blocks: np.ndarray,
    remote_blocks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptor rows ``[n, 3]`` (address, length, device) for reading
    objects of ``kind`` from ``remote_blocks`` into ``local_blocks``, local and
    remote side by side: spans that continue each other on both sides merged."""
    la, ln = local.addresses(kind, local_blocks)
    ra, _ = remote.addresses(kind, remote_blocks)
    if not len(la):
        empty = np.zeros((0, 3), dtype=np.int64)
        return empty, empty
    joins = (la[1:] == la[:-1] + ln[:-1]) & (ra[1:] == ra[:-1] + ln[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(ln, starts)

    def rows(addr: np.ndarray, device: int) -> np.ndarray:
        return np.stack([addr[starts], lengths, np.full_like(lengths, device)], axis=1)

    return rows(la, local.device), rows(ra, remote.device)
