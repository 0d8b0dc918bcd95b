"""vLLM serving through kvarena: an engine saves, a restarted engine hits.

Run with the ``[vllm]`` extra installed (``make test`` builds ``.venv-vllm``)::

    .venv-vllm/bin/python examples/vllm_offload.py

A tiny random Qwen3-Next (Gated DeltaNet + attention) is saved to a temporary
directory; an engine with the kvarena connector over a host and a disk tier
answers a long prompt (its KV blocks and its recurrent states at block
boundaries are written through to disk), is shut down, and a new engine over
the same disk answers a prompt that shares the first one's prefix: its
``num_cached_tokens`` come from the disk tier, and its tokens equal those of
vLLM alone.
"""

from __future__ import annotations

import os
import random
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: quick to start


def engine(model: str, disk: str | None):
    from vllm import LLM

    from kvarena.integrations.vllm import kv_transfer_config

    kw = {}
    if disk is not None:
        kw["kv_transfer_config"] = kv_transfer_config(["host:256MiB", f"disk:{disk}:1GiB"])
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=True,
        distributed_executor_backend="uni",
        **kw,
    )


def shut(llm) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()  # the connector closes its tiers
    llm.llm_engine.engine_core.shutdown()


def run(llm, prompt: list[int]) -> tuple[list[int], int]:
    from vllm import SamplingParams

    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=16, temperature=0, detokenize=False),
        use_tqdm=False,
    )[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def main() -> None:
    from kvarena.integrations.transformers.tiny import save_tiny

    work = tempfile.mkdtemp(prefix="kvarena-vllm-")
    model = str(save_tiny("qwen3_next", work))
    disk = os.path.join(work, "kv")
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(1200)]
    first, second = [*shared, 11, 12, 13], [*shared, 21, 22, 23, 24]

    alone = engine(model, None)
    want, _ = run(alone, second)
    shut(alone)

    llm = engine(model, disk)
    _, cached = run(llm, first)
    print(f"engine 1: {len(first)} prompt tokens, {cached} from cache (cold)")
    shut(llm)
    files = [f for f in os.listdir(disk) if f.endswith(".kvi")]
    print(f"disk tier: {len(files)} kvarena images in {disk}")

    llm = engine(model, disk)
    got, cached = run(llm, second)
    shut(llm)
    print(f"engine 2 (restarted): {len(second)} prompt tokens, {cached} from the disk tier")
    print(f"tokens equal vLLM alone: {got == want}")


if __name__ == "__main__":
    main()
