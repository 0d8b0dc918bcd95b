"""The connector that does nothing (``benchmarks/noop_connector.py``), the decode
benchmark's floor, through the real vLLM engine: vLLM loads it from
configuration alone, its tokens equal vLLM alone's, and it never reports a hit
(after ``reset_prefix_cache`` every prompt token is computed again). Runs in the
``.venv-vllm`` environment; skipped where vLLM is not installed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvarena.integrations.transformers.tiny import save_tiny  # noqa: E402
from kvarena.testing.vllm_engine import engine_args, freeze_heap  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_in_process")

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


@pytest.fixture(autouse=True)
def benchmarks_importable(monkeypatch):
    """vLLM loads the connector by its module path: the benchmarks' folder on it."""
    monkeypatch.syspath_prepend(BENCHMARKS)


def run(llm, prompts):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    tokens, cached = [], []
    for p in prompts:
        o = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        tokens.append(list(o.outputs[0].token_ids))
        cached.append(o.num_cached_tokens)
        llm.reset_prefix_cache()
    return tokens, cached


def test_the_noop_connector_changes_no_token_and_finds_nothing(tmp_path):
    from noop_connector import NoopConnector, noop_transfer_config
    from vllm import LLM
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    model = save_tiny("llama", tmp_path)
    rng = random.Random(3)
    base = [rng.randrange(3, 500) for _ in range(100)]
    prompts = [base[:70], base[:90], base]  # shared prefixes: hits, if any were reported

    results = []
    for transfer in (None, noop_transfer_config()):
        kw = {} if transfer is None else {"kv_transfer_config": transfer}
        freeze_heap()
        llm = LLM(**engine_args(model, distributed_executor_backend="uni", block_size=32), **kw)
        try:
            if transfer is not None:
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                assert isinstance(get_kv_transfer_group(), NoopConnector)
            results.append(run(llm, prompts))
        finally:
            ensure_kv_transfer_shutdown()
            llm.llm_engine.engine_core.shutdown()

    (alone, alone_cached), (noop, noop_cached) = results
    assert noop == alone
    assert all(len(t) == 8 for t in noop)
    assert alone_cached == [0, 0, 0] and noop_cached == [0, 0, 0]
