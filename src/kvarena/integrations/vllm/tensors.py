"""vLLM's registered cache tensors as byte spans, copied by kvarena's copy engine.

``register_kv_caches`` hands each worker one tensor per layer. The connector
finds the block dimension from the shape and the block count — first
(``[blocks, ...]``, vLLM's block-major layouts, the CPU backend's ``LBHNC``)
or second behind K/V (``[2, blocks, ...]``) — and checks that a block holds
exactly the bytes its group's spec says. Anything else is refused at start
with the shapes named: a guessed layout would copy the wrong bytes silently.

Each layer's page of a block is a few contiguous byte spans of the storage
vLLM allocated (one for a page that is one range, two for K and V apart,
one per token row where a page is token-major), at the same places in every
block shifted by the block dimension's stride (:class:`LayerPages`). An
object's payload is a group's layers in its order, each layer's page in its
own element order, so the images are the same bytes in every layout. A load
or a step's saves are then ONE described batch per storage
(:class:`CachePages`): every object's every layer span, instead of a copy
per layer per block. On a CPU the spans are the grids the layout declares
(:mod:`.page_grids`: a group's layers one region apart, a request's blocks
one block apart), checked whole and moved one call a grid; elsewhere (and
where grids would be many small calls) the copy engine (:mod:`kvarena.copy`)
checks the batch whole, coalesces where spans continue each other (a block
of every layer of a group in vLLM's block-major layouts is one range: the
one-range-per-entry idea inside vLLM) and moves it with its own strategies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...copy.executor import execute_batch
from ...copy.grid_copy import execute_grids, reversed_grid
from ...copy.plan import CopyBatch
from ...errors import InvalidValueError
from .groups import Group
from .page_grids import SpanRuns, worth_grids
from .settings import ConnectorConfigError


def payload_bytes(groups: Sequence[Group]) -> int:
    """The payload of one image of ``groups`` (a KV block of every full-attention
    layer, or a state page of every state layer): what every layer's block holds
    by its spec. The registered tensors are checked against the same numbers."""
    return sum(g.block_bytes * len(g.layers) for g in groups)


def page_spans(page: torch.Tensor) -> np.ndarray:
    """The ``[n, 2]`` (offset from the page's first byte, length) spans of a uint8
    view, in its element order: trailing dimensions that continue each other
    are merged first, so only the outer indices are enumerated."""
    shape, strides = list(page.shape), list(page.stride())
    run = 1
    while shape and (strides[-1] == run or shape[-1] == 1):
        run *= shape.pop()
        strides.pop()
    if not shape:
        return np.array([[0, run]], dtype=np.int64)
    grids = np.meshgrid(
        *[np.arange(n, dtype=np.int64) * st for n, st in zip(shape, strides, strict=True)],
        indexing="ij",
    )
    starts = np.sum(grids, axis=0).reshape(-1)
    return np.stack([starts, np.full_like(starts, run)], axis=1)


@dataclass(frozen=True, eq=False)
class LayerPages:
    """One layer's pages as spans of the storage vLLM allocated: block ``b``'s page
    is ``spans`` shifted by ``first + b * step`` bytes."""

    name: str
    storage: torch.Tensor  # the whole allocation as a 1-D uint8 tensor
    first: int  # where block 0's page starts, in bytes from the storage's start
    step: int  # bytes from one block's page to the next
    spans: np.ndarray  # [n, 2]: offset from ``first``, length
    block_bytes: int

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, *, num_blocks: int, group: Group) -> LayerPages:
        shape = tuple(tensor.shape)
        if tensor.dim() >= 2 and shape[0] == num_blocks:
            dim = 0
        elif tensor.dim() >= 3 and shape[0] == 2 and shape[1] == num_blocks:
            dim = 1
        else:
            raise ConnectorConfigError(
                f"kvarena connector: layer {name}: cache tensor of shape {list(shape)} "
                f"(strides {list(tensor.stride())}) has no block dimension of {num_blocks} first "
                "or behind K/V; known layouts are [blocks, ...] and [2, blocks, ...]"
            )
        if tensor.stride(-1) != 1:
            raise ConnectorConfigError(
                f"kvarena connector: layer {name}: cache tensor of shape {list(shape)} has "
                f"strides {list(tensor.stride())}; its last dimension must be contiguous"
            )
        raw = tensor.view(torch.uint8)
        page = raw.select(dim, 0)
        block_bytes = page.numel()
        want = group.block_bytes
        if block_bytes != want:
            raise ConnectorConfigError(
                f"kvarena connector: layer {name}: a block of its tensor {list(shape)} "
                f"({tensor.dtype}) holds {block_bytes:,} B, its group's "
                f"{group.spec['class']} says {want:,} B"
            )
        storage = torch.empty(0, dtype=torch.uint8, device=raw.device).set_(raw.untyped_storage())
        return cls(
            name=name,
            storage=storage,
            first=int(page.storage_offset()),
            step=int(raw.stride(dim)),
            spans=page_spans(page),
            block_bytes=block_bytes,
        )


@dataclass(frozen=True, kw_only=True)
class StorageSpans:
    """Every span one group's objects have in one storage: for each, the layer's
    offset in the payload plus the span's (``payload``), where it lies in block
    0 (``at``) and its block step (``step``), and its ``length``."""

    storage: torch.Tensor
    group: np.ndarray  # which of the object kind's groups each span belongs to
    payload: np.ndarray
    at: np.ndarray
    step: np.ndarray
    length: np.ndarray


class CachePages:
    """The registered cache as spans, by object kind (KV groups, state groups):
    where every byte of an object's payload lives for any block ids."""

    def __init__(self, kinds: dict[str, list[list[LayerPages]]]) -> None:
        """``kinds``: for each object kind, its groups' layers in payload order."""
        self.payload = {
            k: sum(layer.block_bytes for g in gs for layer in g) for k, gs in kinds.items()
        }
        self._stream: torch.cuda.Stream | None = None  # the saves' side stream (CUDA)
        self._spans: dict[str, list[StorageSpans]] = {}
        for kind, groups in kinds.items():
            by_storage: dict[int, list[tuple[int, int, LayerPages]]] = {}
            pos = 0
            for gi, layers in enumerate(groups):
                for layer in layers:
                    key = layer.storage.untyped_storage().data_ptr()
                    by_storage.setdefault(key, []).append((gi, pos, layer))
                    pos += layer.block_bytes
            out = []
            for entries in by_storage.values():
                rows = [
                    (gi, pos + within, layer.first + at, layer.step, n)
                    for gi, pos, layer in entries
                    for (at, n), within in zip(
                        layer.spans.tolist(),
                        np.concatenate(([0], np.cumsum(layer.spans[:, 1])[:-1])).tolist(),
                        strict=True,
                    )
                ]
                cols = np.array(rows, dtype=np.int64).reshape(-1, 5)
                out.append(
                    StorageSpans(
                        storage=entries[0][2].storage,
                        group=cols[:, 0],
                        payload=cols[:, 1],
                        at=cols[:, 2],
                        step=cols[:, 3],
                        length=cols[:, 4],
                    )
                )
            self._spans[kind] = out
        self._runs = {
            kind: [SpanRuns.of(s.group, s.payload, s.at, s.step, s.length) for s in spans]
            for kind, spans in self._spans.items()
        }
        self._bytes = {
            kind: [int(s.length.sum()) for s in spans] for kind, spans in self._spans.items()
        }
        # asked on every copy: read from torch once, here
        self._storage_keys = {
            kind: [s.storage.untyped_storage().data_ptr() for s in spans]
            for kind, spans in self._spans.items()
        }
        self._device = next(
            (s.storage.device for spans in self._spans.values() for s in spans),
            torch.device("cpu"),
        )

    def spans(self, kind: str) -> list[StorageSpans]:
        """Every span of ``kind``'s objects, one record per storage (what a
        NIXL handoff describes its blocks by: :mod:`.pd_table`)."""
        return self._spans.get(kind, [])

    @property
    def device(self) -> torch.device:
        return self._device

    def batches(
        self, kind: str, blocks: np.ndarray, payload_at: np.ndarray
    ) -> list[tuple[torch.Tensor, CopyBatch]]:
        """For objects ``j`` of ``kind`` whose blocks are ``blocks[j]`` (one id per
        group) and whose payloads start at ``payload_at[j]`` of a flat buffer:
        each storage with the batch of (payload offset, storage offset, length)."""
        return [(s.storage, _batch(s, blocks, payload_at)) for s in self._spans[kind]]

    def _copy(
        self,
        parts: Sequence[tuple[str, Sequence[Sequence[int]], Sequence[int]]],
        buffer: torch.Tensor,
        *,
        load: bool,
    ) -> None:
        """Copy objects ``(kind, blocks [objects, groups], payload offsets)`` between
        ``buffer`` and their blocks (into the blocks where ``load``): ONE copy per
        storage for every kind (a layer's KV and state pages share a storage in
        vLLM's allocations), checked whole before a byte moves. On a CPU, as the
        grids the layout declares (:mod:`.page_grids`) where they move enough a
        call; else as a described batch the copy engine plans."""
        merged: dict[int, tuple[torch.Tensor, list[tuple[str, int, Any, Any]]]] = {}
        for kind, ids, at in parts:  # in the order given: one plan every run
            spans, keys = self._spans[kind], self._storage_keys[kind]
            for i, (s, key) in enumerate(zip(spans, keys, strict=True)):
                merged.setdefault(key, (s.storage, []))[1].append((kind, i, ids, at))
        for storage, items in merged.values():
            if self.device.type == "cpu":
                found = [g for k, i, ids, at in items for g in self._runs[k][i].grids(ids, at)]
                nbytes = sum(len(at) * self._bytes[k][i] for k, i, _, at in items)
                if worth_grids(found, nbytes):
                    if load:
                        execute_grids(found, buffer, storage)
                    else:
                        execute_grids([reversed_grid(g) for g in found], storage, buffer)
                    continue
            batches = [
                _batch(
                    self._spans[k][i],
                    np.asarray(ids, dtype=np.int64).reshape(len(at), -1),
                    np.asarray(at, dtype=np.int64),
                )
                for k, i, ids, at in items
            ]
            batch = CopyBatch(
                np.concatenate([b.src for b in batches]),
                np.concatenate([b.dst for b in batches]),
                np.concatenate([b.length for b in batches]),
            )
            if load:
                execute_batch(batch, buffer, storage)
            else:
                execute_batch(CopyBatch(batch.dst, batch.src, batch.length), storage, buffer)

    def gather(
        self, kind: str, blocks: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The payloads of ``kind`` objects at ``blocks`` (one id per group each),
        back to back in a host buffer: one copy per storage. On a CPU the
        buffer is ready when this returns. On CUDA nothing waits: on a side
        stream, after the work queued so far (the step's forward), one batch
        per storage into device memory, then one copy into pinned host memory;
        the compute stream waits (on the device, not the host) for the
        device-side gather alone, so no later forward writes a block before its
        bytes are read, and the host copy overlaps the next forward. The event
        returned marks the host buffer ready (the writer waits on it)."""
        size = self.payload[kind]
        at = [j * size for j in range(len(blocks))]
        cuda = self.device.type == "cuda"
        if cuda:
            compute = torch.cuda.current_stream(self.device)
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(compute)
        # Allocated on the side stream, the device buffer is reused only by later
        # work of that stream, after the host copy below.
        with torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext():
            stage = torch.empty(len(blocks) * size, dtype=torch.uint8, device=self.device)
            self._copy([(kind, blocks, at)], stage, load=False)
            if not cuda:
                return stage, None
            gathered = torch.cuda.Event()
            gathered.record()
            host = torch.empty(stage.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(stage, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        compute.wait_event(gathered)
        return host, ready

    def scatter(
        self,
        objects: Sequence[tuple[str, Sequence[int], int]],
        source: torch.Tensor,
    ) -> None:
        """Write objects from ``source`` (a flat uint8 buffer) into their blocks,
        each ``(kind, blocks, payload offset)``: ONE copy per storage for every
        kind, checked whole before a byte moves."""
        if source.device != self.device:
            source = source.to(self.device)
        parts = []
        for kind in dict.fromkeys(k for k, _, _ in objects):  # in order: one plan every run
            mine = [(ids, at) for k, ids, at in objects if k == kind]
            parts.append((kind, [ids for ids, _ in mine], [at for _, at in mine]))
        self._copy(parts, source, load=True)

    def place(
        self,
        objects: Mapping[
            str, tuple[Sequence[Sequence[int]], Sequence[memoryview], Sequence[int | None]]
        ],
        arena: torch.Tensor | None,
    ) -> None:
        """Copy checked payloads into their blocks, ``objects`` by kind as (blocks,
        payloads, where each payload starts in ``arena``, a host tier's one
        allocation, where that tier lent it in place: :meth:`HostTier.lend`):
        those lent straight from the arena, the rest (None) staged once, back to
        back; one batch per storage each (:meth:`scatter`). On a device the
        payloads are staged (one copy to the device), never the whole arena. A
        payload of another size than its kind's is refused before a byte moves."""
        lent: list[tuple[str, Sequence[int], int]] = []
        staged: list[tuple[str, Sequence[int], memoryview]] = []
        if self.device.type != "cpu":
            arena = None
        for kind, (blocks, payloads, starts) in objects.items():
            size = self.payload[kind]
            for ids, p, at in zip(blocks, payloads, starts, strict=True):
                if len(p) != size:
                    raise InvalidValueError(
                        f"kvarena connector: a {kind} payload of {len(p):,} B for blocks "
                        f"{list(ids)}; this cache's {kind} objects hold {size:,} B"
                    )
                if arena is not None and at is not None:
                    lent.append((kind, ids, at))
                else:
                    staged.append((kind, ids, p))
        if lent:
            assert arena is not None
            self.scatter(lent, arena)
        if staged:
            flat = np.concatenate([np.frombuffer(p, dtype=np.uint8) for _, _, p in staged])
            offsets = np.cumsum([0] + [len(p) for _, _, p in staged[:-1]]).tolist()
            rows = [(k, ids, at) for (k, ids, _), at in zip(staged, offsets, strict=True)]
            self.scatter(rows, torch.from_numpy(flat))


def _batch(s: StorageSpans, blocks: np.ndarray, payload_at: np.ndarray) -> CopyBatch:
    """Objects ``j`` (blocks ``blocks[j]``, payloads at ``payload_at[j]``) as the
    (payload offset, storage offset, length) of every span ``s`` holds."""
    src = payload_at[:, None] + s.payload[None, :]
    dst = s.at[None, :] + blocks[:, s.group] * s.step[None, :]
    length = np.broadcast_to(s.length[None, :], src.shape)
    return CopyBatch(src.reshape(-1), dst.reshape(-1), length.reshape(-1))


def cache_pages(
    kv_caches: Mapping[str, torch.Tensor], groups: Sequence[Group], *, num_blocks: int
) -> CachePages:
    """The registered tensors as :class:`CachePages`, objects by kind (``kv``,
    ``state``) in the groups' order; a layer the config names but vLLM did not
    register is refused."""
    kinds: dict[str, list[list[LayerPages]]] = {"kv": [], "state": []}
    for g in groups:
        layers = []
        for name in g.layers:
            if name not in kv_caches:
                raise ConnectorConfigError(
                    f"kvarena connector: layer {name} of KV cache group {g.index} has no "
                    f"registered cache tensor (registered: {', '.join(list(kv_caches)[:4])}...)"
                )
            layers.append(LayerPages.of(name, kv_caches[name], num_blocks=num_blocks, group=g))
        kinds[g.kind].append(layers)
    return CachePages(kinds)
