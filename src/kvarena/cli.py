"""The kvarena command: plan a model's cache, run the demo.

Exit codes: 0 success, 1 a demo verification failed, 2 bad arguments or an
unknown model (with a one-line reason on stderr, never a traceback).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

try:  # typer >= 0.20 vendors click; older typer depends on it
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - depends on the typer release
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[no-redef,assignment]

from .checks import check_count, check_device, parse_bytes
from .demo import DemoConfig, run_demo, state_fields
from .errors import Error, InvalidValueError
from .models import KV_DTYPES, PRESETS, STATE_DTYPES, ServingOptions, model_cache
from .pools import plan_cache
from .pools.plan import MAX_SEQS
from .prefix import CheckpointPolicy
from .report import SCHEMA_VERSION, plan_report


def _one_line(message: str) -> None:
    """The reason, on stderr, as one line and verbatim (no markup: a model name
    with ``[...]`` in it is printed as given)."""
    sys.stderr.write("error: " + " ".join(str(message).split()) + "\n")
    sys.stderr.flush()


class _OneLineErrors(TyperGroup):
    """Every refusal, whether typer's (a bad option, a value out of range) or
    kvarena's, ends as one line on stderr and exit code 2; exit 1 stays for a
    verification that failed."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            kwargs["standalone_mode"] = False  # refusals come back here as exceptions
            code = super().main(*args, **kwargs)
        except NoArgsIsHelpError as exc:
            sys.stdout.write(exc.format_message() + "\n")
            code = 2
        except ClickException as exc:
            _one_line(exc.format_message())
            code = 2
        except typer.Abort:
            _one_line("aborted")
            code = 2
        except RecursionError:
            _one_line("input nested too deeply")
            code = 2
        except Exception as exc:
            # A kvarena.Error names the value and the legal range; anything
            # else is still one line, with its type so a report can name it.
            _one_line(str(exc) if isinstance(exc, Error) else f"{type(exc).__name__}: {exc}")
            code = 2
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, cls=_OneLineErrors)
# Piped output (CI logs, files) gets wide tables instead of 80 folded columns.
console = Console(width=None if sys.stdout.isatty() else 160)

# The serving options, shared by every command that plans a cache.
MaxSeqs = Annotated[int, typer.Option(help="requests in flight")]
BlockSize = Annotated[int | None, typer.Option(help="tokens per PAGE block (family default)")]
Tp = Annotated[int, typer.Option(help="tensor-parallel size")]
KvDtype = Annotated[str, typer.Option(help=f"one of {', '.join(KV_DTYPES)}")]
StateDtype = Annotated[str, typer.Option(help=f"one of {', '.join(STATE_DTYPES)}")]
SpecTokens = Annotated[int, typer.Option(help="speculative tokens (rollback copies)")]

ModelArg = Annotated[
    str, typer.Argument(help=f"a preset ({', '.join(PRESETS)}) or a config.json path")
]


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


def _serving(
    memory: str,
    max_seqs: int,
    tp: int,
    kv_dtype: str,
    state_dtype: str,
    block_size: int | None,
    spec_tokens: int,
) -> tuple[int, ServingOptions]:
    """The budget and serving options every planning command takes, checked."""
    budget = parse_bytes(memory)
    check_count(max_seqs, "--max-seqs", lo=1, hi=MAX_SEQS)
    options = ServingOptions(
        tp=tp,
        kv_dtype=kv_dtype,
        state_dtype=state_dtype,
        block_size=block_size,
        spec_tokens=spec_tokens,
    )
    return budget, options


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
) -> None:
    """What a model's cache looks like and how much of it fits a budget."""
    budget, options = _serving(memory, max_seqs, tp, kv_dtype, state_dtype, block_size, spec_tokens)
    plan_ = plan_cache(model_cache(model, options), budget_bytes=budget, max_seqs=max_seqs)
    report = plan_report(plan_)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _render_plan(report)


@app.command()
def demo(
    model: ModelArg = "qwen3-next-80b-a3b",
    tp: Annotated[int, typer.Option(help="tensor-parallel size (8 keeps it small)")] = 8,
    requests: Annotated[int, typer.Option(help="request states to materialize")] = 4,
    device: Annotated[str, typer.Option(help="torch device")] = "cpu",
    seed: Annotated[int, typer.Option(help="pattern seed")] = 0,
) -> None:
    """Materialize request states, write through kernel views, verify every byte."""
    check_count(requests, "--requests", lo=1, hi=1024)
    state_fields(model, tp)
    dev = check_device(device)
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


@app.command()
def replay(
    trace: Annotated[
        str, typer.Argument(help="a trace file: Mooncake JSONL or plain tokens JSONL")
    ],
    model: Annotated[
        str, typer.Option(help="a preset or a config.json path")
    ] = "qwen3-next-80b-a3b",
    memory: Annotated[str, typer.Option(help="cache budget, e.g. 80GiB")] = "80GiB",
    max_seqs: MaxSeqs = 64,
    block_size: BlockSize = None,
    tp: Tp = 1,
    kv_dtype: KvDtype = "auto",
    state_dtype: StateDtype = "auto",
    spec_tokens: SpecTokens = 0,
    checkpoint: Annotated[
        str, typer.Option(help="where states are kept: end, end:N, interval:N, branch (combined)")
    ] = "end,interval:8192,branch",
    limit: Annotated[int | None, typer.Option(help="replay only the first N requests")] = None,
    prefill_rate: Annotated[float, typer.Option(help="prefill tokens per second")] = 20_000.0,
    decode_rate: Annotated[float, typer.Option(help="decode tokens per second per request")] = 50.0,
    verify: Annotated[
        bool, typer.Option("--verify", help="real bytes and a stand-in model; check every hit")
    ] = False,
    compare: Annotated[
        bool, typer.Option("--compare", help="also vLLM align, no state reuse, KV only, infinite")
    ] = False,
    tier: Annotated[
        list[str] | None,
        typer.Option(
            "--tier",
            help="a tier below the device, in order (repeat): host:SIZE, disk:DIR:SIZE, "
            "redis://HOST:PORT",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Replay a request trace through the real prefix cache and pools."""
    from .replay import ReplayConfig, load_trace
    from .replay import compare as compare_policies
    from .replay import replay as run
    from .report import vllm_unification

    budget, options = _serving(memory, max_seqs, tp, kv_dtype, state_dtype, block_size, spec_tokens)
    if limit is not None:
        check_count(limit, "--limit", lo=1)
    for name, rate in (("--prefill-rate", prefill_rate), ("--decode-rate", decode_rate)):
        if not 0 < rate < 1e12:
            raise InvalidValueError(f"{name} must be a positive rate, got {rate}")
    m = model_cache(model, options)
    cfg = ReplayConfig(
        budget_bytes=budget,
        max_seqs=max_seqs,
        policy=CheckpointPolicy.parse(checkpoint),
        prefill_tokens_per_s=prefill_rate,
        decode_tokens_per_s=decode_rate,
        verify=verify,
        tiers=tuple(tier or ()),
    )
    if compare and cfg.tiers:
        raise InvalidValueError(
            "--compare and --tier together would run every policy over the same tiers; "
            "use one or the other"
        )
    requests = load_trace(trace, limit=limit)
    if compare:
        v = vllm_unification(m, budget, max_seqs)
        vm = (
            model_cache(model, replace_options(options, v["attention_block_tokens"])) if v else None
        )
        rows = compare_policies(m, requests, cfg, vllm_model=vm)
    else:
        rows = [run(m, requests, cfg)]
    mismatches = sum(r.mismatches for r in rows)
    if as_json:
        doc = {
            "schema": "kvarena-replay/1",
            "trace": trace,
            "model": m.name,
            "budget_bytes": budget,
            "max_seqs": max_seqs,
            "block_size": m.block_size,
            "checkpoint": cfg.policy.describe(),
            "verify": verify,
            "tiers": list(cfg.tiers),
            "results": [r.to_dict() for r in rows],
        }
        typer.echo(json.dumps(doc, indent=2))
    else:
        _render_replay(m.name, budget, rows)
    if mismatches:
        _one_line(f"{mismatches} restored blocks or states differ from the stand-in model")
        raise typer.Exit(1)


def replace_options(options: ServingOptions, block_size: int) -> ServingOptions:
    return dataclasses.replace(options, block_size=block_size)


def _render_replay(model: str, budget: int, rows: list) -> None:
    table = Table(title=escape(f"kvarena replay: {model}, {budget:,} B"), title_justify="left")
    for col in (
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
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        d = r.to_dict()
        m = r.metrics
        table.add_row(
            escape(r.label),
            f"{r.requests:,}",
            f"{r.hit_tokens:,}",
            f"{100 * d['hit_fraction']:.1f}",
            f"{r.requests_with_hit:,}",
            f"{m.get('lost_tokens', 0):,}",
            f"{m.get('images_written', 0):,}/{m.get('images_read', 0):,}",
            f"{m.get('evicted_blocks', 0):,}/{m.get('evicted_images', 0):,}",
            f"{r.boundary_moves:,}",
            f"{r.admission_us:,.0f}",
            f"{r.verified_blocks:,}+{r.verified_states:,}",
            f"{r.mismatches:,}",
        )
    console.print(table)
    for r in rows:
        if r.tiers:
            _render_tiers(r)


def _render_tiers(r: Any) -> None:
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


def _one_line_warning(
    message: Warning | str, category: type[Warning], *args: Any, **kw: Any
) -> str:
    return f"kvarena: warning: {message}\n"


def main() -> None:
    # A tier that fails mid-run warns once and serving goes on: one line, like a refusal.
    warnings.formatwarning = _one_line_warning
    app()


if __name__ == "__main__":
    main()
