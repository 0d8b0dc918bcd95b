"""Pools: one plan from a budget (``plan_cache``, the only sizing code), allocators, and one allocation with a movable boundary."""

from .block_table import BlockTable, block_table_tensor
from .blocks import BlockAllocationError, BlockAllocator
from .boundary import BoundaryMove, BoundaryMoveError
from .cached_keys import Evicted
from .geometry import PoolGeometry, blocks_for
from .holdings import Holding
from .plan import CachePlan, PoolBudgetError, plan_cache
from .states import StateAllocationError, StateAllocator
from .unified import UnifiedCache

__all__ = [
    "BlockAllocationError",
    "BlockAllocator",
    "BlockTable",
    "BoundaryMove",
    "BoundaryMoveError",
    "CachePlan",
    "Evicted",
    "Holding",
    "PoolBudgetError",
    "PoolGeometry",
    "StateAllocationError",
    "StateAllocator",
    "UnifiedCache",
    "block_table_tensor",
    "blocks_for",
    "plan_cache",
]
