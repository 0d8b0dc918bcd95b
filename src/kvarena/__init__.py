"""kvarena: the memory layer of an LLM inference server.

One request's state is ONE contiguous byte range, while kernels keep the
per-layer ``[layers, entries, ...]`` views they take today.
"""

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
    "EntryField",
    "EntryMajorArena",
    "FieldExtent",
    "LayerMajorArena",
    "LayoutRow",
    "PlanePlanningError",
    "SplitEntryMajorArena",
    "__version__",
    "align_up",
    "carve",
    "carve_layer_major",
    "checkpoint_ranges_for",
    "describe",
    "dtype_name",
    "entry_bytes_for",
    "field_extents",
    "layout_encoding",
    "layout_fingerprint",
    "layout_rows",
    "plan_field_planes",
    "plan_regions",
    "plane_rows",
    "strictest_alignment",
]
