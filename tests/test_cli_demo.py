import json

import pytest
import torch
from typer.testing import CliRunner

from kvarena import entry_bytes_for, layout_fingerprint
from kvarena.cli import app
from kvarena.demo import DemoConfig, run_demo, state_fields

runner = CliRunner()


def test_demo_checks_all_hold_for_every_model():
    for model, tp in (("qwen3-next-80b-a3b", 8), ("mamba2-2.7b", 8), ("deepseek-v4-flash", 1)):
        checks = list(run_demo(DemoConfig(model=model, tp=tp, requests=2), torch.device("cpu")))
        assert len(checks) == 10
        assert all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_cli_demo_exits_zero_and_reports():
    result = runner.invoke(app, ["demo", "--requests", "2"])
    assert result.exit_code == 0, result.output
    assert "all checks passed" in result.output and "FAILED" not in result.output


def test_cli_describe_json():
    result = runner.invoke(app, ["describe", "qwen3-next-80b-a3b", "--tp", "4", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    fields = state_fields("qwen3-next-80b-a3b", 4)
    assert doc["entry_bytes"] == entry_bytes_for(fields)
    assert doc["fingerprint"] == layout_fingerprint(fields)
    assert [f["name"] for f in doc["fields"]] == ["conv_state", "recurrent_state"]
    assert doc["fields"][1]["offset"] == 36 * 3 * 2048 * 2


@pytest.mark.parametrize(
    "args", [["describe", "nope"], ["demo", "nope"], ["describe", "mamba2-2.7b", "--tp", "3"]]
)
def test_cli_bad_input_exits_2_with_reason(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "error:" in result.output


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
    assert scope["plan"].of("gdn").entries == 16 and scope["cache"].num_slots == 20
