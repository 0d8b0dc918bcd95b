"""What ``kvarena replay`` writes besides its table: the sweep, its budget curve,
a replay's timeline and the report page.

Every output is checked before the trace is read (:func:`outputs`: a format
the picture can be, a folder that can be written, a sweep list that is
sorted and fits a request at every budget), so a bad option costs one line,
no replay, and no half-written file. matplotlib is imported only here, and
only when something is drawn.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import InvalidValueError
from ..models import ModelCache
from ..pools import plan_cache
from ..prefix.records import plan_namespace
from ..replay.run import ReplayConfig, ReplayResult
from ..replay.summary import REPLAY_COLUMNS, SWEEP_COLUMNS, replay_rows, sweep_rows
from ..replay.sweep import Sweep, parse_budgets, plan_sweep, sweep
from .replay_tables import render_sweep


@dataclass(frozen=True, kw_only=True)
class Outputs:
    """The checked output options of one ``kvarena replay``."""

    budgets: tuple[int, ...] = ()
    picture: Path | None = None
    timeline: Path | None = None
    report: Path | None = None

    @property
    def wants_timeline(self) -> bool:
        """A single replay records its timeline for the picture or the page."""
        return not self.budgets and (self.timeline is not None or self.report is not None)


def outputs(
    *, sweep: str | None, picture: str | None, timeline: str | None, report: str | None
) -> Outputs:
    from ..pictures.files import (
        PICTURE_FORMATS,
        REPORT_FORMATS,
        check_output,
        require_matplotlib,
    )

    budgets = parse_budgets(sweep) if sweep is not None else ()
    if picture is not None and not budgets:
        raise InvalidValueError(
            "--picture draws the budget curve of a --sweep; for one replay use --timeline"
        )
    if timeline is not None and budgets:
        raise InvalidValueError("--timeline draws one replay; it cannot be combined with --sweep")
    paths = {
        "--picture": picture and check_output(picture, "--picture", PICTURE_FORMATS),
        "--timeline": timeline and check_output(timeline, "--timeline", PICTURE_FORMATS),
        "--report": report and check_output(report, "--report", REPORT_FORMATS),
    }
    # No two of these can name one file: --picture and --timeline never go
    # together, and only --report writes .html.
    if any(paths.values()):
        require_matplotlib()
    return Outputs(
        budgets=budgets,
        picture=paths["--picture"] or None,
        timeline=paths["--timeline"] or None,
        report=paths["--report"] or None,
    )


def json_head(schema: str, trace: str, m: ModelCache, cfg: ReplayConfig) -> dict[str, Any]:
    """What every ``kvarena replay --json`` document opens with: what was replayed how."""
    return {
        "schema": schema,
        "trace": trace,
        "model": m.name,
        "max_seqs": cfg.max_seqs,
        "block_size": m.block_size,
        "checkpoint": cfg.policy.describe(),
    }


def check_sweep(
    m: ModelCache,
    cfg: ReplayConfig,
    budgets: tuple[int, ...],
    *,
    compare: bool,
    vllm_model: ModelCache | None,
) -> None:
    """Plan every point first: a budget that fits no request is refused here."""
    plan_sweep(m, cfg, budgets, compare=compare, vllm_model=vllm_model)


def _identity(trace: str, m: ModelCache, cfg: ReplayConfig, results: list[ReplayResult]) -> list:
    from ..pictures.report_page import Section, file_identity

    plan = plan_cache(m, budget_bytes=cfg.budget_bytes, max_seqs=cfg.max_seqs)
    o = m.options
    first = results[0]
    trace_facts = (
        *file_identity(trace),
        ("requests", f"{first.requests:,}"),
        ("prompt tokens", f"{first.prompt_tokens:,}"),
    )
    model_facts = (
        ("model", m.name),
        ("family", m.family),
        (
            "options",
            f"TP {o.tp}, KV {o.kv_dtype}, state {o.state_dtype}, "
            f"{o.spec_tokens} speculative tokens",
        ),
        ("block size", f"{m.block_size} tokens"),
        ("PAGE fingerprint", plan.page_fingerprint or "(no paged layers)"),
        ("STATE fingerprint", plan.state_fingerprint or "(no state)"),
        ("namespace", plan_namespace(plan).digest.hex()),
        ("checkpoint policy", cfg.policy.describe()),
        ("max seqs", f"{cfg.max_seqs}"),
    )
    return [
        Section(heading="Trace", facts=trace_facts),
        Section(heading="Model", facts=model_facts),
    ]


def _memory_map_section(m: ModelCache, cfg: ReplayConfig) -> Any:
    from ..pictures.bands import memory_map
    from ..pictures.canvas import figure_bytes
    from ..pictures.memory_map import draw_memory_map
    from ..pictures.report_page import Section

    plan = plan_cache(m, budget_bytes=cfg.budget_bytes, max_seqs=cfg.max_seqs)
    svg = figure_bytes(draw_memory_map(memory_map(plan)), "svg").decode()
    return Section(
        heading="Memory map",
        pictures=((f"the cache at {cfg.budget_bytes:,} B, drawn to scale", svg),),
    )


def _write_report(path: Path, title: str, sections: list) -> None:
    from ..pictures.report_page import write_page

    write_page(
        path,
        title=title,
        command=shlex.join(["kvarena", *sys.argv[1:]]),
        sections=sections,
    )


def write_replay_outputs(
    trace: str, m: ModelCache, cfg: ReplayConfig, rows: list[ReplayResult], out: Outputs
) -> None:
    """The timeline picture and the report page of a single replay (or a comparison)."""
    if out.timeline is None and out.report is None:
        return
    from ..pictures.canvas import figure_bytes, save
    from ..pictures.curves import draw_timeline
    from ..pictures.report_page import Section, Table

    title = f"{rows[0].label}: {m.name}, {cfg.budget_bytes:,} B"
    fig = draw_timeline(rows[0], title=title)
    if out.timeline is not None:
        save(fig, out.timeline)
    if out.report is not None:
        svg = figure_bytes(fig, "svg").decode()
        results = Section(
            heading="Replay",
            tables=(
                Table(caption="per policy", columns=REPLAY_COLUMNS, rows=tuple(replay_rows(rows))),
            ),
            pictures=((f"{rows[0].label} over the trace's time", svg),),
        )
        sections = [*_identity(trace, m, cfg, rows), results, _memory_map_section(m, cfg)]
        _write_report(out.report, f"kvarena replay: {trace} on {m.name}", sections)


def run_sweep(
    trace: str,
    m: ModelCache,
    requests: list,
    cfg: ReplayConfig,
    out: Outputs,
    *,
    compare: bool,
    vllm_model: ModelCache | None,
    workers: int | None,
    as_json: bool,
) -> Sweep:
    """Run the sweep with a progress bar on stderr, then print and draw it."""
    err = Console(stderr=True)
    with Progress(
        TextColumn("sweep"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("sweep", total=None)
        sw = sweep(
            m,
            requests,
            cfg,
            out.budgets,
            compare=compare,
            vllm_model=vllm_model,
            workers=workers,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    if as_json:
        doc = {**json_head("kvarena-sweep/1", trace, m, cfg), **sw.to_dict()}
        typer.echo(json.dumps(doc, indent=2))
    else:
        render_sweep(m.name, sw)
    if out.picture is None and out.report is None:
        return sw
    from ..pictures.canvas import figure_bytes, save
    from ..pictures.curves import draw_budget_curve
    from ..pictures.report_page import Section, Table

    fig = draw_budget_curve(sw, title=f"{m.name}: hit tokens against the budget ({trace})")
    if out.picture is not None:
        save(fig, out.picture)
    if out.report is not None:
        results = Section(
            heading="Budget sweep",
            tables=(
                Table(
                    caption="per budget and policy",
                    columns=SWEEP_COLUMNS,
                    rows=tuple(sweep_rows(sw)),
                ),
            ),
            pictures=(
                (
                    "hit tokens as a share of the infinite-cache bound",
                    figure_bytes(fig, "svg").decode(),
                ),
            ),
        )
        first = [p.result for p in sw.points]
        sections = [*_identity(trace, m, cfg, first), results, _memory_map_section(m, cfg)]
        _write_report(out.report, f"kvarena replay: {trace} on {m.name}", sections)
    return sw
