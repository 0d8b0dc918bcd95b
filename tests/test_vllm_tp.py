"""KvarenaConnector under tensor parallelism: two ranks through the real engine.

vLLM's CPU build runs ``tensor_parallel_size=2`` with one worker process per
rank (the ``mp`` executor; each rank's threads bound to one core). Each rank
saves and loads its own shard of every block and state; the scheduler hashes
the tokens once and hits only where both ranks' objects are there. The engine
computes the prompts cold (nothing to hit: its outputs are the reference),
each rank's worker is asked (``collective_rpc``) to finish its saves, the
device cache is reset, and the prompts must then resume at their last full
block from both ranks' shards with the same tokens. (A restarted engine over
the same disk is ``test_vllm_connector.py``'s, at one rank.) Runs
in ``.venv-vllm``; skipped where vLLM is not installed or fewer than two
cores are usable.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import random
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvarena.integrations.transformers.tiny import save_tiny  # noqa: E402
from kvarena.testing.vllm_engine import engine_args  # noqa: E402

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="two ranks need two usable cores")

WATCHDOG_S = 300.0
"""How long a run that takes seconds may take before the test process exits:
a failure where a defect would loop the engine for ever."""


@contextlib.contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Past ``seconds``, print every thread's stack, kill every process this one
    started (the engine core and its rank workers, which would otherwise run on
    after it) and exit: a failure, not a hang. vLLM's blocked ``generate``
    wakes for nothing else (an engine shut down from another thread leaves it
    waiting)."""
    import psutil

    def fire() -> None:
        faulthandler.dump_traceback(all_threads=True)
        print(f"watchdog: {seconds:.0f} s passed; killing the engine", file=sys.stderr)
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def engine(model: Path, disk: Path):
    from vllm import LLM

    # The test asks each rank's worker what its connector did: a function sent to
    # the worker processes, which vLLM pickles only when allowed to.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from kvarena.integrations.vllm import kv_transfer_config

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{CORES[0]}|{CORES[1]}"
    return LLM(
        **engine_args(
            model,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            kv_transfer_config=kv_transfer_config([f"disk:{disk}:256MiB"]),
        )
    )


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()  # the workers close their tiers: saves flushed
    del llm
    gc.collect()


def run(llm, prompts):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    tokens, cached = [], []
    for p in prompts:  # one at a time, as a later prompt may hit an earlier one
        (out,) = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        tokens.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
    return tokens, cached


def _saves_flushed(worker) -> tuple[int, int, int, int]:
    """Run in each rank's worker process: wait for its connector's saves, and say
    what it did (its rank, objects saved, loads served and failed)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    side.flush()
    return side.rank, side.saves.objects_saved, side.loads_done, side.load_failures


def _reads_break(worker) -> int:
    """Run in each rank's worker process: from now on its tiers' reads raise, as a
    medium whose client fails in a way no check foresaw."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker

    def broken(names):
        raise RuntimeError("the disk's client broke")

    for tier in side.tiers.tiers:
        tier.get_many = broken
    return side.rank


@pytest.mark.parametrize("kind", ["qwen3_next"])
def test_two_ranks_save_their_shards_and_load_them_back(tmp_path, kind):
    model = save_tiny(kind, tmp_path)
    disk = tmp_path / "disk"
    llm = engine(model, disk)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    rng = random.Random(5)
    base = [rng.randrange(3, 500) for _ in range(4 * block)]
    prompts = [base[: 2 * block + 11], base[: 3 * block + 5]]
    reference, cold_cached = run(llm, prompts)  # nothing to hit: vLLM's own computation
    assert cold_cached[0] == 0
    cold = sorted(llm.collective_rpc(_saves_flushed))
    assert [r for r, *_ in cold] == [0, 1] and all(saved > 0 for _, saved, _, _ in cold)
    # Each rank wrote its shard of every object into its own directory, under
    # names of its own (each rank's key is derived from the prefix's).
    ranks = [sorted(f.name for f in (disk / f"tp{r}").glob("*.kvi")) for r in (0, 1)]
    assert ranks[0] and len(ranks[0]) == len(ranks[1]) and not set(ranks[0]) & set(ranks[1])
    assert {n[:3] for n in ranks[0]} == {"kv-", "st-"}  # KV blocks and states alike
    run(llm, [[5]])  # a few steps: the scheduler hears of the last writes (reports ride on them)
    llm.reset_prefix_cache()  # hits can only come from the tier now
    warm, warm_cached = run(llm, prompts)
    after = sorted(llm.collective_rpc(_saves_flushed))
    # Every rank's reads break: the same load fails on both ranks (one failure
    # counted under the scheduler's order of reasons), vLLM recomputes it, and
    # the engine serves on with the same tokens.
    assert sorted(llm.collective_rpc(_reads_break)) == [0, 1]
    llm.reset_prefix_cache()
    # A load promised again after it failed would loop in the engine for ever
    # (the run takes seconds).
    with watchdog(WATCHDOG_S):
        recomputed, _ = run(llm, prompts[:1])
    broken = sorted(llm.collective_rpc(_saves_flushed))
    close(llm)
    assert warm == reference
    assert warm_cached == [2 * block, 3 * block]  # each resumes at its last full block
    # Both ranks loaded their own shard of both hits; no load failed anywhere.
    assert all(loaded == len(prompts) and failed == 0 for _, _, loaded, failed in after)
    assert recomputed == reference[:1]
    assert all(loaded == len(prompts) and failed == 1 for _, _, loaded, failed in broken)
