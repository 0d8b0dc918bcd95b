"""KvarenaConnector through the real vLLM engine (the CPU build), token for token.

Each model is run by vLLM alone first (the reference), then with the connector:
cold; warm after ``reset_prefix_cache`` (hits can only come from the tiers); in
a restarted engine over the same disk tier; in another engine that shares only
the Redis store; after every disk object is corrupted (vLLM recomputes); and
under another namespace (no hit). Greedy outputs must equal the reference in
every run; the models' logits are peaked (``kvarena.integrations.transformers.tiny.SERVED``) so
no near-tie can excuse a difference.

The engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
``uni`` executor): seconds per engine instead of tens, and the worker's
connector can be asked what it loaded. Runs in the ``.venv-vllm`` environment
(``make test`` does both); skipped where vLLM is not installed.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvarena.integrations.transformers.tiny import save_tiny  # noqa: E402
from kvarena.testing.vllm_engine import engine_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_in_process")

PROMPT_BLOCKS = (2, 4, 5)  # shared prefixes, in blocks of the model's attention block


def engine(model: Path, *, tiers=None, block_size=None, extra=None):
    from vllm import LLM

    from kvarena.integrations.vllm import kv_transfer_config

    kw = {}
    if tiers is not None:
        kw["kv_transfer_config"] = kv_transfer_config(tiers, **(extra or {}))
    return LLM(
        **engine_args(model, distributed_executor_backend="uni", block_size=block_size, **kw)
    )


def close(llm) -> None:
    """Shut the engine down (its connector closes its tiers: the disk directory's
    lock is free for the next engine)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {kind: save_tiny(kind, root) for kind in ("llama", "qwen3_next", "granitemoehybrid")}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from conftest import redis_binary

    from kvarena.testing.redis_server import RedisServer

    server = RedisServer(str(tmp_path_factory.mktemp("redis")), binary=redis_binary())
    try:
        yield server
    finally:
        server.stop()


# (model, block size: None lets vLLM unify pages; the tiny Qwen3-Next gets 256)
CASES = [("llama", 32), ("qwen3_next", None)]


@pytest.mark.parametrize(("kind", "block_size"), CASES)
def test_outputs_equal_vllm_alone_cold_warm_restarted_shared_and_corrupted(
    models, store, tmp_path, kind, block_size
):
    model = models[kind]
    ref_engine = engine(model, block_size=block_size)
    block = ref_engine.llm_engine.vllm_config.cache_config.block_size
    prompts = prompts_for(block)
    reference, _ = one_by_one(ref_engine, prompts)
    close(ref_engine)

    disk = tmp_path / "disk"
    first = engine(
        model, block_size=block_size, tiers=["host:64MiB", f"disk:{disk}:256MiB", store.url]
    )
    cold, cold_cached = one_by_one(first, prompts)
    assert cold == reference
    assert cold_cached[0] == 0
    # Saves are written on a background thread: wait for them and for the
    # scheduler to hear of them, so the warm run's lookups do not race it.
    saved(first)
    first.reset_prefix_cache()
    warm, warm_cached = one_by_one(first, prompts)
    assert warm == reference
    # Every prompt's own blocks were saved cold: an attention-only model resumes
    # at its last token (its partial last block saved too), a hybrid at its last
    # full block (a state is exact only at a boundary).
    hits = [
        len(p) - 1 if kind == "llama" else n * block
        for p, n in zip(prompts, PROMPT_BLOCKS, strict=True)
    ]
    assert warm_cached == hits
    worker = worker_connector()._worker
    assert worker.loads_done >= len(prompts) and worker.load_failures == 0
    close(first)
    files = sorted(disk.glob("*.kvi"))
    assert files, "nothing reached the disk tier"

    # A restarted engine over the same disk: hits what the first one computed.
    second = engine(model, block_size=block_size, tiers=[f"disk:{disk}:256MiB"])
    again, again_cached = one_by_one(second, prompts)
    assert again == reference and again_cached[0] == hits[0]
    close(second)

    # Another engine sharing only the store: hits what the first one wrote there.
    third = engine(model, block_size=block_size, tiers=[store.url])
    shared, shared_cached = one_by_one(third, prompts[:1])
    assert shared == reference[:1] and shared_cached[0] == hits[0]
    close(third)

    # Every disk object corrupted (one payload byte flipped): each load fails its
    # checksum, vLLM recomputes, and the tokens do not change.
    for f in files:
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    fourth = engine(model, block_size=block_size, tiers=[f"disk:{disk}:256MiB"])
    bad, _ = one_by_one(fourth, prompts[:1])
    assert bad == reference[:1]
    assert worker_connector()._worker.load_failures >= 1
    close(fourth)

    # Another namespace over the same store: the same tokens never match.
    fifth = engine(model, block_size=block_size, tiers=[store.url], extra={"namespace": "other"})
    other, other_cached = one_by_one(fifth, prompts[:1])
    assert other == reference[:1] and other_cached == [0]
    close(fifth)


@pytest.mark.parametrize(("kind", "block_size"), CASES)
def test_vanished_and_evicted_objects_cost_a_recompute_never_a_token(models, kind, block_size):
    """The policy the connector requires (``recompute``) through the engine: host
    objects deleted behind the scheduler's back after it listed them (a store
    restarted, another engine's eviction) fail their loads as missing and vLLM
    recomputes; a host tier too small for the prompts evicts, says so, and no
    lookup promises what it dropped. Tokens equal vLLM alone's throughout."""
    model = models[kind]
    prompts = prompts_for(block_size or 256)
    alone = engine(model, block_size=block_size)
    reference, _ = one_by_one(alone, prompts)
    close(alone)

    llm = engine(model, block_size=block_size, tiers=["host:64MiB"])
    assert one_by_one(llm, prompts)[0] == reference
    worker = worker_connector()._worker
    saved(llm)
    host = worker.tiers.tiers[0]
    assert len(host) > 0
    host.delete_many(host.names())  # vanished: the scheduler still lists them
    llm.reset_prefix_cache()
    vanished, _ = one_by_one(llm, prompts)
    assert vanished == reference and worker.load_failures >= 1
    close(llm)

    one_object = host.frame_bytes
    small = engine(model, block_size=block_size, tiers=[f"host:{4 * one_object}"])
    assert one_by_one(small, prompts)[0] == reference
    worker = worker_connector()._worker
    saved(small)
    assert worker.tiers.tiers[0].metrics.evictions > 0
    small.reset_prefix_cache()
    evicted, _ = one_by_one(small, prompts)
    assert evicted == reference and worker.load_failures == 0
    close(small)


def test_a_hybrid_with_an_irregular_pattern_hits_every_turn_of_a_conversation(tmp_path):
    """Four turns of a conversation, each the last one's prompt and answer plus a
    new 504-token piece, through a tiny Qwen3-Next whose layers are irregular
    (Gated DeltaNet, Gated DeltaNet, attention, Gated DeltaNet, attention), the
    device cache reset between turns: every later turn resumes from the tiers
    where the last one's computed blocks end (the state saved where a step ends
    on a block boundary: the prompt's end, which vLLM does not offer), as many
    tokens as the KV alone allows, with tokens equal to vLLM alone's."""
    pattern = ["linear_attention"] * 2 + ["full_attention", "linear_attention", "full_attention"]
    model = save_tiny(
        "qwen3_next", tmp_path, name="irregular", num_hidden_layers=5, layer_types=pattern
    )

    def conversation(llm, tiers: bool):
        from vllm import SamplingParams

        rng = random.Random(1)
        turn = [rng.randrange(3, 500) for _ in range(1024)]
        params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
        out = []
        for _ in range(4):
            o = llm.generate([{"prompt_token_ids": turn}], params, use_tqdm=False)[0]
            answer = list(o.outputs[0].token_ids)
            out.append((len(turn), o.num_cached_tokens, answer))
            if tiers:  # a user's next turn comes after the saves land (a step late)
                saved(llm)
            llm.reset_prefix_cache()
            turn = turn + answer + [rng.randrange(3, 500) for _ in range(504)]
        return out

    alone = engine(model)
    reference = conversation(alone, tiers=False)
    close(alone)
    llm = engine(model, tiers=["host:256MiB", f"disk:{tmp_path / 'disk'}:1GiB"])
    got = conversation(llm, tiers=True)
    close(llm)
    block = 256  # vLLM's unified block for this model
    assert [a for *_, a in got] == [a for *_, a in reference]
    previous = 0
    for length, cached, answer in got:
        # the KV the last turn computed (its prompt and all but its last answer token)
        bound = min(previous // block, (length - 1) // block) * block
        assert cached == bound, (length, cached, bound)
        previous = length + len(answer) - 1
    assert sum(c for _, c, _ in got) > 0


def test_an_attention_only_model_hits_a_partial_block_only_where_its_tokens_match(models, tmp_path):
    """Prompts ending off a block boundary (one under a block, whose partial
    block is not saved; one token past two blocks; exactly two blocks; tails of
    6 and 11 tokens, one extending the other; a tail diverging after 3 tokens)
    saved cold; then new prompts: one whose tail extends a saved tail hits
    through it (and stops where it ends), one that diverges from every longer
    saved tail hits as far as the longest saved tail it begins with (one token:
    ``base[:65]``'s). Warm, every saved prompt of a block or more hits all but
    its last token, and a restarted engine over the same disk as well; tokens
    always vLLM alone's."""
    model = models["llama"]
    rng = random.Random(21)
    base = [rng.randrange(3, 500) for _ in range(96)]
    prompts = [base[:20], base[:65], base[:64], base[:70], base[:75], [*base[:67], 499, 498, 497]]
    new = {"extends": base[:72], "diverges": [*base[:67], 5, 5, 5, 5]}
    alone = engine(model, block_size=32)
    reference = one_by_one(alone, prompts + list(new.values()))[0]
    close(alone)

    disk = tmp_path / "disk"
    llm = engine(model, block_size=32, tiers=["host:64MiB", f"disk:{disk}:64MiB"])
    cold, _ = one_by_one(llm, prompts)
    saved(llm)
    llm.reset_prefix_cache()
    warm, warm_cached = one_by_one(llm, prompts)
    assert cold == warm == reference[: len(prompts)]
    # a prompt under one block saves no partial block: its prefill is cheaper
    hits = [len(p) - 1 if len(p) >= 32 else 0 for p in prompts]
    assert warm_cached == hits
    llm.reset_prefix_cache()
    got, got_cached = one_by_one(llm, list(new.values()))
    assert got == reference[len(prompts) :]
    # base[64:70] (6 tokens) is saved and begins the first; base[64:65] the second
    assert got_cached == [70, 65]
    close(llm)

    again = engine(model, block_size=32, tiers=[f"disk:{disk}:64MiB"])
    restarted, restarted_cached = one_by_one(again, prompts)
    assert restarted == reference[: len(prompts)]
    assert restarted_cached == hits
    close(again)


def _steps_to_first_token(llm, rid, prompt):
    """Engine steps from adding ``prompt`` until its first token, and its outputs."""
    from vllm import SamplingParams

    core = llm.llm_engine
    core.add_request(
        rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, temperature=0)
    )
    steps, first, out = 0, None, None
    while core.has_unfinished_requests():
        steps += 1
        for o in core.step():
            if first is None and o.outputs[0].token_ids:
                first = steps
            if o.finished:
                out = (list(o.outputs[0].token_ids), o.num_cached_tokens)
    return first, out


def test_a_small_host_load_is_done_in_the_step_that_asks_for_it(models, tmp_path):
    """Where the pace allows it (the copy within the step's budget, as measured),
    a hit the host tier holds is loaded in the step vLLM schedules the request
    in: its first token comes a step sooner than through the asynchronous path,
    tokens unchanged. Loaded so, a host tier that lost the objects costs a
    recompute — never a read of the disk below on the step — and the tokens
    stay vLLM alone's."""
    model = models["llama"]
    rng = random.Random(31)
    prompt = [rng.randrange(3, 500) for _ in range(3 * 32 + 7)]
    alone = engine(model, block_size=32)
    reference = generate(alone, [prompt])[0][0]
    close(alone)

    llm = engine(model, block_size=32, tiers=["host:64MiB", f"disk:{tmp_path / 'disk'}:64MiB"])
    try:
        generate(llm, [prompt])
        worker = worker_connector()._worker
        saved(llm)
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
        firsts = {}
        for word, answer in (("async", False), ("in-step", True)):
            llm.reset_prefix_cache()
            sched.pace.fits = lambda nbytes, idle, answer=answer: 0.0 if answer else None
            firsts[word], out = _steps_to_first_token(llm, word, prompt)
            assert out == (reference, len(prompt) - 1), word
        assert firsts["in-step"] == firsts["async"] - 1, firsts
        # the host tier loses the objects (the catalogue does not know yet):
        # the load in the step fails, vLLM recomputes, the disk is not read
        host, disk = worker.tiers.tiers
        host.delete_many(host.names())
        failures, reads = worker.load_failures, disk.get_many
        disk.get_many = lambda names: pytest.fail("the disk was read on the step")
        llm.reset_prefix_cache()
        _, out = _steps_to_first_token(llm, "lost", prompt)
        assert out[0] == reference and worker.load_failures == failures + 1
        disk.get_many = reads
    finally:
        close(llm)


def test_a_load_stuck_in_a_tier_holds_up_its_request_alone(models, tmp_path):
    """A disk read that hangs (the disk tier's reads held by a test double of the
    medium) while one request loads from it: another request, already decoding,
    keeps decoding step after step; once the read comes back the waiting request
    resumes from the tiers, its tokens equal to vLLM alone's."""
    import threading

    from vllm import SamplingParams

    model = models["llama"]
    rng = random.Random(4)
    cached_prompt = [rng.randrange(3, 500) for _ in range(32 * 4 + 5)]
    busy_prompt = [rng.randrange(3, 500) for _ in range(40)]
    params = SamplingParams(max_tokens=24, temperature=0, detokenize=False)
    alone = engine(model, block_size=32)
    reference = {
        "cached": generate(alone, [cached_prompt])[0][0],
        "busy": list(
            alone.generate([{"prompt_token_ids": busy_prompt}], params, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        ),
    }
    close(alone)

    disk = tmp_path / "disk"
    first = engine(model, block_size=32, tiers=[f"disk:{disk}:64MiB"])
    generate(first, [cached_prompt])  # computed once: its blocks go to the disk tier
    worker_connector()._worker.flush()
    close(first)

    llm = engine(model, block_size=32, tiers=[f"disk:{disk}:64MiB"])
    tier = worker_connector()._worker.tiers.tiers[0]
    stuck, read = threading.Event(), tier.get_many
    tier.get_many = lambda names: (stuck.wait(), read(names))[1]
    core = llm.llm_engine
    try:
        # a fresh SamplingParams: LLM.generate made the reference's final-output-only
        decoding = SamplingParams(max_tokens=24, temperature=0, detokenize=False)
        core.add_request("busy", {"prompt_token_ids": busy_prompt}, decoding)
        for _ in range(3):
            core.step()  # the busy request is decoding
        later = SamplingParams(max_tokens=12, temperature=0, detokenize=False)
        core.add_request("cached", {"prompt_token_ids": cached_prompt}, later)
        progress = []
        for _ in range(10):  # the cached request's read hangs; the busy one decodes on
            for o in core.step():
                if o.request_id.startswith("busy"):  # (vLLM may suffix the id)
                    progress.append(len(o.outputs[0].token_ids))
        assert len(progress) >= 5 and progress == sorted(progress) and progress[-1] > progress[0]
        assert worker_connector()._worker.queue  # the cached request's load: still in flight
        stuck.set()
        done = {}
        while core.has_unfinished_requests():
            for o in core.step():
                if o.finished:
                    done[o.request_id.split("-")[0]] = (
                        list(o.outputs[0].token_ids),
                        o.num_cached_tokens,
                    )
        assert done["busy"][0] == reference["busy"]
        # resumed from the tiers, at its last token (its partial last block too)
        assert done["cached"] == (reference["cached"][:12], len(cached_prompt) - 1)
    finally:
        stuck.set()  # never leave a thread hanging behind a failed assertion
        close(llm)


def test_saves_past_the_backlog_are_skipped_and_cost_only_misses(models, caplog):
    """A save backlog of two KV blocks (tiny Llama: 2 layers x K,V x 32 tokens x 2
    heads x 64 x 2 bytes): a prompt whose prefill saves three blocks in one step
    (two full, its partial last) is skipped whole (nothing gathered, nothing
    found later); the next prompt's two (one full, one partial) fit and are
    saved. Warm after ``reset_prefix_cache``: the first prompt computes
    everything, the second resumes at its last token, tokens as cold."""
    from kvarena.integrations.transformers.tiny import SERVED, SERVED_COMMON

    block = 32
    one_block = 2 * 2 * block * SERVED_COMMON["num_key_value_heads"] * SERVED_COMMON["head_dim"]
    one_block *= SERVED["llama"]["num_hidden_layers"]
    llm = engine(
        models["llama"],
        block_size=block,
        tiers=["host:16MiB"],
        extra={"save_backlog": 2 * one_block},
    )
    try:
        rng = random.Random(11)
        prompts = [
            [rng.randrange(3, 500) for _ in range(2 * block + 17)],  # three blocks: past it
            [rng.randrange(3, 500) for _ in range(block + 10)],  # two blocks: fit
        ]
        cold = []
        for p in prompts:
            cold += generate(llm, [p])[0]
            worker_connector()._worker.flush()  # the backlog empty before the next
        worker = worker_connector()._worker
        saved(llm)
        assert worker.saves_skipped == 3 and worker.objects_saved == 2 and worker.backlog == 0
        assert "saves skipped" in caplog.text and "save_backlog" in caplog.text
        llm.reset_prefix_cache()
        warm, warm_cached = one_by_one(llm, prompts)
        assert warm == cold and warm_cached == [0, len(prompts[1]) - 1]
    finally:
        close(llm)


def test_granite_mamba2_hybrid_is_unchanged_as_far_as_vllm_alone_runs_it(models, tmp_path):
    """vLLM's own CPU Mamba2 path fails on prompts longer than one attention
    block with prefix caching on (an IndexError in ``mamba_mixer2``, with or
    without a connector), so Granite 4.0 is run on prompts inside one block:
    the connector must leave its tokens exactly as vLLM alone makes them."""
    model = models["granitemoehybrid"]
    ref_engine = engine(model)
    block = ref_engine.llm_engine.vllm_config.cache_config.block_size
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (block // 3, block // 2)]
    reference, _ = one_by_one(ref_engine, prompts)
    close(ref_engine)
    llm = engine(model, tiers=["host:64MiB", f"disk:{tmp_path / 'disk'}:256MiB"])
    cold, _ = one_by_one(llm, prompts)
    llm.reset_prefix_cache()
    warm, warm_cached = one_by_one(llm, prompts)
    assert cold == reference and warm == reference
    assert warm_cached == [0, 0]  # no full block below the last prompt token: nothing to hit
    close(llm)
