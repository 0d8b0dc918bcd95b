"""KvarenaConnector through the real vLLM engine when a request is aborted while
its load is in flight (a client that hangs up, an HTTP timeout, a router's
cancel): vLLM keeps the request's blocks until the worker reports the load
done, so the connector must report every load it started — landed, failed or
past its deadline — or the blocks and the request are held for ever. Engines
in this process, as in ``test_vllm_connector.py``; runs in ``.venv-vllm``,
skipped where vLLM is not installed.
"""

from __future__ import annotations

import random
import threading

import pytest

vllm = pytest.importorskip("vllm")

from vllm_offline import CASES, close, engine, generate, tiny_models, worker_connector  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_in_process")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("models"), ("llama", "qwen3_next"))


@pytest.fixture(scope="module")
def on_disk(models, tmp_path_factory):
    """Per model, once: a prompt, vLLM alone's tokens for it, and a disk tier an
    engine saved it to."""
    made: dict[str, tuple[list[int], list[int], str]] = {}

    def make(kind: str, block_size: int | None) -> tuple[list[int], list[int], str]:
        if kind not in made:
            rng = random.Random(21)
            prompt = [rng.randrange(3, 500) for _ in range(3 * (block_size or 256) + 5)]
            alone = engine(models[kind], block_size=block_size)
            (reference,), _ = generate(alone, [prompt])
            close(alone)
            disk = tmp_path_factory.mktemp(f"disk-{kind}")
            first = engine(models[kind], block_size=block_size, tiers=[f"disk:{disk}:64MiB"])
            generate(first, [prompt])  # computed once: its objects go to the disk tier
            worker_connector()._worker.flush()
            close(first)
            made[kind] = (prompt, reference, str(disk))
        return made[kind]

    return make


def _held(llm) -> tuple[int, int]:
    """The scheduler's requests, and the device blocks not free (the null block aside)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    return len(scheduler.requests), pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def _run(core, until, done: dict[str, list[int]]) -> None:
    """Step the engine until ``until()``; the finished requests' tokens into ``done``."""
    while not until():
        for o in core.step():
            if o.finished:
                done[o.request_id.split("-")[0]] = list(o.outputs[0].token_ids)


@pytest.mark.parametrize("deadline", [False, True], ids=["released", "past-deadline"])
@pytest.mark.parametrize(("kind", "block_size"), CASES)
def test_a_request_aborted_while_its_load_is_in_flight_frees_everything(
    models, on_disk, kind, block_size, deadline
):
    """A prompt on disk whose read hangs; the request loading it is aborted while
    the read is stuck. Released: the read comes back after the abort, the
    load lands in the aborted request's blocks (vLLM still holds them for it)
    and is reported done. Past the deadline: the load is given up first and
    reported failed. Either way vLLM then frees the request and its blocks
    (no request, no block held once the engine is idle), the engine serves
    on, and the same prompt asked again has vLLM alone's tokens — from the
    tiers where the load landed, computed where it was given up (its objects
    not promised again until saved again, then from the tiers the time after)."""
    from vllm import SamplingParams

    block = block_size or 256
    prompt, reference, disk = on_disk(kind, block_size)
    # a prompt of its own per test: the disk holds what the tests before saved
    busy = [random.Random(22 + deadline).randrange(3, 500) for _ in range(40)]
    tiers = [f"disk:{disk}:64MiB"]
    extra = {"load_timeout": 0.2} if deadline else None
    llm = engine(models[kind], block_size=block_size, tiers=tiers, extra=extra)
    worker = worker_connector()._worker
    tier = worker.tiers.tiers[0]
    stuck, read = threading.Event(), tier.get_many
    tier.get_many = lambda names: (stuck.wait(), read(names))[1]
    core = llm.llm_engine
    params = SamplingParams(max_tokens=12, temperature=0, detokenize=False)
    try:
        core.add_request("busy", {"prompt_token_ids": busy}, params)
        core.add_request("aborted", {"prompt_token_ids": prompt}, params)
        done: dict[str, list[int]] = {}
        _run(core, lambda: len(worker.queue) > 0, done)  # the aborted request's load: in flight
        core.abort_request(["aborted"])
        if deadline:  # given up while the read still hangs, then the read returns
            _run(core, lambda: worker.load_failures > 0, done)
        stuck.set()
        _run(core, lambda: not core.has_unfinished_requests() and not len(worker.queue), done)
        assert list(done) == ["busy"] and len(done["busy"]) == 12
        for _ in range(3):  # the last word of the load rides on a step's output
            generate(llm, [[5]])
        assert _held(llm)[0] == 0  # every request freed: the aborted one too
        llm.reset_prefix_cache()  # only possible with no block held by a request
        assert _held(llm) == (0, 0)
        assert worker.loads_done == (0 if deadline else 1)
        assert worker.load_failures == (1 if deadline else 0)

        (again,), (cached,) = generate(llm, [prompt])
        assert again == reference[: len(again)] and len(again) == 12
        hit = (len(prompt) - 1) if kind == "llama" else 3 * block
        assert cached == (0 if deadline else hit)
        if deadline:  # recomputed and saved again: the tiers serve it the time after
            worker.flush()
            generate(llm, [[5]])
            llm.reset_prefix_cache()
            (third,), (cached,) = generate(llm, [prompt])
            assert third == reference and cached == hit
    finally:
        stuck.set()  # never leave a thread hanging behind a failed assertion
        close(llm)
