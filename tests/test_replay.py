"""Replays through the real prefix cache: trace parsing, byte-exact verification under
evictions and boundary moves, the five-way comparison, and the command."""

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvarena import EntryField, InvalidValueError, ModelCache
from kvarena.prefix import CheckpointPolicy
from kvarena.replay import (
    MOONCAKE_BLOCK,
    ReplayConfig,
    TraceError,
    compare,
    host_memory_available,
    infinite_bound,
    load_trace,
    parse_trace,
    replay,
)

SHARED = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)

# A small hybrid: 16-token blocks of 2 KiB, a 6 KiB state with a -inf score ring.
SMALL = ModelCache.from_fields(
    [EntryField("k", 2, (16, 32), torch.bfloat16)],
    [
        EntryField("conv", 2, (3, 256), torch.bfloat16),
        EntryField("ssm", 2, (4, 128), torch.float32),
        EntryField("score", 1, (16,), torch.float32, fill=float("-inf"), in_checkpoint=False),
    ],
    block_size=16,
    name="small-hybrid",
)


def synthetic_lines(seed: int, conversations: int = 40) -> list[str]:
    """Mooncake-format multi-turn chats: shared system prompts, turns extending turns."""
    rng = random.Random(seed)
    systems = [[rng.randrange(10**6) for _ in range(rng.randint(1, 3))] for _ in range(4)]
    lines, t, next_id = [], 0, 10**7
    for _ in range(conversations):
        ids = list(rng.choice(systems))
        for _ in range(rng.randint(1, 4)):
            new = rng.randint(1, 3)
            ids += list(range(next_id, next_id + new))
            next_id += new
            length = MOONCAKE_BLOCK * (len(ids) - 1) + rng.randint(1, MOONCAKE_BLOCK)
            t += rng.randint(0, 400)
            lines.append(
                json.dumps(
                    {
                        "timestamp": t,
                        "input_length": length,
                        "output_length": rng.randint(1, 64),
                        "hash_ids": ids,
                    }
                )
            )
    return lines


def test_mooncake_lines_expand_into_deterministic_tokens():
    reqs = parse_trace(
        [
            '{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}',
            '{"timestamp": 1, "input_length": 512, "output_length": 0, "hash_ids": [7]}',
            '{"timestamp": 9, "tokens": [1, 2, 3], "output_length": 1}',
        ]
    )
    assert [r.arrival_ms for r in reqs] == [1, 5, 9]  # sorted by arrival
    assert reqs[0].tokens.size == 512 and reqs[1].tokens.size == 600
    assert np.array_equal(reqs[0].tokens, reqs[1].tokens[:512])  # equal ids, equal tokens
    assert reqs[2].tokens.tolist() == [1, 2, 3]
    for bad, words in (
        ('{"timestamp": 0, "input_length": 2000, "hash_ids": [1]}', "does not fit 1 hash ids"),
        ('{"timestamp": -1, "input_length": 5, "hash_ids": [1]}', "timestamp"),
        ('{"input_length": 5, "hash_ids": [1.5]}', "hash_ids"),
        ('{"tokens": [], "output_length": 1}', "tokens"),
        ('{"timestamp": 1, "tokens": [1%s]}' % ("0" * 5000), "not a JSON object"),
        ("[1, 2]", "not a JSON object"),
        ("{", "not a JSON object"),
    ):
        with pytest.raises(TraceError, match=f"trace:1: .*{words}|trace:1: {words}"):
            parse_trace([bad])
    for empty in ([], ["", "  ", "\n"]):  # the wrong file, most likely: said so
        with pytest.raises(TraceError, match="trace: no request in it"):
            parse_trace(empty)


@pytest.mark.parametrize("seed", [1, 2])
def test_verify_restores_every_block_and_state_byte_exact(seed):
    trace = parse_trace(synthetic_lines(seed))
    # A budget far too small for the history: evictions and boundary moves happen.
    cfg = ReplayConfig(
        budget_bytes=6 << 20,
        max_seqs=2,
        verify=True,
        policy=CheckpointPolicy.parse("end,end:512,branch"),
    )
    r = replay(SMALL, trace, cfg)
    m = r.metrics
    assert r.mismatches == 0
    assert r.verified_states == m["images_read"] > 10 and r.verified_blocks > 100
    assert m["evicted_blocks"] > 0 and m["evicted_images"] > 0 and r.boundary_moves > 0
    assert r.admitted + r.dropped == r.requests == len(trace)


def test_a_corrupted_restore_is_caught():
    trace = parse_trace(synthetic_lines(3, conversations=10))
    cfg = ReplayConfig(budget_bytes=64 << 20, max_seqs=4, verify=True)
    from kvarena.prefix import cache as prefix_cache

    original = prefix_cache.PrefixCache.admit

    def corrupting(self, *args, **kwargs):
        adm = original(self, *args, **kwargs)
        if adm.hit.tokens:  # a wrong byte in the restored state
            self.cache.slot_bytes_of(adm.slots[0])[0] ^= 1
        return adm

    prefix_cache.PrefixCache.admit = corrupting
    try:
        r = replay(SMALL, trace, cfg)
    finally:
        prefix_cache.PrefixCache.admit = original
    assert r.metrics["images_read"] > 0 and r.mismatches == r.metrics["images_read"]


def test_compare_orders_the_policies():
    trace = parse_trace(synthetic_lines(5, conversations=60))
    cfg = ReplayConfig(
        budget_bytes=256 << 20, max_seqs=4, policy=CheckpointPolicy.parse("end,end:512,branch")
    )
    big = ModelCache.from_fields(
        SMALL.page_fields, SMALL.state_fields, block_size=512, name="vllm-like"
    )
    rows = {r.label.split(" (")[0]: r for r in compare(SMALL, trace, cfg, vllm_model=big)}
    kv, vllm, off, kv_only, inf = (
        rows["kvarena"],
        rows["vLLM align"],
        rows["no state reuse"],
        rows["KV only"],
        rows["infinite cache"],
    )
    assert off.hit_tokens == 0
    assert vllm.hit_tokens < kv.hit_tokens <= kv_only.hit_tokens <= inf.hit_tokens
    assert kv.hit_tokens >= 0.9 * kv_only.hit_tokens  # a roomy budget: images cost little
    assert inf.hit_tokens == infinite_bound(trace, 16).hit_tokens


@pytest.mark.skipif(not SHARED.is_file(), reason="shared/traces not beside this checkout")
def test_the_shared_trace_replays_in_bookkeeping_mode():
    trace = load_trace(SHARED, limit=400)
    from kvarena import ServingOptions, model_cache

    m = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=8))
    r = replay(m, trace, ReplayConfig(budget_bytes=80 << 30, max_seqs=64))
    assert (
        r.requests == 400
        and r.admitted == 400
        and r.prompt_tokens == sum(t.tokens.size for t in trace)
    )
    assert 0 < r.hit_tokens <= infinite_bound(trace, 16).hit_tokens


def test_replay_command(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(synthetic_lines(4, conversations=8)) + "\n")
    args = [
        sys.executable,
        "-m",
        "kvarena",
        "replay",
        str(path),
        "--tp",
        "8",
        "--memory",
        "512MiB",
        "--max-seqs",
        "4",
        "--checkpoint",
        "end:512,branch",
        "--json",
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == "kvarena-replay/1" and doc["results"][0]["requests"] == len(
        synthetic_lines(4, conversations=8)
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 9999, "hash_ids": [1]}\n')
    out = subprocess.run([*args[:4], str(bad)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "bad.jsonl:1" in out.stderr
    # A verified replay larger than the host's memory: one line, before any allocation.
    huge = [*args[:5], "--verify", "--memory", "64TiB"]
    out = subprocess.run(huge, capture_output=True, text=True, timeout=300)
    if host_memory_available() is not None:
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "B available; replay a smaller budget (--memory)" in out.stderr


@pytest.mark.skipif(host_memory_available() is None, reason="the host says nothing of its memory")
def test_a_verified_replay_beyond_host_memory_is_refused_before_it_starts():
    """Real bytes of a budget the host cannot hold would end in the kernel killing
    the replay once the cache fills: refused at the door, in both entry points;
    the same budget without real bytes (bookkeeping on the meta device) runs."""
    trace = parse_trace(synthetic_lines(1, conversations=2))
    available = host_memory_available()
    assert available is not None and available > 0
    cfg = ReplayConfig(budget_bytes=available + (1 << 30), max_seqs=2, verify=True)
    for run in (lambda: replay(SMALL, trace, cfg), lambda: compare(SMALL, trace, cfg)):
        with pytest.raises(InvalidValueError, match="host memory, but this host has"):
            run()
    fits = replay(SMALL, trace, ReplayConfig(budget_bytes=cfg.budget_bytes, max_seqs=2))
    assert fits.requests == len(trace) and fits.verified_blocks == 0
    with pytest.raises(InvalidValueError, match="budget_bytes"):
        replay(SMALL, trace, ReplayConfig(budget_bytes="lots", max_seqs=2, verify=True))


def test_the_compared_vllm_align_policy_keeps_exactly_one_end_image_and_learns_nothing():
    """vLLM's align mode keeps the state at the last aligned block before each
    prompt end and nothing else: its row must not inherit the default's rules."""
    from kvarena import ServingOptions, model_cache
    from kvarena.replay.policies import policy_runs

    model = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=8))
    runs = policy_runs(model, ReplayConfig(budget_bytes=1 << 34, max_seqs=4))
    align = next(r for r in runs if r.label.startswith("vLLM align"))
    assert align.cfg.policy.describe() == "end"
    assert (
        runs[0].cfg.policy == CheckpointPolicy() and runs[0].label == "kvarena (end,branch,learn)"
    )
