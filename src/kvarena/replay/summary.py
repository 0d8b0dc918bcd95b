"""A replay's results as rows of text: one definition of the table's columns,
rendered by the terminal (rich) and by the report page alike."""

from __future__ import annotations

from collections.abc import Sequence

from .fleet import FleetResult
from .run import ReplayResult
from .sweep import Sweep

REPLAY_COLUMNS = (
    "policy",
    "requests",
    "hit tokens",
    "hit %",
    "with hit",
    "lost tokens",
    "images w/r",
    "evicted blocks/images",
    "moves",
    "admission µs",
    "verified",
    "mismatches",
)

FLEET_COLUMNS = (
    "arrangement",
    "engines",
    "requests",
    "hit tokens",
    "hit %",
    "device",
    "own tiers",
    "store",
    "store holds (B)",
    "written to store (B)",
    "read from store (B)",
    "store traffic / engine (B)",
)

SWEEP_COLUMNS = (
    "budget (B)",
    "policy",
    "hit tokens",
    "of bound",
    "hit %",
    "evicted blocks",
    "moves",
)


def replay_row(r: ReplayResult) -> tuple[str, ...]:
    """One result under :data:`REPLAY_COLUMNS`."""
    m = r.metrics
    share = r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
    return (
        r.label,
        f"{r.requests:,}",
        f"{r.hit_tokens:,}",
        f"{100 * share:.1f}",
        f"{r.requests_with_hit:,}",
        f"{m.get('lost_tokens', 0):,}",
        f"{m.get('images_written', 0):,}/{m.get('images_read', 0):,}",
        f"{m.get('evicted_blocks', 0):,}/{m.get('evicted_images', 0):,}",
        f"{r.boundary_moves:,}",
        f"{r.admission_us:,.0f}",
        f"{r.verified_blocks:,}+{r.verified_states:,}",
        f"{r.mismatches:,}",
    )


def replay_rows(rows: Sequence[ReplayResult]) -> list[tuple[str, ...]]:
    return [replay_row(r) for r in rows]


def sweep_rows(sw: Sweep) -> list[tuple[str, ...]]:
    """Every point of a sweep under :data:`SWEEP_COLUMNS`, by budget then policy."""
    rows: list[tuple[str, ...]] = []
    for p in sw.points:
        r = p.result
        share = r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        rows.append(
            (
                f"{p.budget_bytes:,}",
                p.policy,
                f"{p.hit_tokens:,}",
                f"{p.share_of_bound:.3f}",
                f"{100 * share:.1f}",
                f"{r.metrics.get('evicted_blocks', 0):,}",
                f"{r.boundary_moves:,}",
            )
        )
    return rows


def fleet_row(r: FleetResult) -> tuple[str, ...]:
    """One fleet under :data:`FLEET_COLUMNS`: hit tokens by where they came from
    (the engines' devices, their own tiers, the store), the store's size at
    the end and the bytes written to and read from it (each engine's share)."""
    by = r.hit_by_source
    own = sum(v for k, v in by.items() if k not in ("device", "shared"))
    traffic = r.shared_put_bytes + r.shared_get_bytes
    return (
        r.arrangement,
        f"{r.engines:,}",
        f"{r.requests:,}",
        f"{r.hit_tokens:,}",
        f"{100 * r.hit_fraction:.1f}",
        f"{by.get('device', 0):,}",
        f"{own:,}",
        f"{by.get('shared', 0):,}",
        f"{r.shared_bytes:,}" if r.shared else "-",
        f"{r.shared_put_bytes:,}" if r.shared else "-",
        f"{r.shared_get_bytes:,}" if r.shared else "-",
        f"{traffic // r.engines:,}" if r.shared else "-",
    )
