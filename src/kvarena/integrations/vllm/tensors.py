"""vLLM's registered cache tensors, read and written one block at a time.

``register_kv_caches`` hands each worker one tensor per layer. The connector
finds the block dimension from the shape and the block count — first
(``[blocks, ...]``, vLLM's block-major layouts, the CPU backend's ``LBHNC``)
or second behind K/V (``[2, blocks, ...]``) — and checks that a block holds
exactly the bytes its group's spec says. Anything else is refused at start
with the shapes named: a guessed layout would copy the wrong bytes silently.

Every copy goes through a ``uint8`` view of the tensor, so a block's bytes are
moved as they are (bfloat16 K/V, a float32 SSM state and its conv window
alike), one batched gather or scatter per layer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .groups import Group
from .settings import ConnectorConfigError

_DTYPES = {
    "torch.float32": torch.float32,
    "torch.float16": torch.float16,
    "torch.bfloat16": torch.bfloat16,
    "torch.float64": torch.float64,
    "torch.int8": torch.int8,
    "torch.uint8": torch.uint8,
    "torch.float8_e4m3fn": torch.float8_e4m3fn,
    "torch.float8_e5m2": torch.float8_e5m2,
}


def expected_block_bytes(group: Group) -> int:
    """The bytes one layer's block holds by its spec (a state page unpadded)."""
    spec = group.spec
    if group.kind == "kv":
        item = _DTYPES[spec["dtype"]].itemsize
        if spec["class"] == "MLAAttentionSpec":  # one latent vector per token
            return int(spec["block_size"]) * int(spec["head_size"]) * item
        v = spec.get("head_size_v") or spec["head_size"]
        per_token = int(spec["num_kv_heads"]) * (int(spec["head_size"]) + int(v)) * item
        return per_token * int(spec["block_size"])
    shapes, dtypes = spec["shapes"], spec["dtypes"]
    return sum(
        math.prod(int(x) for x in s) * _DTYPES[d].itemsize
        for s, d in zip(shapes, dtypes, strict=True)
    )


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
        want = expected_block_bytes(group)
        if block_bytes != want:
            raise ConnectorConfigError(
                f"kvarena connector: layer {name}: a block of its tensor {list(shape)} "
                f"({tensor.dtype}) holds {block_bytes:,} B, its group's "
                f"{group.spec['class']} says {want:,} B"
            )
        return cls(name=name, raw=raw, dim=dim, block_bytes=block_bytes)

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


def layer_blocks(
    kv_caches: Mapping[str, torch.Tensor], groups: Sequence[Group], *, num_blocks: int
) -> dict[int, list[LayerBlocks]]:
    """Each group's layers as :class:`LayerBlocks`, in the group's layer order;
    a layer the config names but vLLM did not register is refused."""
    out: dict[int, list[LayerBlocks]] = {}
    for g in groups:
        rows = []
        for name in g.layers:
            if name not in kv_caches:
                raise ConnectorConfigError(
                    f"kvarena connector: layer {name} of KV cache group {g.index} has no "
                    f"registered cache tensor (registered: {', '.join(list(kv_caches)[:4])}...)"
                )
            rows.append(LayerBlocks.of(name, kv_caches[name], num_blocks=num_blocks, group=g))
        out[g.index] = rows
    return out
