import importlib.util
import json

import pytest
import torch
from typer.testing import CliRunner

from kvarena import layout_fingerprint, model_cache, plan_cache
from kvarena.cli import app
from kvarena.demo import DemoConfig, run_demo, state_fields
from kvarena.layout import entry_bytes_for
from kvarena.models import PRESETS
from kvarena.transfer import nixl_available

runner = CliRunner()


def test_demo_checks_all_hold_for_every_model():
    transfer = int(nixl_available())
    hf = 2 * (importlib.util.find_spec("transformers") is not None)  # generate + prefix reuse
    for model, tp, steps in (
        ("qwen3-next-80b-a3b", 8, 11 + transfer + hf),
        ("nemotron-h-8b", 8, 11 + transfer + hf),
        # No paged layers: a plan, but no images, boundary, tiers or blocks to ship.
        ("mamba2-2.7b", 8, 8 + hf),
        ("deepseek-v4-flash", 1, 11 + transfer + hf),
    ):
        checks = list(run_demo(DemoConfig(model=model, tp=tp, requests=2), torch.device("cpu")))
        assert len(checks) == steps, [c.name for c in checks]
        assert all(c.ok for c in checks), [c for c in checks if not c.ok]
        if steps > 8 + hf:
            tiers = next(c for c in checks if c.name == "host + disk tiers")
            assert " from disk" in tiers.detail or " from host" in tiers.detail


def test_cli_demo_exits_zero_and_reports():
    result = runner.invoke(app, ["demo", "--requests", "2"])
    assert result.exit_code == 0, result.output
    # One table row per check the demo runs, each reported ok.
    names = [c.name for c in run_demo(DemoConfig(requests=2, tp=8), torch.device("cpu"))]
    rows = [line for line in result.output.splitlines() if line.startswith("│")]
    for name in names:
        row = next(r for r in rows if f"│ {name} " in r)
        assert row.split("│")[2].strip() == "ok", row
    assert len([r for r in rows if r.split("│")[2].strip() in ("ok", "FAILED")]) == len(names)


def test_cli_plan_json_matches_the_presets():
    result = runner.invoke(
        app, ["plan", "qwen3-next-80b-a3b", "--tp", "4", "--memory", "8GiB", "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    fields = state_fields("qwen3-next-80b-a3b", 4)
    assert doc["schema"] == "kvarena-plan/2"
    assert doc["state_entry"]["entry_bytes"] == entry_bytes_for(fields)
    assert doc["state_entry"]["fingerprint"] == layout_fingerprint(fields)
    assert [f["name"] for f in doc["state_entry"]["fields"]] == ["conv_state", "recurrent_state"]
    assert doc["state_entry"]["fields"][1]["offset"] == 36 * 3 * 2048 * 2
    pools = doc["pools"]
    assert pools["budget_bytes"] == 8 << 30 and pools["state_slots"] == 64
    assert pools["token_capacity"] == pools["blocks"] * 16
    assert doc["vllm_unified"]["attention_block_tokens"] % 16 == 0


@pytest.mark.parametrize(
    ("preset", "args", "block"),
    [
        ("nemotron-h-8b", [], 528),
        ("nemotron-h-8b", ["--state-dtype", "float32"], 1040),
        ("qwen3-next-80b-a3b", [], 544),
        ("qwen3-next-80b-a3b", ["--kv-dtype", "fp8"], 1072),
        ("qwen3-next-80b-a3b", ["--state-dtype", "float32"], 1056),
        ("kimi-linear-48b-a3b", [], 1920),
    ],
)
def test_plan_reproduces_vllm_unified_block_sizes(preset, args, block):
    # The attention block sizes vLLM's hybrid alignment picks (model_cache_facts.json).
    result = runner.invoke(app, ["plan", preset, "--json", *args])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["vllm_unified"]["attention_block_tokens"] == block


def test_cli_plan_tables_for_every_preset():
    for preset in PRESETS:
        result = runner.invoke(app, ["plan", preset, "--memory", "80GB", "--max-seqs", "32"])
        assert result.exit_code == 0, (preset, result.output)
        # The pool row shows the plan's own numbers, the ones a cache would hold.
        plan = plan_cache(model_cache(preset), budget_bytes=80 * 10**9, max_seqs=32)
        row = next(line for line in result.stdout.splitlines() if "80,000,000,000" in line)
        cells = [c.strip() for c in row.strip("│┃ ").split("│")]
        assert cells[1:4] == [
            f"{plan.blocks:,}",
            f"{plan.token_capacity:,}",
            f"{plan.state_slots:,}",
        ]


def test_plan_clamps_concurrency_and_says_so():
    result = runner.invoke(
        app, ["plan", "mamba2-2.7b", "--memory", "1GiB", "--max-seqs", "64", "--json"]
    )
    pools = json.loads(result.stdout)["pools"]
    assert pools["clamped"] and pools["effective_max_seqs"] == (1 << 30) // 85_950_464


def test_readme_api_tour_runs():
    import pathlib
    import runpy

    tour = pathlib.Path(__file__).parent.parent / "examples" / "api_tour.py"
    scope = runpy.run_path(str(tour))
    assert scope["k"].shape == (32, 1024, 16, 8, 128) and scope["k"][0].is_contiguous()
    assert scope["pool"].live_entries == 4


def test_checkpoint_and_pools_example_runs():
    import pathlib
    import runpy

    example = pathlib.Path(__file__).parent.parent / "examples" / "checkpoint_and_pools.py"
    scope = runpy.run_path(str(example))
    plan, cache = scope["plan"], scope["cache"]
    # 8 requests x (state + rollback copy), then grown by 4; the blocks are the plan's, less
    # those the grow took.
    assert plan.state_slots == 16 and cache.num_slots == 20
    assert cache.num_blocks == cache.geometry.blocks_below(cache.slots.first) < plan.blocks


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "nope"],
        ["demo", "nope"],
        ["demo", "llama-3.1-8b"],
        ["plan", "mamba2-2.7b", "--tp", "3"],
        ["plan", "llama-3.1-8b", "--memory", "12XB"],
        ["plan", "llama-3.1-8b", "--kv-dtype", "int3"],
        ["plan", "llama-3.1-8b", "--max-seqs", "0"],
    ],
)
def test_cli_bad_input_exits_2_with_a_one_line_reason(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert not result.stdout.strip()
    assert "error" in result.stderr.lower() or "invalid value" in result.stderr.lower()


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("40GiB", 40 << 30),
        ("40G", 40 << 30),
        ("80GB", 80 * 10**9),
        ("1.5MiB", 3 << 19),
        ("4096", 4096),
    ],
)
def test_parse_bytes(text, value):
    from kvarena.checks import parse_bytes

    assert parse_bytes(text) == value
