"""Exact assignment of fields to planes (row widths) of one row space.

A slot reserves the same number of rows in every plane, so the cost of an
assignment is ``max over planes of ceil(plane entry bytes / plane row width)``.
The answer must be the one an exhaustive enumeration gives, tie-break
included, because two processes that plan the same declaration must land on the
same layout. The search is a depth-first branch and bound that visits
assignments in exactly the enumeration's order and prunes with a capacity
bound, so the first best assignment it meets is the enumeration's answer.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence

from ..checks import check_bytes, check_count
from ..errors import InvalidValueError
from .fields import EntryField, check_fields, entry_bytes_for
from .regions import ALIGNMENT, align_up

DEFAULT_MAX_NODES = 2_000_000
"""Search nodes :func:`plan_field_planes` may visit before it refuses."""

_MAX_BITSET_BITS = 1 << 24
"""Subset-sum bitsets wider than this are skipped (the bound stays exact, only weaker)."""


class PlanePlanningError(InvalidValueError):
    """The exact plane search could not finish within its node bound."""

    def __init__(self, message: str, *, fields: int, planes: int, nodes: int) -> None:
        super().__init__(message)
        self.fields = fields
        self.planes = planes
        self.nodes = nodes


def _check_widths(plane_row_bytes: Sequence[int]) -> list[int]:
    widths = list(plane_row_bytes)
    if not widths:
        raise InvalidValueError(
            "plan_field_planes: no planes given; pass at least one plane row width"
        )
    return [
        check_bytes(w, f"plan_field_planes: plane_row_bytes[{p}]", lo=1)
        for p, w in enumerate(widths)
    ]


def plane_rows(fields: Sequence[EntryField], row_bytes: int) -> int:
    """Rows one plane needs for ``fields``: ceil(entry bytes / row width)."""
    return -(-entry_bytes_for(fields) // row_bytes)


def plan_field_planes(
    fields: Sequence[EntryField],
    plane_row_bytes: Sequence[int],
    *,
    max_nodes: int = DEFAULT_MAX_NODES,
) -> tuple[list[list[EntryField]], int]:
    """Assign every field to one plane so that the slot's row count is minimal.

    Returns ``(per_plane_fields, rows)``; fields keep their declared order
    inside a plane. Among minimal assignments the one with the smallest code is
    returned, where the code's base-P digits, least significant first, are
    field 0's plane, field 1's plane, ... -- identical to enumerating all P^n
    codes, but searched with pruning. Raises :class:`PlanePlanningError` when
    the search would visit more than ``max_nodes`` nodes: never an
    approximate answer.

    Why the search is exact: it assigns the most significant digit (the last
    field) first, trying planes in increasing order, so leaves are met in code
    order; a subtree is cut only when a lower bound proves it cannot be
    strictly better than the best found, so the first leaf of minimal cost is
    the smallest code. The lower bound uses two facts about the walk: adding
    fields to a plane never lowers its entry size, and a plane's entry size is
    at least the sum of its fields' sizes each rounded up to 256.
    """
    fields = check_fields(fields, "plan_field_planes")
    widths = _check_widths(plane_row_bytes)
    max_nodes = check_count(max_nodes, "plan_field_planes: max_nodes", lo=1, hi=1 << 40)
    n, planes = len(fields), len(widths)
    if n == 0:
        return [[] for _ in widths], 0

    sizes = [f.bytes_per_entry for f in fields]
    aligns = [f.start_alignment for f in fields]
    raw = [align_up(s) for s in sizes]  # per-field floor on what it adds to a plane
    prefix_raw = [0] * (n + 1)
    prefix_max = [0] * (n + 1)
    for i in range(n):
        prefix_raw[i + 1] = prefix_raw[i] + raw[i]
        prefix_max[i + 1] = max(prefix_max[i], raw[i])

    # Upper bound from a greedy pass in declared order (the walk is sequential).
    ends = [0] * planes
    for i in range(n):

        def after(p: int, i: int = i) -> int:
            return -(-ends[p] // aligns[i]) * aligns[i] + sizes[i]

        best_p = min(
            range(planes),
            key=lambda p: max(
                -(-align_up(after(p) if q == p else ends[q]) // widths[q]) for q in range(planes)
            ),
        )
        ends[best_p] = after(best_p)
    greedy_rows = max(-(-align_up(e) // w) for e, w in zip(ends, widths, strict=False))

    # Subset sums of each prefix of fields, as bitsets in units of `unit`
    # bytes: bit j of reach[k] is set iff some subset of fields [0, k) has raw
    # bytes j * unit. They make the capacity bound see integrality (a plane's
    # share must be a subset sum), which is what proves optima of tightly
    # packed instances without visiting them all.
    unit = math.gcd(*raw) or ALIGNMENT
    reach: list[int] | None = None
    if prefix_raw[n] // unit <= _MAX_BITSET_BITS:
        reach = [1]
        for i in range(n):
            reach.append(reach[-1] | (reach[-1] << (raw[i] // unit)))

    # For each k: the raw sizes of fields [0, k) sorted, and the sums of their
    # tails, so "bytes of pending fields bigger than h" is one bisect.
    sorted_prefix: list[tuple[list[int], list[int]]] = []
    for k in range(n + 1):
        ordered = sorted(raw[:k])
        tail_sums = [0] * (k + 1)
        for j in range(k - 1, -1, -1):
            tail_sums[j] = tail_sums[j + 1] + ordered[j]
        sorted_prefix.append((ordered, tail_sums))

    assign = [0] * n
    used = [False] * planes
    nodes = 0

    def feasible(k: int, holes: list[int]) -> bool:
        """Necessary condition: fields [0, k) can still fit in front of the planes.

        ``holes[p]`` is the latest offset at which the fields still to come
        into plane p may end, so that what is already there (which they all
        precede) still fits; each of those fields adds at least its raw size.
        """
        need = prefix_raw[k]
        if need == 0:
            return True
        total_hole = sum(holes)
        if total_hole < need or max(holes) < prefix_max[k]:
            return False
        # Fields too big for plane p's hole must fit in the other planes, and
        # fields too big for every other plane's hole must fit in plane p.
        ordered, tail_sums = sorted_prefix[k]
        for p, hole in enumerate(holes):
            if tail_sums[bisect_right(ordered, hole)] > total_hole - hole:
                return False
            other = max((h for q, h in enumerate(holes) if q != p), default=-1)
            if tail_sums[bisect_right(ordered, other)] > hole:
                return False
        if reach is not None:
            bits = reach[k]
            for hole in holes:
                # Plane p takes a subset sum s <= hole, and the other planes'
                # holes must absorb the rest: need - s <= total - hole.
                lo = max(0, -(-(need - (total_hole - hole)) // unit))
                hi = hole // unit
                if hi < lo or not (bits >> lo) & ((1 << (hi - lo + 1)) - 1):
                    return False
        return True

    def search(k: int, holes: list[int]) -> bool:
        """Assign fields k-1 .. 0 into the holes; True once a leaf is reached."""
        nonlocal nodes
        if k == 0:
            return True
        i = k - 1
        for p in range(planes):
            # Planes of equal width that are both still empty are interchangeable;
            # the lower index is the smaller digit, so only it is tried.
            if not used[p] and any(not used[q] and widths[q] == widths[p] for q in range(p)):
                continue
            nodes += 1
            if nodes > max_nodes:
                raise PlanePlanningError(
                    f"plan_field_planes: no exact answer for {n} fields over {planes} planes "
                    f"{widths} within {max_nodes} search nodes; declare fewer fields per "
                    "plane set or raise max_nodes",
                    fields=n,
                    planes=planes,
                    nodes=nodes,
                )
            # Field i goes in front of plane p's fields: it must end by holes[p],
            # so it starts at the latest multiple of its alignment that allows.
            latest_start = holes[p] - sizes[i]
            if latest_start < 0:
                continue
            latest_start -= latest_start % aligns[i]
            was_used = used[p]
            assign[i], used[p] = p, True
            saved, holes[p] = holes[p], latest_start
            if feasible(i, holes) and search(i, holes):
                return True
            holes[p], used[p] = saved, was_used
        return False

    def root_holes(rows: int) -> list[int]:
        # An entry fits `rows` rows iff its 256-aligned size is <= rows * width.
        return [rows * w // ALIGNMENT * ALIGNMENT for w in widths]

    # Smallest row count that passes the bound at the root; the greedy count
    # always has a leaf, so the loop ends by it at the latest.
    lo, hi = 0, greedy_rows
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(n, root_holes(mid)):
            hi = mid
        else:
            lo = mid + 1
    # Try row counts upward: the first count with any leaf is the optimum, and
    # the first leaf met at it (in code order) is the smallest code.
    rows = lo
    while not search(n, root_holes(rows)):
        rows += 1
    best_assign = assign

    per_plane: list[list[EntryField]] = [[] for _ in range(planes)]
    for i, p in enumerate(best_assign):
        per_plane[p].append(fields[i])
    return per_plane, rows
