"""A trace over a fleet of engines (:mod:`kvarena.replay.fleet`), and its command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_replay import SMALL, synthetic_lines

from kvarena import InvalidValueError
from kvarena.pools import plan_cache
from kvarena.prefix import PrefixCache
from kvarena.prefix.records import plan_namespace
from kvarena.replay import ReplayConfig, parse_trace, replay
from kvarena.replay.fleet import (
    FleetConfig,
    fleet_points,
    parse_counts,
    parse_routers,
    point_store,
    replay_fleet,
)
from kvarena.tiers.image import object_bytes


@pytest.fixture(scope="module")
def trace():
    return parse_trace(synthetic_lines(1))


CFG = ReplayConfig(budget_bytes=8 << 20, max_seqs=2, tiers=("host:4MiB",))


def test_a_fleet_of_one_engine_is_the_single_replay(trace):
    single = replay(SMALL, trace, CFG)
    (engine,) = replay_fleet(SMALL, trace, CFG, FleetConfig(engines=1)).per_engine
    assert single.hit_tokens > 0
    for field in ("requests", "admitted", "dropped", "prompt_tokens", "boundary_moves"):
        assert getattr(engine, field) == getattr(single, field), field
    assert engine.metrics == single.metrics


def test_conversations_spread_over_engines_hit_again_through_a_store_or_a_prefix_router(
    trace, tmp_path
):
    """Round-robin scatters a conversation's turns: alone, each engine misses what
    another computed; over a shared store every hit of one engine comes back
    (from the store); a router sending each turn to the engine holding its
    prefix needs no store."""
    one = replay_fleet(SMALL, trace, CFG, FleetConfig(engines=1)).hit_tokens
    spread = replay_fleet(SMALL, trace, CFG, FleetConfig(engines=4)).hit_tokens
    store = FleetConfig(engines=4, shared=(f"disk:{tmp_path}:1GiB",))
    shared = replay_fleet(SMALL, trace, CFG, store)
    routed = replay_fleet(SMALL, trace, CFG, FleetConfig(engines=4, router="prefix"))
    assert spread < 0.5 * one
    assert shared.hit_tokens >= 0.95 * one and shared.hit_by_source["shared"] > 0
    assert routed.hit_tokens >= 0.95 * one and routed.hit_by_source["device"] == routed.hit_tokens
    assert sum(shared.hit_by_source.values()) == shared.hit_tokens
    # every request went somewhere, once
    assert shared.requests == len(trace) == sum(e.requests for e in shared.per_engine)
    assert all(e.requests > 0 for e in shared.per_engine)


@pytest.mark.parametrize("verify", [True, False])
def test_what_one_engine_computed_another_reads_from_the_store(trace, tmp_path, verify):
    """With real bytes and the stand-in model, every block and state an engine
    takes from the store (written through by whichever engine computed it) is
    checked byte for byte. Either way, bookkeeping too (images of headers
    alone), the store's traffic is what its objects weigh."""
    cfg = ReplayConfig(budget_bytes=8 << 20, max_seqs=2, tiers=("host:4MiB",), verify=verify)
    r = replay_fleet(SMALL, trace, cfg, FleetConfig(engines=3, shared=(f"disk:{tmp_path}:1GiB",)))
    if verify:
        assert sum(e.mismatches for e in r.per_engine) == 0
        from_store = sum(e.verified_by_source.get("disk", 0) for e in r.per_engine)
        states = sum(e.verified_by_source.get("disk (states)", 0) for e in r.per_engine)
        assert from_store > 100 and states > 10
        assert from_store * SMALL.block_size == r.hit_by_source["shared"]
    assert r.shared_put_bytes >= r.shared_bytes > 0
    plan = plan_cache(SMALL, budget_bytes=cfg.budget_bytes, max_seqs=cfg.max_seqs)
    ns = plan_namespace(plan).to_json()
    spec = PrefixCache(plan, torch.device("meta")).spec
    kv, state = object_bytes(ns, plan.block_bytes), object_bytes(ns, spec.image_bytes)
    assert r.shared_get_bytes == sum(  # every object read from the store, by its weight
        e.metrics["tier_hit_tokens"]["disk"] // SMALL.block_size * kv
        + e.metrics["tier_images_read"]["disk"] * state
        for e in r.per_engine
    )
    assert r.shared_objects == len(list(tmp_path.rglob("*.kvi"))) > 0


def test_a_sweep_gives_every_point_an_empty_store_of_its_own(tmp_path):
    points = fleet_points((1, 2), ("round-robin", "prefix"), (f"disk:{tmp_path}:1GiB",))
    assert [(p.arrangement, p.engines) for p in points] == [
        ("round-robin", 1),
        ("round-robin", 2),
        ("round-robin + shared", 1),
        ("round-robin + shared", 2),
        ("prefix", 1),
        ("prefix", 2),
        ("prefix + shared", 1),
        ("prefix + shared", 2),
    ]
    dirs = [p.shared[0] for p in points if p.shared]
    assert len(set(dirs)) == 4 and all(str(tmp_path) in d for d in dirs)
    # one fleet: the store as given
    (one,) = fleet_points((2,), ("prefix",), (f"disk:{tmp_path}:1GiB",))
    assert one.shared == (f"disk:{tmp_path}:1GiB",)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: FleetConfig(engines=0), "engines"),
        (lambda: FleetConfig(engines=2, router="random"), "round-robin, prefix"),
        (lambda: FleetConfig(engines=2, shared="host:1GiB"), "tuple of tier specs"),
        (lambda: parse_counts("4,2"), "ascending"),
        (lambda: parse_counts("two"), "'two' is not a count"),
        (lambda: parse_routers("prefix,prefix"), "twice"),
        (lambda: point_store(("redis://127.0.0.1:6379",), 2, "prefix"), "host:SIZE or disk"),
        (lambda: replay_fleet(SMALL, [], CFG, "4"), "FleetConfig"),
    ],
)
def test_bad_fleets_are_refused_naming_the_value(call, words):
    with pytest.raises(InvalidValueError, match=words):
        call()


def test_the_fleet_command(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(synthetic_lines(4, conversations=12)) + "\n")
    base = [sys.executable, "-m", "kvarena", "replay", str(path), "--tp", "8"]
    base += ["--memory", "512MiB", "--max-seqs", "4", "--tier", "host:64MiB"]
    picture = tmp_path / "fleet.svg"
    args = [*base, "--engines", "1,2", "--shared", f"disk:{tmp_path / 'store'}:1GiB"]
    out = subprocess.run(
        [*args, "--json", "--picture", str(picture)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == "kvarena-replay-fleet/1"
    rows = [(f["arrangement"], f["engines"]) for f in doc["fleets"]]
    assert rows == [
        (a, n)
        for a in ("round-robin", "round-robin + shared", "prefix", "prefix + shared")
        for n in (1, 2)
    ]
    assert all(f["requests"] == len(path.read_text().splitlines()) for f in doc["fleets"])
    svg = picture.read_text()
    assert all(f'id="fleet-{i}"' in svg for i in range(4)) and 'id="fleet-4"' not in svg
    table = subprocess.run(
        [*base, "--engines", "2", "--router", "prefix"], capture_output=True, text=True, timeout=300
    )
    assert table.returncode == 0 and "prefix" in table.stdout and "arrangement" in table.stdout
    for bad, words in (
        (["--engines", "2", "--compare"], "--compare replays one engine"),
        (["--router", "prefix"], "give --engines"),
        (["--engines", "0"], "engines"),
        (["--engines", "2", "--router", "nearest"], "round-robin, prefix"),
    ):
        out = subprocess.run([*base, *bad], capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert words in out.stderr
