"""``kvarena plan``: a model's cache before any GPU is touched, as tables or JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..models import model_cache
from ..pools import CachePlan, plan_cache
from ..report import SCHEMA_VERSION, plan_report
from .root import app, console
from .serving import BlockSize, KvDtype, MaxSeqs, ModelArg, SpecTokens, StateDtype, Tp, serving


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
        f"[bold]{escape(r['model'])}[/bold] ({r['family']}): TP {o['tp']}, KV {o['kv_dtype']}, state {o['state_dtype']}, "
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
        console.print(f"note: {escape(note)}")


@app.command()
def plan(
    model: ModelArg = "qwen3-next-80b-a3b",
    memory: Annotated[str, typer.Option(help="cache budget, e.g. 40GiB")] = "40GiB",
    max_seqs: MaxSeqs = 64,
    block_size: BlockSize = None,
    tp: Tp = 1,
    kv_dtype: KvDtype = "auto",
    state_dtype: StateDtype = "auto",
    spec_tokens: SpecTokens = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help=f"machine-readable output (schema {SCHEMA_VERSION})")
    ] = False,
    picture: Annotated[
        str | None,
        typer.Option(
            help="the memory map drawn to scale (beside vLLM's for hybrids): .svg or .png"
        ),
    ] = None,
) -> None:
    """What a model's cache looks like and how much of it fits a budget."""
    budget, options = serving(memory, max_seqs, tp, kv_dtype, state_dtype, block_size, spec_tokens)
    path = None
    if picture is not None:
        from ..pictures.files import PICTURE_FORMATS, check_output, require_matplotlib

        path = check_output(picture, "--picture", PICTURE_FORMATS)
        require_matplotlib()
    plan_ = plan_cache(model_cache(model, options), budget_bytes=budget, max_seqs=max_seqs)
    report = plan_report(plan_)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _render_plan(report)
    if path is not None:
        write_plan_picture(plan_, path)
        if not as_json:
            console.print(f"memory map written to {escape(str(path))}")


def write_plan_picture(plan_: CachePlan, path: Path) -> None:
    """Draw ``plan_``'s memory map to ``path`` (the one drawing ``plan`` and ``demo`` share)."""
    from ..pictures.bands import memory_map
    from ..pictures.memory_map import write_memory_map

    write_memory_map(memory_map(plan_), path)
