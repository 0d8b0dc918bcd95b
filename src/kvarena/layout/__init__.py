"""The layout core: declarations, the walk, regions, plane planning, arenas.

Data flows one way: a declaration (:class:`EntryField`) is planned from sizes
alone (:func:`field_extents`, :func:`plan_regions`, :func:`plan_field_planes`)
and only then materialized over memory (the arenas).
"""

from .arenas import EntryMajorArena, LayerMajorArena, carve_layer_major
from .describe import LayoutRow, describe, layout_rows
from .fields import (
    EntryField,
    FieldExtent,
    checkpoint_ranges_for,
    dtype_name,
    entry_bytes_for,
    field_extents,
    layout_encoding,
    layout_fingerprint,
    min_slot_stride,
    strictest_alignment,
)
from .planes import PlanePlanningError, plan_field_planes, plane_rows
from .regions import ALIGNMENT, align_up, aligned_zeros, carve, plan_regions
from .split_arena import SplitEntryMajorArena

__all__ = [
    "ALIGNMENT",
    "EntryField",
    "EntryMajorArena",
    "FieldExtent",
    "LayerMajorArena",
    "LayoutRow",
    "PlanePlanningError",
    "SplitEntryMajorArena",
    "align_up",
    "aligned_zeros",
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
    "min_slot_stride",
    "plan_field_planes",
    "plan_regions",
    "plane_rows",
    "strictest_alignment",
]
