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
(``make test`` does both); skipped where vLLM is not installed. Faults and
loads held up in a tier: ``test_vllm_connector_faults.py``.
"""

from __future__ import annotations

import random

import pytest

vllm = pytest.importorskip("vllm")

from vllm_offline import (  # noqa: E402
    CASES,
    PROMPT_BLOCKS,
    close,
    engine,
    one_by_one,
    prompts_for,
    saved,
    tiny_models,
    worker_connector,
)

from kvarena.integrations.transformers.tiny import save_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_in_process")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(
        tmp_path_factory.mktemp("models"), ("llama", "qwen3_next", "granitemoehybrid")
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from conftest import redis_binary

    from kvarena.testing.redis_server import RedisServer

    server = RedisServer(str(tmp_path_factory.mktemp("redis")), binary=redis_binary())
    try:
        yield server
    finally:
        server.stop()


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
    assert worker_connector()._worker.load_failures == 0
    # Then every disk object corrupted behind its back (one payload byte
    # flipped): each load fails its checksum, vLLM recomputes, and the tokens
    # do not change.
    for f in files:
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    second.reset_prefix_cache()
    bad, _ = one_by_one(second, prompts[:1])
    assert bad == reference[:1]
    assert worker_connector()._worker.load_failures >= 1
    close(second)

    # Another engine sharing only the store: hits what the first one wrote there.
    third = engine(model, block_size=block_size, tiers=[store.url])
    shared, shared_cached = one_by_one(third, prompts[:1])
    assert shared == reference[:1] and shared_cached[0] == hits[0]
    close(third)

    # Another namespace over the same store: the same tokens never match.
    fifth = engine(model, block_size=block_size, tiers=[store.url], extra={"namespace": "other"})
    other, other_cached = one_by_one(fifth, prompts[:1])
    assert other == reference[:1] and other_cached == [0]
    close(fifth)


IRREGULAR = {
    "deltanet_first": (
        ["linear_attention"] * 2 + ["full_attention", "linear_attention", "full_attention"],
        [1024, 504, 504, 504],
    ),
    "attention_first": (
        ["full_attention", *["linear_attention"] * 2, "full_attention", *["linear_attention"] * 2],
        [600, 311, 193, 123],
    ),
}
"""Layer patterns that do not alternate, and each conversation's first turn and
the new tokens of each later one (whole 504-token pieces; pieces of any length)."""


@pytest.mark.parametrize("shape", sorted(IRREGULAR))
def test_a_hybrid_with_an_irregular_pattern_hits_every_turn_of_a_conversation(tmp_path, shape):
    """Turns of a conversation, each the last one's prompt and answer plus new
    tokens, through a tiny Qwen3-Next whose layers are irregular. vLLM alone
    keeps its own prefix cache across turns (the reference: each turn resumes
    from the state vLLM's own cache holds; a hybrid's greedy tokens can
    depend on where a prompt resumes, so a run from scratch is not the
    reference: for a six-layer attention-first pattern, vLLM alone from
    scratch and vLLM alone resuming from its own cache gave different tokens
    on a conversation's second turn). The
    connector's engine has its device cache reset between turns, so every
    later turn resumes from the tiers, with vLLM alone's tokens — where the
    last one's computed blocks end, as deep as vLLM's own cache or deeper
    (the state saved where a step ends on a block boundary: the prompt's
    end, which vLLM does not keep)."""
    pattern, pieces = IRREGULAR[shape]
    model = save_tiny(
        "qwen3_next", tmp_path, name=shape, num_hidden_layers=len(pattern), layer_types=pattern
    )

    def conversation(llm, tiers: bool):
        from vllm import SamplingParams

        rng = random.Random(1)
        turn = [rng.randrange(3, 500) for _ in range(pieces[0])]
        params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
        out = []
        for piece in [*pieces[1:], 0]:
            o = llm.generate([{"prompt_token_ids": turn}], params, use_tqdm=False)[0]
            answer = list(o.outputs[0].token_ids)
            out.append((len(turn), o.num_cached_tokens, answer))
            if tiers:  # a user's next turn comes after the saves land (a step late)
                saved(llm)
                llm.reset_prefix_cache()
            turn = turn + answer + [rng.randrange(3, 500) for _ in range(piece)]
        return out

    alone = engine(model)
    block = alone.llm_engine.vllm_config.cache_config.block_size  # vLLM's unified block
    reference = conversation(alone, tiers=False)
    close(alone)
    llm = engine(model, tiers=["host:256MiB", f"disk:{tmp_path / 'disk'}:1GiB"])
    got = conversation(llm, tiers=True)
    close(llm)
    assert [a for *_, a in got] == [a for *_, a in reference]
    previous = 0
    for (length, cached, answer), (_, own, _) in zip(got, reference, strict=True):
        # the KV the last turn computed (its prompt and all but its last answer token)
        bound = min(previous // block, (length - 1) // block) * block
        assert cached == bound >= own, (length, cached, bound, own)
        previous = length + len(answer) - 1
    assert all(c for _, c, _ in got[1:])


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
