"""kvarena: the memory layer of an LLM inference server.

One request's state is ONE contiguous byte range, while kernels keep the
per-layer ``[layers, entries, ...]`` views they take today.
"""

from .checkpoint import CheckpointMismatchError, CheckpointSpec, PageUnits, restore, store
from .copy import (
    CopyBatch,
    CopyBoundsError,
    CopyStats,
    SegmentedCopyPlan,
    describe_batch,
    execute_batch,
    plan_segmented_copy,
)
from .layout import (
    ALIGNMENT,
    EntryField,
    EntryMajorArena,
    FieldExtent,
    LayerMajorArena,
    LayoutRow,
    PlanePlanningError,
    SplitEntryMajorArena,
    align_up,
    carve,
    carve_layer_major,
    checkpoint_ranges_for,
    describe,
    dtype_name,
    entry_bytes_for,
    field_extents,
    layout_encoding,
    layout_fingerprint,
    layout_rows,
    plan_field_planes,
    plan_regions,
    plane_rows,
    strictest_alignment,
)

__version__ = "0.1.0"

__all__ = [
    "ALIGNMENT",
    "CheckpointMismatchError",
    "CheckpointSpec",
    "CopyBatch",
    "CopyBoundsError",
    "CopyStats",
    "EntryField",
    "EntryMajorArena",
    "FieldExtent",
    "LayerMajorArena",
    "LayoutRow",
    "PageUnits",
    "PlanePlanningError",
    "SegmentedCopyPlan",
    "SplitEntryMajorArena",
    "__version__",
    "align_up",
    "carve",
    "carve_layer_major",
    "checkpoint_ranges_for",
    "describe",
    "describe_batch",
    "dtype_name",
    "entry_bytes_for",
    "execute_batch",
    "field_extents",
    "layout_encoding",
    "layout_fingerprint",
    "layout_rows",
    "plan_field_planes",
    "plan_regions",
    "plan_segmented_copy",
    "plane_rows",
    "restore",
    "store",
    "strictest_alignment",
]
