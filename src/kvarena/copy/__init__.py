"""Segmented copy plans (sizes only) and their batched execution (addresses)."""

from ..spans import coalesce
from .executor import CopyBoundsError, CopyStats, execute_batch, validate_batch
from .plan import CopyBatch, SegmentedCopyPlan, describe_batch, plan_segmented_copy

__all__ = [
    "CopyBatch",
    "CopyBoundsError",
    "CopyStats",
    "SegmentedCopyPlan",
    "coalesce",
    "describe_batch",
    "execute_batch",
    "plan_segmented_copy",
    "validate_batch",
]
