"""``kvarena replay``: a request trace through the real prefix cache and pools."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer

from ..checks import check_count
from ..errors import InvalidValueError
from ..models import ServingOptions, model_cache
from ..prefix import DEFAULT_POLICY, CheckpointPolicy
from ..tiers.redact import redacted
from .replay_fleet import check_fleet, run_fleets
from .replay_outputs import check_sweep, json_head, outputs, run_sweep, write_replay_outputs
from .replay_tables import render_replay
from .root import _one_line, app
from .serving import BlockSize, KvDtype, MaxSeqs, SpecTokens, StateDtype, Tp, serving


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
        str,
        typer.Option(
            help="where states are kept: end, end:N, interval:N, branch, learn (combined)"
        ),
    ] = DEFAULT_POLICY,
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
    sweep: Annotated[
        str | None,
        typer.Option(
            help="replay at each budget of a comma list (4GiB,8GiB,...), in bookkeeping mode; "
            "every policy of --compare at each, the infinite bound as a line"
        ),
    ] = None,
    picture: Annotated[
        str | None,
        typer.Option(
            help="the sweep's budget curve (with --engines: hits by engine count): .svg/.png"
        ),
    ] = None,
    timeline: Annotated[
        str | None,
        typer.Option(
            help="one replay's occupancy, boundary, hits and evictions over time: .svg/.png"
        ),
    ] = None,
    report: Annotated[
        str | None, typer.Option(help="a self-contained .html page: pictures, tables, identity")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="sweep replays run at once (default: the cores)")
    ] = None,
    engines: Annotated[
        str | None,
        typer.Option(
            help="a fleet: N engines, each with its own device cache and --tier tiers (a comma "
            "list, 1,2,4,8, replays each count; with --picture, hits by count)"
        ),
    ] = None,
    router: Annotated[
        str | None,
        typer.Option(
            help="with --engines: round-robin or prefix (the engine holding the longest "
            "prefix), or both as a comma list (a sweep's default)"
        ),
    ] = None,
    shared: Annotated[
        list[str] | None,
        typer.Option(
            "--shared",
            help="with --engines: a store below every engine (repeat): host:SIZE, "
            "disk:DIR:SIZE, redis://HOST:PORT",
        ),
    ] = None,
) -> None:
    """Replay a request trace through the real prefix cache and pools."""
    from ..models.vllm_pages import VllmPages
    from ..replay import ReplayConfig, load_trace
    from ..replay import compare as compare_policies
    from ..replay import replay as run

    budget, options = serving(memory, max_seqs, tp, kv_dtype, state_dtype, block_size, spec_tokens)
    if limit is not None:
        check_count(limit, "--limit", lo=1)
    if workers is not None:
        check_count(workers, "--workers", lo=1, hi=1024)
    for name, rate in (("--prefill-rate", prefill_rate), ("--decode-rate", decode_rate)):
        if not 0 < rate < 1e12:
            raise InvalidValueError(f"{name} must be a positive rate, got {rate}")
    fleets = None
    if engines is not None:
        fleets, fleet_picture = check_fleet(
            engines=engines,
            router=router,
            shared=shared,
            picture=picture,
            refused={
                "--compare": compare,
                "--sweep": sweep is not None,
                "--timeline": timeline is not None,
                "--report": report is not None,
            },
        )
    elif router is not None or shared:
        raise InvalidValueError("--router and --shared place a fleet's engines; give --engines")
    out = outputs(
        sweep=sweep, picture=None if fleets else picture, timeline=timeline, report=report
    )
    m = model_cache(model, options)
    cfg = ReplayConfig(
        budget_bytes=out.budgets[0] if out.budgets else budget,
        max_seqs=max_seqs,
        policy=CheckpointPolicy.parse(checkpoint),
        prefill_tokens_per_s=prefill_rate,
        decode_tokens_per_s=decode_rate,
        verify=verify,
        tiers=tuple(tier or ()),
        timeline=out.wants_timeline,
    )
    if compare and cfg.tiers:
        raise InvalidValueError(
            "--compare and --tier together would run every policy over the same tiers; "
            "use one or the other"
        )
    # A sweep draws a curve for every policy of the comparison, --compare or not.
    compare = compare or bool(out.budgets)
    v = VllmPages.of(m, cfg.budget_bytes, max_seqs) if compare else None
    vm = model_cache(model, replace_options(options, v.attention_block_tokens)) if v else None
    if out.budgets:
        check_sweep(m, cfg, out.budgets, compare=compare, vllm_model=vm)
    requests = load_trace(trace, limit=limit)
    if fleets is not None:
        head = {
            **json_head("kvarena-replay-fleet/1", trace, m, cfg),
            "budget_bytes": cfg.budget_bytes,
            "tiers": [redacted(t) for t in cfg.tiers],
        }
        run_fleets(
            trace, m, requests, cfg, fleets, picture=fleet_picture, as_json=as_json, head=head
        )
        return
    if out.budgets:
        run_sweep(
            trace,
            m,
            requests,
            cfg,
            out,
            compare=compare,
            vllm_model=vm,
            workers=workers,
            as_json=as_json,
        )
        return
    if compare:
        rows = compare_policies(m, requests, cfg, vllm_model=vm)
    else:
        rows = [run(m, requests, cfg)]
    mismatches = sum(r.mismatches for r in rows)
    if as_json:
        doc = {
            **json_head("kvarena-replay/1", trace, m, cfg),
            "budget_bytes": cfg.budget_bytes,
            "verify": verify,
            "tiers": [redacted(t) for t in cfg.tiers],
            "results": [r.to_dict() for r in rows],
        }
        typer.echo(json.dumps(doc, indent=2))
    else:
        render_replay(m.name, cfg.budget_bytes, rows)
    write_replay_outputs(trace, m, cfg, rows, out)
    if mismatches:
        _one_line(f"{mismatches} restored blocks or states differ from the stand-in model")
        raise typer.Exit(1)


def replace_options(options: ServingOptions, block_size: int) -> ServingOptions:
    return dataclasses.replace(options, block_size=block_size)
