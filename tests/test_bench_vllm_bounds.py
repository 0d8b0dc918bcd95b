"""The trace benchmark's bounds (``benchmarks/bench_vllm.py --bounds``) on a
trace made here, whose answers are counted by hand: an attention-only model
hits every whole shared hash block (at most the prompt less one token), a
hybrid the same rounded down to its 256-token blocks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def test_trace_bounds_count_whole_shared_hash_blocks(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # what its import sets
    monkeypatch.delitem(sys.modules, "bench_vllm", raising=False)
    import bench_vllm

    trace = tmp_path / "t.jsonl"
    rows = [
        {"input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"input_length": 1300, "output_length": 1, "hash_ids": [1, 2, 3]},  # shares 2 blocks
        {"input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},  # all but its last token
        {"input_length": 700, "output_length": 1, "hash_ids": [1, 9]},  # shares 1 block
        {"input_length": 400, "output_length": 1, "hash_ids": [1]},  # a partial block: none
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench_vllm.trace_bound(trace, 5, 1) == (1024 + 1023 + 512, 4448)
    assert bench_vllm.trace_bound(trace, 5, 256) == (1024 + 768 + 512, 4448)
    assert bench_vllm.trace_bound(trace, 2, 256) == (1024, 2324)
