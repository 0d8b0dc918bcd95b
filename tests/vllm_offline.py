"""What the offline-engine tests share: an engine in this process, its worker's
connector, greedy generation, and prompts that share prefixes.

The engines run in the test's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the ``uni`` executor, the ``vllm_in_process`` fixture): seconds per engine
instead of tens, and the worker's connector can be asked what it loaded.
Imported by the ``test_vllm_*`` modules that run the connector in vLLM.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvarena.integrations.transformers.tiny import save_tiny
from kvarena.testing.vllm_engine import engine_args, freeze_heap

PROMPT_BLOCKS = (2, 4, 5)  # shared prefixes, in blocks of the model's attention block

CASES = [("llama", 32), ("qwen3_next", None)]
"""The connector's engine tests' models and block sizes: an attention-only model
at a block size of its own, and a hybrid at vLLM's unified page (None: vLLM
picks it; the tiny Qwen3-Next gets 256)."""


def engine(model: Path, *, tiers=None, block_size=None, extra=None, **overrides):
    """An engine in this process for ``model`` (``tiers``: the connector's, its
    ``extra`` settings beside them; ``overrides``: more ``vllm.LLM`` arguments)."""
    from vllm import LLM

    from kvarena.integrations.vllm import kv_transfer_config

    kw = {}
    if tiers is not None:
        kw["kv_transfer_config"] = kv_transfer_config(tiers, **(extra or {}))
    freeze_heap()
    return LLM(
        **engine_args(
            model, distributed_executor_backend="uni", block_size=block_size, **kw, **overrides
        )
    )


def close(llm) -> None:
    """Shut the engine down (its connector closes its tiers: the disk directory's
    lock is free for the next engine; vLLM collects the heap whole as it does)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
    llm.llm_engine.engine_core.shutdown()
    del llm


def worker_connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def generate(llm, prompts):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def saved(llm) -> None:
    """Every save written, and the scheduler told of it: a write's report rides on
    the step after it, so a one-token request (under a block: nothing looked up
    or saved) takes a few steps. A lookup right after a flush alone could miss
    what the writer finished last — a stale catalogue is a miss, by design."""
    worker_connector()._worker.flush()
    generate(llm, [[5]])


def prompts_for(block: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing prefixes of 2, 4 and 5 blocks, each ending off a boundary,
    run one at a time so each can hit what the ones before it saved."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 500) for _ in range(6 * block)]
    return [base[: n * block + 17] for n in PROMPT_BLOCKS]


def one_by_one(llm, prompts):
    tokens, cached = [], []
    for p in prompts:
        t, c = generate(llm, [p])
        tokens += t
        cached += c
    return tokens, cached


def tiny_models(root: Path, kinds: tuple[str, ...]) -> dict[str, Path]:
    """The tiny served models of ``kinds``, saved under ``root``."""
    return {kind: save_tiny(kind, root) for kind in kinds}
