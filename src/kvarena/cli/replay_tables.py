"""The tables ``kvarena replay`` prints: one row per policy, one per tier."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from ..replay.summary import REPLAY_COLUMNS, SWEEP_COLUMNS, replay_rows, sweep_rows
from .root import console


def render_replay(model: str, budget: int, rows: list) -> None:
    table = Table(title=escape(f"kvarena replay: {model}, {budget:,} B"), title_justify="left")
    for col in REPLAY_COLUMNS:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for cells in replay_rows(rows):
        table.add_row(*(escape(c) for c in cells))
    console.print(table)
    for r in rows:
        if r.tiers:
            render_tiers(r)


def render_tiers(r: Any) -> None:
    table = Table(title="tiers (in lookup order)", title_justify="left")
    for col in (
        "tier",
        "where",
        "hit tokens",
        "images read",
        "verified",
        "objects",
        "used / capacity",
        "puts",
        "evictions",
        "failures",
        "seconds",
        "state",
    ):
        table.add_column(col, justify="left" if col in ("tier", "where", "state") else "right")
    for row in r.tiers:
        cap = row["capacity_bytes"]
        table.add_row(
            escape(str(row["tier"])),
            escape(str(row["where"])),
            f"{row['hit_tokens']:,}",
            f"{row['images_read']:,}",
            f"{r.verified_by_source.get(row['tier'], 0):,}",
            f"{row['objects']:,}",
            f"{row['used_bytes']:,} / " + (f"{cap:,}" if cap else "server's"),
            f"{row['puts']:,}",
            f"{row['evictions']:,}",
            f"{row['failures']:,}",
            f"{row['seconds']:,.1f}",
            escape(f"writes disabled: {row['disabled']}" if row["disabled"] else "ok"),
        )
    console.print(table)
    rejected = r.metrics.get("tier_rejected") or {}
    device = r.metrics.get("hit_tokens", 0) - sum(row["hit_tokens"] for row in r.tiers)
    console.print(
        f"hit tokens from the device: {device:,}; written back: "
        f"{r.metrics.get('tier_blocks_written', 0):,} blocks, "
        f"{r.metrics.get('tier_images_written', 0):,} images; drained at the end: {r.drained:,}; "
        "rejected on load: "
        + (", ".join(f"{k} {v}" for k, v in sorted(rejected.items())) if rejected else "none")
    )


def render_sweep(model: str, sw: Any) -> None:
    table = Table(
        title=escape(f"kvarena replay --sweep: {model}, bound {sw.bound.hit_tokens:,} hit tokens"),
        title_justify="left",
    )
    for col in SWEEP_COLUMNS:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for cells in sweep_rows(sw):
        table.add_row(*(escape(c) for c in cells))
    console.print(table)
