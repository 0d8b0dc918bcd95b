"""Pools: one plan from a budget, allocators, and one allocation with a movable boundary."""

from .block_table import BlockTable, block_table_tensor
from .blocks import BlockAllocationError, BlockAllocator
from .boundary import BoundaryMove, BoundaryMoveError
from .cached_keys import Evicted
from .geometry import PoolGeometry
from .holdings import Holding
from .plan import CachePlan, plan_cache
from .sizing import (
    ClassPlan,
    EntryClass,
    PoolBudgetError,
    PoolKind,
    PoolPlan,
    max_fitting_seqs,
    merge_classes,
    plan_pools,
)
from .states import StateAllocationError, StateAllocator
from .unified import UnifiedCache

__all__ = [
    "BlockAllocationError",
    "BlockAllocator",
    "BlockTable",
    "BoundaryMove",
    "BoundaryMoveError",
    "CachePlan",
    "ClassPlan",
    "EntryClass",
    "Evicted",
    "Holding",
    "PoolBudgetError",
    "PoolGeometry",
    "PoolKind",
    "PoolPlan",
    "StateAllocationError",
    "StateAllocator",
    "UnifiedCache",
    "block_table_tensor",
    "max_fitting_seqs",
    "merge_classes",
    "plan_cache",
    "plan_pools",
]
