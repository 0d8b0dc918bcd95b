"""The ``kvarena`` command: ``describe`` a state layout, run the ``demo``.

Exit codes: 0 success, 1 a verification failed, 2 bad arguments or an
unknown model (with a one-line reason).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from .demo import DemoConfig, run_demo, state_fields
from .layout import checkpoint_ranges_for, layout_fingerprint, layout_rows

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
# Piped output (CI logs, files) gets wide tables instead of 80 folded columns.
console = Console(width=None if sys.stdout.isatty() else 160)

ModelArg = Annotated[
    str, typer.Argument(help="built-in model: qwen3-next-80b-a3b, mamba2-2.7b, deepseek-v4-flash")
]


def _fields_or_exit(model: str, tp: int):
    try:
        return state_fields(model, tp)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


@app.command()
def describe(
    model: ModelArg = "qwen3-next-80b-a3b",
    tp: Annotated[int, typer.Option(help="tensor-parallel size")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Print one request state's layout: each field's offset, bytes, padding."""
    fields = _fields_or_exit(model, tp)
    rows, tail, entry_bytes = layout_rows(fields)
    if as_json:
        doc = {
            "model": model,
            "tp": tp,
            "entry_bytes": entry_bytes,
            "tail_padding": tail,
            "fingerprint": layout_fingerprint(fields),
            "checkpoint_ranges": [list(r) for r in checkpoint_ranges_for(fields)],
            "fields": [
                {
                    "name": r.name,
                    "dtype": r.dtype,
                    "layers": r.layers,
                    "shape": list(r.shape),
                    "offset": r.start,
                    "bytes": r.nbytes,
                    "pad_before": r.pad_before,
                    "in_checkpoint": r.in_checkpoint,
                    "fill": repr(r.fill),
                }
                for r in rows
            ],
        }
        typer.echo(json.dumps(doc, indent=2))
        return
    table = Table(title=f"{model} state, TP {tp}")
    for col in (
        "field",
        "dtype",
        "layers x shape",
        "offset",
        "bytes",
        "pad before",
        "ckpt",
        "fill",
    ):
        table.add_column(
            col, justify="right" if col in ("offset", "bytes", "pad before") else "left"
        )
    for r in rows:
        table.add_row(
            r.name,
            r.dtype,
            f"{r.layers} x {list(r.shape)}",
            f"{r.start:,}",
            f"{r.nbytes:,}",
            f"{r.pad_before:,}",
            "yes" if r.in_checkpoint else "no",
            repr(r.fill),
        )
    console.print(table)
    console.print(f"entry: {entry_bytes:,} B ({tail:,} B tail padding)")
    console.print(f"checkpoint ranges: {checkpoint_ranges_for(fields)}")
    console.print(f"fingerprint: {layout_fingerprint(fields)}")


@app.command()
def demo(
    model: ModelArg = "qwen3-next-80b-a3b",
    tp: Annotated[int, typer.Option(help="tensor-parallel size (8 keeps it small)")] = 8,
    requests: Annotated[int, typer.Option(min=1, help="request states to materialize")] = 4,
    device: Annotated[str, typer.Option(help="torch device")] = "cpu",
    seed: Annotated[int, typer.Option(help="pattern seed")] = 0,
) -> None:
    """Materialize request states, write through kernel views, verify every byte."""
    _fields_or_exit(model, tp)
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        console.print(f"[red]error:[/red] bad device {device!r}: {exc}")
        raise typer.Exit(2) from None
    config = DemoConfig(model=model, tp=tp, requests=requests, seed=seed)
    table = Table(title=f"kvarena demo: {model}, TP {tp}, {requests} requests on {dev}")
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
