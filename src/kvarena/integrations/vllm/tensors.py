"""vLLM's registered cache tensors, read and written one block at a time.

``register_kv_caches`` hands each worker one tensor per layer. The connector
finds the block dimension from the shape and the block count — first
(``[blocks, ...]``, vLLM's block-major layouts, the CPU backend's ``LBHNC``)
or second behind K/V (``[2, blocks, ...]``) — and checks that a block holds
exactly the bytes its group's spec says. Anything else is refused at start
with the shapes named: a guessed layout would copy the wrong bytes silently.

Every copy goes through a ``uint8`` view of the tensor, so a block's bytes are
moved as they are (bfloat16 K/V, a float32 SSM state and its conv window
alike). Consecutive layers of a group whose pages of one block lie side by
side in one allocation are copied as one range (:class:`BlockRun`): in
vLLM's block-major layouts (``BLHNC``, ``BLNHC``: a block of every layer of a
group is one contiguous run) a block is one copy for the whole group, the
one-range-per-entry idea inside vLLM; in its layer-major ones (``LBHNC``)
every layer is its own run. The bytes, and so the images, are the same
either way: a group's layers in its order, each layer's page as it is.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...spans import coalesce
from .groups import Group
from .settings import ConnectorConfigError


def payload_bytes(groups: Sequence[Group]) -> int:
    """The payload of one image of ``groups`` (a KV block of every full-attention
    layer, or a state page of every state layer): what every layer's block holds
    by its spec. The registered tensors are checked against the same numbers."""
    return sum(g.block_bytes * len(g.layers) for g in groups)


@dataclass(frozen=True, eq=False)
class LayerBlocks:
    """One layer's cache tensor as blocks of raw bytes."""

    name: str
    raw: torch.Tensor  # a uint8 view of vLLM's tensor
    dim: int  # the block dimension of ``raw``
    block_bytes: int

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, *, num_blocks: int, group: Group) -> LayerBlocks:
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
        block_bytes = raw.select(dim, 0).numel()
        want = group.block_bytes
        if block_bytes != want:
            raise ConnectorConfigError(
                f"kvarena connector: layer {name}: a block of its tensor {list(shape)} "
                f"({tensor.dtype}) holds {block_bytes:,} B, its group's "
                f"{group.spec['class']} says {want:,} B"
            )
        return cls(name=name, raw=raw, dim=dim, block_bytes=block_bytes)

    def block_address(self) -> int | None:
        """Where block 0's page starts, when one block's page is one contiguous range
        and blocks are the first dimension (what a run can be made of), else None."""
        if self.dim != 0 or not self.raw.select(0, 0).is_contiguous():
            return None
        return int(self.raw.data_ptr())


@dataclass(frozen=True, eq=False)
class BlockRun:
    """Consecutive layers of one group whose pages of each block form one range.

    ``raw`` views the run as ``[blocks, block_bytes]`` (or, for a single layer
    that is no run of pages, that layer's own view with its block dimension
    ``dim``): gathering or scattering a block is one copy for every layer in it."""

    layers: tuple[str, ...]
    raw: torch.Tensor
    dim: int
    block_bytes: int

    @classmethod
    def of(cls, layers: Sequence[LayerBlocks], *, num_blocks: int) -> BlockRun:
        first = layers[0]
        if len(layers) == 1:
            return cls(
                layers=(first.name,), raw=first.raw, dim=first.dim, block_bytes=first.block_bytes
            )
        total = sum(layer.block_bytes for layer in layers)
        raw = torch.as_strided(
            first.raw, (num_blocks, total), (first.raw.stride(0), 1), first.raw.storage_offset()
        )
        return cls(layers=tuple(layer.name for layer in layers), raw=raw, dim=0, block_bytes=total)

    def gather(self, block_ids: Sequence[int]) -> np.ndarray:
        """The bytes of ``block_ids``, a host array ``[len(block_ids), block_bytes]``
        (one copy; on CUDA it waits for the forward that wrote them)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.raw.device)
        rows = torch.index_select(self.raw, self.dim, ids).movedim(self.dim, 0)
        return rows.reshape(len(block_ids), self.block_bytes).contiguous().cpu().numpy()

    def scatter(self, block_id: int, data: memoryview) -> None:
        """Write one block's bytes (``block_bytes`` of them) into the tensor."""
        dst = self.raw.select(self.dim, block_id)
        with warnings.catch_warnings():  # a read-only source, only ever read from
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8).view(dst.shape)
        dst.copy_(src)


def _runnable(layer: LayerBlocks, head: LayerBlocks) -> bool:
    """Whether ``layer`` could share a run with ``head``: block pages in one
    allocation on one device, at one block stride."""
    return (
        layer.block_address() is not None
        and head.block_address() is not None
        and layer.raw.device == head.raw.device
        and layer.raw.untyped_storage().data_ptr() == head.raw.untyped_storage().data_ptr()
        and layer.raw.stride(0) == head.raw.stride(0)
    )


def block_runs(layers: Sequence[LayerBlocks], *, num_blocks: int) -> list[BlockRun]:
    """A group's layers, in order, joined into runs wherever their pages are adjacent.

    Adjacency is the copy engine's own rule (:func:`kvarena.spans.coalesce`):
    each layer's page of block 0 is a span from its place in the object's
    payload to its place in memory, and spans continuing each other on both
    sides are one. A run never reaches past one block's stride, so block ``b``
    of the run is one range for every ``b``."""
    runs: list[list[LayerBlocks]] = []
    for layer in layers:
        if runs and _runnable(layer, runs[-1][0]):
            joined = runs[-1] + [layer]
            at = np.array([x.block_address() for x in joined], dtype=np.int64)
            size = np.array([x.block_bytes for x in joined], dtype=np.int64)
            payload = np.concatenate(([0], np.cumsum(size)[:-1]))
            _, _, merged = coalesce(payload, at, size)
            if merged.size == 1 and int(merged[0]) <= joined[0].raw.stride(0):
                runs[-1] = joined
                continue
        runs.append([layer])
    return [BlockRun.of(run, num_blocks=num_blocks) for run in runs]


def layer_blocks(
    kv_caches: Mapping[str, torch.Tensor], groups: Sequence[Group], *, num_blocks: int
) -> dict[int, list[BlockRun]]:
    """Each group's layers as :class:`BlockRun` s, in the group's layer order; a
    layer the config names but vLLM did not register is refused."""
    out: dict[int, list[BlockRun]] = {}
    for g in groups:
        rows = []
        for name in g.layers:
            if name not in kv_caches:
                raise ConnectorConfigError(
                    f"kvarena connector: layer {name} of KV cache group {g.index} has no "
                    f"registered cache tensor (registered: {', '.join(list(kv_caches)[:4])}...)"
                )
            rows.append(LayerBlocks.of(name, kv_caches[name], num_blocks=num_blocks, group=g))
        out[g.index] = block_runs(rows, num_blocks=num_blocks)
    return out
