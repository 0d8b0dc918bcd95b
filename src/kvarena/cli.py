"""The kvarena command: plan a model's cache, run the demo.

Exit codes: 0 success, 1 a demo verification failed, 2 bad arguments or an
unknown model (with a one-line reason on stderr).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .checks import check_device
from .demo import DemoConfig, run_demo, state_fields
from .models import KV_DTYPES, PRESETS, STATE_DTYPES, ServingOptions, model_cache
from .pools import plan_cache
from .report import SCHEMA_VERSION, plan_report

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
# Piped output (CI logs, files) gets wide tables instead of 80 folded columns.
console = Console(width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True)

ModelArg = Annotated[
    str, typer.Argument(help=f"a preset ({', '.join(PRESETS)}) or a config.json path")
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """``"40GiB"``, ``"40G"`` (binary), ``"40GB"`` (decimal), ``"1048576"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise typer.BadParameter(
            f"{text!r} is not a size; use e.g. 40GiB, 512MiB, 80GB or a byte count"
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise typer.BadParameter(f"{text!r} must be positive")
    return value


def _fail(message: str) -> typer.Exit:
    """Print a one-line reason on stderr; exit code 2 (bad arguments, unknown model)."""
    errors.print(f"[red]error:[/red] {message}", soft_wrap=True)
    return typer.Exit(2)


def _fields_table(title: str, entry: dict) -> Table:
    table = Table(title=title, title_justify="left")
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
    for f in entry["fields"]:
        table.add_row(
            f["name"],
            f["dtype"],
            f"{f['layers']} x {f['shape']}",
            f"{f['offset']:,}",
            f"{f['bytes']:,}",
            f"{f['pad_before']:,}",
            "yes" if f["in_checkpoint"] else "no",
            f["fill"],
        )
    table.caption = f"entry {entry['entry_bytes']:,} B ({entry['tail_padding']:,} B tail padding)"
    return table


def _render_plan(r: dict) -> None:
    o = r["options"]
    console.print(
        f"[bold]{r['model']}[/bold] ({r['family']}): TP {o['tp']}, KV {o['kv_dtype']}, state {o['state_dtype']}, "
        f"block {o['block_size']} tokens, {o['spec_tokens']} speculative tokens; "
        f"{r['layers']['attention']} paged layers, {r['layers']['state']} layers holding "
        f"per-request state ({r['layers']['recurrent']} recurrent)"
    )
    console.print(
        f"KV {r['kv_bytes_per_token']:,} B per token; state {r['state_bytes_per_request']:,} B per request"
    )
    if r["page_entry"]["fields"]:
        console.print(_fields_table("PAGE block (one block of every paged layer)", r["page_entry"]))
    if r["state_entry"]["fields"]:
        console.print(_fields_table("STATE entry (one request)", r["state_entry"]))
    p = r["pools"]
    pools = Table(title="Pool plan", title_justify="left")
    for col in ("budget", "blocks", "token capacity", "state slots", "max seqs", "unused"):
        pools.add_column(col, justify="right")
    seqs = f"{p['effective_max_seqs']}" + (
        f" (asked {p['requested_max_seqs']})" if p["clamped"] else ""
    )
    pools.add_row(
        f"{p['budget_bytes']:,}",
        f"{p['blocks']:,}",
        f"{p['token_capacity']:,}",
        f"{p['state_slots']:,}",
        seqs,
        f"{p['unused_bytes']:,}",
    )
    console.print(pools)
    if r["checkpoint"]:
        c = r["checkpoint"]
        console.print(
            f"checkpoint image: {c['image_bytes']:,} B in {c['units_per_image']} PAGE units of {c['unit_bytes']:,} B "
            f"(ranges {c['ranges']})"
        )
    t = r["transfer_descriptors"]
    console.print(
        f"transfer descriptors for a {t['context_tokens']:,}-token request: kvarena {t['kvarena_best']} "
        f"(blocks in one run) to {t['kvarena_worst']} (no two blocks adjacent); "
        f"per layer per tensor {t['per_layer_best']:,} to {t['per_layer_worst']:,}"
    )
    v = r["vllm_unified"]
    if v:
        cmp = Table(
            title="Same budget: kvarena vs vLLM-style page unification", title_justify="left"
        )
        for col in (
            "",
            "attention block",
            "state page padding",
            "padding at max seqs",
            "KV token capacity",
        ):
            cmp.add_column(col, justify="right")
        cmp.add_row(
            "kvarena", f"{o['block_size']} tokens", "0 B", "0 B", f"{p['token_capacity']:,}"
        )
        cmp.add_row(
            "vLLM",
            f"{v['attention_block_tokens']} tokens",
            f"{v['state_page_padding_bytes']:,} B",
            f"{v['padding_bytes_at_max_seqs']:,} B",
            f"{v['kv_token_capacity']:,}",
        )
        console.print(cmp)
    for note in r["notes"]:
        console.print(f"note: {note}")


@app.command()
def plan(
    model: ModelArg = "qwen3-next-80b-a3b",
    memory: Annotated[str, typer.Option(help="cache budget, e.g. 40GiB")] = "40GiB",
    max_seqs: Annotated[int, typer.Option(min=1, help="requests in flight")] = 64,
    block_size: Annotated[
        int | None, typer.Option(min=1, help="tokens per PAGE block (family default)")
    ] = None,
    tp: Annotated[int, typer.Option(min=1, help="tensor-parallel size")] = 1,
    kv_dtype: Annotated[str, typer.Option(help=f"one of {', '.join(KV_DTYPES)}")] = "auto",
    state_dtype: Annotated[str, typer.Option(help=f"one of {', '.join(STATE_DTYPES)}")] = "auto",
    spec_tokens: Annotated[
        int, typer.Option(min=0, help="speculative tokens (rollback copies)")
    ] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help=f"machine-readable output (schema {SCHEMA_VERSION})")
    ] = False,
) -> None:
    """What a model's cache looks like and how much of it fits a budget."""
    try:
        budget = parse_bytes(memory)
        options = ServingOptions(
            tp=tp,
            kv_dtype=kv_dtype,
            state_dtype=state_dtype,
            block_size=block_size,
            spec_tokens=spec_tokens,
        )
        plan_ = plan_cache(model_cache(model, options), budget_bytes=budget, max_seqs=max_seqs)
        report = plan_report(plan_)
    except (ValueError, typer.BadParameter) as exc:
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _render_plan(report)


@app.command()
def demo(
    model: ModelArg = "qwen3-next-80b-a3b",
    tp: Annotated[int, typer.Option(help="tensor-parallel size (8 keeps it small)")] = 8,
    requests: Annotated[int, typer.Option(min=1, help="request states to materialize")] = 4,
    device: Annotated[str, typer.Option(help="torch device")] = "cpu",
    seed: Annotated[int, typer.Option(help="pattern seed")] = 0,
) -> None:
    """Materialize request states, write through kernel views, verify every byte."""
    try:
        state_fields(model, tp)
        dev = check_device(device)
    except (ValueError, RuntimeError) as exc:
        raise _fail(str(exc)) from None
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
