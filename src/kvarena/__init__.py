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

Importing ``kvarena`` loads nothing of it: each name is imported from its
module the first time it is used (PEP 562), so ``kvarena tiers`` and the
other commands that never touch a tensor start without torch (a second and
more of every start on a small host).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers and the API docs read them; _HOMES serves them
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
    from .transfer import (
        CacheGeometry,
        DecodeReceiver,
        PrefillSender,
        TransferError,
        TransferTimeout,
    )

__version__ = "0.1.0"

_HOMES: dict[str, tuple[str, ...]] = {
    "checkpoint": ("CheckpointMismatchError", "CheckpointSpec", "PageUnits", "restore", "store"),
    "errors": ("Error", "InvalidValueError", "LayoutMismatchError"),
    "layout": ("EntryField", "describe", "layout_fingerprint"),
    "models": ("PRESETS", "ModelCache", "ServingOptions", "UnknownModelError", "model_cache"),
    "pools": (
        "BlockAllocationError",
        "BoundaryMove",
        "BoundaryMoveError",
        "CachePlan",
        "PoolBudgetError",
        "StateAllocationError",
        "UnifiedCache",
        "plan_cache",
    ),
    "prefix": ("PrefixCache",),
    "tiers": ("TierStack",),
    "transfer": (
        "CacheGeometry",
        "DecodeReceiver",
        "PrefillSender",
        "TransferError",
        "TransferTimeout",
    ),
}
"""Each submodule and the front door's names it serves (``__all__`` and the
imports above name the same; ``tests/test_front_door.py`` holds them equal)."""

_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


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


def __getattr__(name: str) -> Any:
    """A front-door name, imported from its module on first use (then kept in
    this module's namespace: the next use is a plain lookup); a subpackage by
    its name, as ``import kvarena`` then ``kvarena.tiers`` reads it."""
    home = _HOME_OF.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f".{home}", __name__), name)
        globals()[name] = value
        return value
    if any(m.name == name for m in pkgutil.iter_modules(__path__)):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
