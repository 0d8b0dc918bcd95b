"""``kvarena replay --engines``: one trace over a fleet of engines, its table,
JSON and picture (:mod:`kvarena.replay.fleet`).

Every option is checked before the trace is read, as the single replay's are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import InvalidValueError
from ..models import ModelCache
from ..replay.fleet import (
    ROUTERS,
    FleetConfig,
    FleetResult,
    fleet_points,
    parse_counts,
    parse_routers,
    replay_fleet,
)
from ..replay.run import ReplayConfig
from ..replay.summary import FLEET_COLUMNS, fleet_row
from ..tiers.redact import redacted
from .root import console


def check_fleet(
    *,
    engines: str,
    router: str | None,
    shared: list[str] | None,
    picture: str | None,
    refused: dict[str, bool],
) -> tuple[list[FleetConfig], Path | None]:
    """The fleets ``--engines``, ``--router`` and ``--shared`` ask for, and the
    picture's path; the options a fleet cannot take refused by name."""
    from ..pictures.files import PICTURE_FORMATS, check_output, require_matplotlib

    for name, given in refused.items():
        if given:
            raise InvalidValueError(
                f"{name} replays one engine; it cannot be combined with --engines"
            )
    counts = parse_counts(engines)
    routers = parse_routers(router) if router is not None else None
    if routers is None:  # a sweep compares both routers; one fleet is balanced plainly
        routers = ROUTERS if len(counts) > 1 or picture else ("round-robin",)
    points = fleet_points(counts, routers, tuple(shared or ()))
    path = None
    if picture is not None:
        path = check_output(picture, "--picture", PICTURE_FORMATS)
        require_matplotlib()
    return points, path


def run_fleets(
    trace: str,
    model: ModelCache,
    requests: list[Any],
    cfg: ReplayConfig,
    points: list[FleetConfig],
    *,
    picture: Path | None,
    as_json: bool,
    head: dict[str, Any],
) -> None:
    """Replay every fleet, one after another, and show what each did."""
    from rich.progress import Progress

    results: list[FleetResult] = []
    with Progress(console=console, transient=True, disable=as_json) as progress:
        task = progress.add_task("fleets", total=len(points))
        for p in points:
            results.append(replay_fleet(model, requests, cfg, p))
            progress.advance(task)
    if as_json:
        doc = {**head, "fleets": [r.to_dict() for r in results]}
        typer.echo(json.dumps(doc, indent=2))
    else:
        render_fleets(model.name, cfg, results)
    if picture is not None:
        from ..pictures.canvas import save
        from ..pictures.fleet import draw_fleet_curve

        title = f"{model.name}: {len(requests):,} requests of {Path(trace).name}"
        save(draw_fleet_curve(results, title=title), picture)
    mismatches = sum(e.mismatches for r in results for e in r.per_engine)
    if mismatches:
        raise typer.Exit(1)


def render_fleets(model: str, cfg: ReplayConfig, results: list[FleetResult]) -> None:
    own = ", ".join(redacted(t) for t in cfg.tiers) or "none"
    table = Table(
        title=escape(
            f"kvarena replay --engines: {model}, {cfg.budget_bytes:,} B a device, own tiers: {own}"
        ),
        title_justify="left",
    )
    for col in FLEET_COLUMNS:
        table.add_column(col, justify="left" if col == "arrangement" else "right")
    for r in results:
        table.add_row(*(escape(c) for c in fleet_row(r)))
    console.print(table)
    stores = sorted({r.shared for r in results if r.shared})
    if stores:
        console.print(escape("store: " + "; ".join(stores)))
