"""``kvarena demo``: materialize real states and verify every byte."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..checks import check_count, check_device, parse_bytes
from ..demo import DemoConfig, run_demo, state_fields
from ..models import ServingOptions, model_cache
from ..pools import plan_cache
from .plan_command import write_plan_picture
from .root import app, console
from .serving import ModelArg

PICTURE_BUDGET = "80GiB"
PICTURE_SEQS = 64


@app.command()
def demo(
    model: ModelArg = "qwen3-next-80b-a3b",
    tp: Annotated[int, typer.Option(help="tensor-parallel size (8 keeps it small)")] = 8,
    requests: Annotated[int, typer.Option(help="request states to materialize")] = 4,
    device: Annotated[str, typer.Option(help="torch device")] = "cpu",
    seed: Annotated[int, typer.Option(help="pattern seed")] = 0,
    picture: Annotated[
        str | None,
        typer.Option(
            help=f"at the end, draw the model's memory map at {PICTURE_BUDGET} and "
            f"{PICTURE_SEQS} requests (.svg or .png)"
        ),
    ] = None,
) -> None:
    """Materialize request states, write through kernel views, verify every byte."""
    check_count(requests, "--requests", lo=1, hi=1024)
    state_fields(model, tp)
    dev = check_device(device)
    path = None
    if picture is not None:
        from ..pictures.files import PICTURE_FORMATS, check_output, require_matplotlib

        path = check_output(picture, "--picture", PICTURE_FORMATS)
        require_matplotlib()
    config = DemoConfig(model=model, tp=tp, requests=requests, seed=seed)
    table = Table(title=escape(f"kvarena demo: {model}, TP {tp}, {requests} requests on {dev}"))
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    failed = 0
    with console.status("working...") as status:
        for check in run_demo(config, dev):
            status.update(f"verified: {check.name}")
            failed += not check.ok
            table.add_row(
                check.name, "[green]ok[/green]" if check.ok else "[red]FAILED[/red]", check.detail
            )
    console.print(table)
    if failed:
        console.print(f"[red]{failed} check(s) failed[/red]")
        raise typer.Exit(1)
    console.print("[green]all checks passed[/green]")
    if path is not None:
        plan_ = plan_cache(
            model_cache(model, ServingOptions(tp=tp)),
            budget_bytes=parse_bytes(PICTURE_BUDGET),
            max_seqs=PICTURE_SEQS,
        )
        write_plan_picture(plan_, path)
        console.print(
            f"memory map of {escape(model)} (TP {tp}, {PICTURE_BUDGET}, {PICTURE_SEQS} requests) "
            f"written to {escape(str(path.resolve()))} (kvarena plan {escape(model)} --tp {tp} "
            f"--memory {PICTURE_BUDGET} --picture FILE draws it too)"
        )
