"""kvarena: the memory layer of an LLM inference server.

One request's state is ONE contiguous byte range, while kernels keep the
per-layer ``[layers, entries, ...]`` views they take today.

The front door is the road an engine builder walks::

    model = kvarena.model_cache("qwen3-next-80b-a3b", kvarena.ServingOptions(tp=8))
    plan = kvarena.plan_cache(model, budget_bytes=40 << 30, max_seqs=64)
    cache = kvarena.UnifiedCache.from_plan(plan, "cuda")

Everything else lives in its subpackage: ``kvarena.layout`` (declarations,
the walk, arenas), ``kvarena.copy`` (segmented copy plans and their
execution), ``kvarena.pools`` (the plan, allocators, the movable boundary), ``kvarena.prefix`` (keys,
policies, the prefix cache), ``kvarena.tiers`` (host, disk and Redis tiers
below the device, one checksummed image format), ``kvarena.transfer``
(prefill -> decode on NIXL). The layout core of the design brief is
``kvarena.layout`` (``kvarena.layout.EntryMajorArena``...): the front door
below is the whole of what ``kvarena`` itself serves, each name typed.
"""

from __future__ import annotations

from .checkpoint import CheckpointMismatchError, CheckpointSpec, PageUnits, restore, store
from .errors import Error, InvalidValueError, LayoutMismatchError
from .layout import EntryField, describe, layout_fingerprint
from .models import PRESETS, ModelCache, ServingOptions, UnknownModelError, model_cache
from .pools import (
    BlockAllocationError,
    BoundaryMove,
    BoundaryMoveError,
    CachePlan,
    PoolBudgetError,
    StateAllocationError,
    UnifiedCache,
    plan_cache,
)
from .prefix import PrefixCache
from .tiers import TierStack
from .transfer import CacheGeometry, DecodeReceiver, PrefillSender, TransferError, TransferTimeout

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "BlockAllocationError",
    "BoundaryMove",
    "BoundaryMoveError",
    "CacheGeometry",
    "CachePlan",
    "CheckpointMismatchError",
    "CheckpointSpec",
    "DecodeReceiver",
    "EntryField",
    "Error",
    "InvalidValueError",
    "LayoutMismatchError",
    "ModelCache",
    "PageUnits",
    "PoolBudgetError",
    "PrefillSender",
    "PrefixCache",
    "ServingOptions",
    "StateAllocationError",
    "TierStack",
    "TransferError",
    "TransferTimeout",
    "UnifiedCache",
    "UnknownModelError",
    "__version__",
    "describe",
    "layout_fingerprint",
    "model_cache",
    "plan_cache",
    "restore",
    "store",
]
