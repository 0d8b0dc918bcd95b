"""Segmented copy plans (sizes only) and their batched execution (addresses)."""

from .executor import execute_batch
from .grid_copy import execute_grids
from .plan import CopyBatch, SegmentedCopyPlan, describe_batch, plan_segmented_copy
from .validate import CopyBoundsError, CopyStats, validate_batch

__all__ = [
    "CopyBatch",
    "CopyBoundsError",
    "CopyStats",
    "SegmentedCopyPlan",
    "describe_batch",
    "execute_batch",
    "execute_grids",
    "plan_segmented_copy",
    "validate_batch",
]
