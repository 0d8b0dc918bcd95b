"""Bad arguments and bad configs through the real `kvarena` command: exit 2, one line
on stderr naming the problem, never a traceback; exit 1 only for a failed verification."""

import json
import subprocess
import sys

import torch

from kvarena.models import load_config

QWEN = load_config("qwen3-next-80b-a3b")[1]
GEMMA = load_config("gemma-3-27b")[1]
MAMBA = load_config("mamba2-2.7b")[1]
LLAMA = load_config("llama-3.1-8b")[1]
GPT_OSS = load_config("gpt-oss-20b")[1]
DSV4 = load_config("deepseek-v4-flash")[1]


def _with(base: dict, **fields) -> dict:
    return {**base, **fields}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (name, file contents: a dict, or raw bytes/str; the words the one line must hold)
BAD_CONFIGS = [
    ("list", "[1, 2, 3]", "holds a JSON list"),
    ("null", "null", "holds a JSON NoneType"),
    ("string", '"llama"', "holds a JSON str"),
    ("nested", _nested(100_000), "nests too deeply"),
    ("latin1", b'{"model_type": "llama", "name": "caf\xe9"}', "not UTF-8"),
    ("broken", '{"model_type": ', "not valid JSON"),
    ("zero kv heads", _with(LLAMA, num_key_value_heads=0), "'num_key_value_heads'"),
    ("negative kv heads", _with(LLAMA, num_key_value_heads=-8), "'num_key_value_heads'"),
    ("zero head_dim", _with(LLAMA, head_dim=0), "'head_dim'"),
    ("string layers", _with(LLAMA, num_hidden_layers="32"), "'num_hidden_layers'"),
    ("float layers", _with(LLAMA, num_hidden_layers=31.5), "'num_hidden_layers'"),
    ("whole float layers", _with(LLAMA, num_hidden_layers=32.0), "'num_hidden_layers'"),
    ("whole float heads", _with(LLAMA, num_key_value_heads=8.0), "'num_key_value_heads'"),
    (
        "short compress_ratios",
        _with(DSV4, compress_ratios=DSV4["compress_ratios"][:20]),
        "compress_ratios names 20 layers but num_hidden_layers is 43",
    ),
    (
        "unknown compress ratio",
        _with(DSV4, compress_ratios=[8] * 44),
        "compress by 0, 4 or 128",
    ),
    (
        "long compress_ratios",
        _with(DSV4, compress_ratios=DSV4["compress_ratios"] + [4, 4]),
        "'compress_ratios' must be a list of at most 44",
    ),
    ("billion layers", _with(LLAMA, num_hidden_layers=10**9), "'num_hidden_layers'"),
    (
        "zero heads",
        _with(_with(LLAMA, head_dim=None), num_attention_heads=0),
        "'num_attention_heads'",
    ),
    ("zero interval", _with(QWEN, full_attention_interval=0), "'full_attention_interval'"),
    ("negative interval", _with(QWEN, full_attention_interval=-4), "'full_attention_interval'"),
    ("list interval", _with(QWEN, full_attention_interval=[4]), "'full_attention_interval'"),
    ("short layer_types", _with(QWEN, layer_types=["linear_attention"] * 3), "layer_types names 3"),
    (
        "zero pattern",
        {**GEMMA, "text_config": {**GEMMA["text_config"], "sliding_window_pattern": 0}},
        "'sliding_window_pattern'",
    ),
    ("text_config list", _with(GEMMA, text_config=[1]), "'text_config' must be a JSON object"),
    ("zero mamba head_dim", _with(MAMBA, head_dim=0), "'head_dim'"),
    ("zero n_groups", _with(MAMBA, n_groups=0), "'n_groups'"),
    ("zero state_size", _with(MAMBA, state_size=0), "'state_size'"),
    ("bad dtype", _with(LLAMA, torch_dtype="int4"), "torch_dtype 'int4'"),
    (
        "string use_sliding_window",
        _with(LLAMA, sliding_window=4096, use_sliding_window="yes"),
        "'use_sliding_window' must be true or false",
    ),
    ("short gqa layer_types", _with(LLAMA, layer_types=["full_attention"] * 3), "names 3 layers"),
    (
        "gqa layer_types kind",
        _with(LLAMA, layer_types=["linear_attention"] * 32),
        "layer_types holds ['linear_attention']",
    ),
    (
        "gpt_oss layer_types kind",
        _with(GPT_OSS, layer_types=["chunked_attention", "full_attention"] * 12),
        "layer_types holds ['chunked_attention']",
    ),
    ("gpt_oss zero window", _with(GPT_OSS, sliding_window=0), "'sliding_window'"),
    (
        "gemma2 zero pattern",
        {"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window_pattern": 0},
        "'sliding_window_pattern'",
    ),
    ("unknown family", {"model_type": "gpt2"}, "unknown model family"),
    ("architectures string", {"architectures": "LlamaForCausalLM"}, "unknown model family"),
]

BAD_ARGS = [
    (["plan", "--memory", "1" + "0" * 400], "is not a size"),
    (["plan", "--memory", "2EiB"], "is not a size"),
    (["plan", "--memory", str(2**62)], "exceeds the largest budget"),
    (["plan", "--memory", "0.5"], "not a whole number of bytes"),
    (["plan", "--memory", "0"], "must be positive"),
    (["plan", "--block-size", str(10**18)], "block_size must be an int"),
    (["plan", "--block-size", "0"], "block_size must be an int"),
    (["plan", "--max-seqs", "0"], "--max-seqs must be an int"),
    (["plan", "--max-seqs", "abc"], "--max-seqs"),
    (["plan", "--tp", "-1"], "tp must be an int"),
    (["plan", "--spec-tokens", "-1"], "spec_tokens must be an int"),
    (["plan", "--kv-dtype", "int3"], "kv_dtype 'int3' unknown"),
    (["plan", "mamba2-2.7b", "--tp", "3"], "not divisible"),
    (["plan", "llama-3.1-8b", "--memory", "1000"], "not even one request fits"),
    (["plan", "no[such]model"], "unknown model 'no[such]model'"),
    (["plan", "--bogus"], "--bogus"),
    (["demo", "llama-3.1-8b"], "keeps no per-request state"),
    (["demo", "--requests", "0"], "--requests must be an int"),
    (["replay", "TRACE", "--tier", "tape:1GiB"], "tier 'tape:1GiB': use host:SIZE"),
    (["replay", "TRACE", "--tier", "host:lots"], "'lots' is not a size"),
    (["replay", "TRACE", "--tier", "disk:/proc/kvarena:1GiB"], "cannot use the directory"),
    (["replay", "TRACE", "--tier", "host:1MiB", "--compare"], "--compare and --tier"),
    (
        ["replay", "TRACE", "--tier", "redis://:${KVARENA_UNSET_PW}@127.0.0.1:1"],
        "the environment has no KVARENA_UNSET_PW",
    ),
    (["tiers", "stat", "redis://:${KVARENA_UNSET_PW}@h:1"], "the environment has no"),
    (["replay", "/dev/null"], "/dev/null: no request in it"),
]
"""``TRACE``: a trace of one request (the test writes it)."""
if not torch.cuda.is_available():
    BAD_ARGS.append((["demo", "--device", "cuda"], "no CUDA device"))


SCRIPT = """
import contextlib, io, json, sys
from kvarena.cli import app
out = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = app(args, standalone_mode=False)
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def run_many(arg_lists):
    """Each argument list through the command's own entry (one process for the table)."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(arg_lists)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def assert_one_line_refusal(what, code, err, words):
    assert code == 2, (what, code, err)
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (what, err)
    assert words in lines[0], (what, lines[0])


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    trace = tmp_path / "one.jsonl"
    trace.write_text('{"tokens": [1, 2, 3], "output_length": 1}\n')
    results = run_many([[str(trace) if a == "TRACE" else a for a in args] for args, _ in BAD_ARGS])
    for (args, words), (code, err) in zip(BAD_ARGS, results, strict=True):
        assert_one_line_refusal(args, code, err, words)


def test_the_installed_command_exits_2_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "kvarena", "plan", "--max-seqs", "abc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_refusal("--max-seqs abc", result.returncode, result.stderr, "--max-seqs")


def test_bad_configs_exit_2_with_one_line_naming_the_field(tmp_path):
    paths = []
    for i, (_, content, _) in enumerate(BAD_CONFIGS):
        path = tmp_path / f"c{i}" / "config.json"
        path.parent.mkdir()
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        paths.append(str(path))
    results = run_many([["plan", p] for p in paths])
    for (name, _, words), (code, err) in zip(BAD_CONFIGS, results, strict=True):
        assert_one_line_refusal(name, code, err, words)


def test_a_good_config_file_still_plans(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(_with(QWEN, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12))
    )
    result = subprocess.run(
        [sys.executable, "-m", "kvarena", "plan", str(path), "--json", "--memory", "8GiB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["layers"] == {"attention": 12, "state": 36, "recurrent": 36}
