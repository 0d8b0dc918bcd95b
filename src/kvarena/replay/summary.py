"""A replay's results as rows of text: one definition of the table's columns,
rendered by the terminal (rich) and by the report page alike."""

from __future__ import annotations

from collections.abc import Sequence

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
