"""Prefill -> decode disaggregation through the real vLLM engine (the CPU build).

Two engines, each in a process of its own (:mod:`kvarena.testing.vllm_pair`):
a ``kv_producer`` answers a ``do_remote_decode`` request with its
``kv_transfer_params``, which a ``kv_consumer`` takes with the same prompt,
as a proxy would pass them. Greedy outputs must equal one engine serving
alone, and the decode engine must compute only the prompt's last token (its
``num_cached_tokens`` once vLLM's echo of the prefill engine's own cache hits,
``remote_prefill_cached_tokens``, is left out of the parameters). Every fault
costs a recompute with the same tokens, and both engines serve on after it.

The reference for the hybrid computes the prompt as the two engines split it:
its first ``N - 1`` tokens in one step, then the last (one engine alone, one
request at a time, ``max_num_batched_tokens = N - 1``, no prefix caching).
vLLM's CPU Gated DeltaNet kernels run in bfloat16 only, and a state carried
over a step boundary is not bit-identical to one prefill of the whole prompt:
measured here, vLLM's own ``NixlConnector`` gives exactly kvarena's tokens, and
both differ from a one-step prefill of the whole prompt on some prompts, while
the split reference equals them on every prompt tried. Llama's attention gives
the one-step tokens either way.

Runs in the ``.venv-vllm`` environment; skipped where vLLM or NIXL is missing.
"""

from __future__ import annotations

import os
import random
import time

import pytest

vllm = pytest.importorskip("vllm")

from kvarena.integrations.transformers.tiny import save_tiny  # noqa: E402
from kvarena.testing.vllm_engine import engine_args, split_args  # noqa: E402
from kvarena.testing.vllm_pair import EngineProcess, cold, pd_books  # noqa: E402
from kvarena.transfer import nixl_available  # noqa: E402

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

BLOCK = {"llama": 32, "qwen3_next": None}  # None: vLLM unifies the hybrid's pages (256)
# several blocks each, none ending on a boundary (the hybrid's reference starts
# an engine per length: two)
LENGTHS = {"llama": (300, 517, 700), "qwen3_next": (300, 700)}


def args(model, kind, role=None, **extra):
    from kvarena.integrations.vllm import kv_transfer_config

    kw = {"distributed_executor_backend": "uni", "block_size": BLOCK[kind]}
    if role is not None:
        kw["kv_transfer_config"] = kv_transfer_config(extra.pop("tiers", []), role=role, **extra)
    return engine_args(model, **kw)


def prompts(seed: int = 0, kind: str = "llama") -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS[kind]]


def to_decode(answer) -> dict:
    """A prefill answer's parameters as a proxy passes them on, less vLLM's echo of
    the prefill's own cache hits (so ``num_cached_tokens`` is the decode's)."""
    assert answer.params is not None and answer.params["do_remote_prefill"] is True
    return {k: v for k, v in answer.params.items() if k != "remote_prefill_cached_tokens"}


def prefill(engine, batch):
    return engine.generate(batch, [{"do_remote_decode": True}] * len(batch), max_tokens=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {kind: save_tiny(kind, root) for kind in BLOCK}


def alone(batches: dict[str, tuple[object, list[list[int]]]]) -> dict[str, list[list[int]]]:
    """The greedy tokens of one engine serving each model's batch alone (see the
    module's docstring for the hybrid's split: an engine per prompt length),
    every engine started side by side."""
    plans: list[tuple[str, int | None, dict]] = []
    for kind, (model, batch) in batches.items():
        if BLOCK[kind] is not None:
            plans.append((kind, None, args(model, kind)))
            continue
        for n in sorted({len(p) for p in batch}):
            plans.append((kind, n, split_args(model, n)))
    engines = EngineProcess.many([engine for _, _, engine in plans])
    out: dict[str, dict[int, list[int]]] = {kind: {} for kind in batches}
    try:
        for (kind, n, _), engine in zip(plans, engines, strict=True):
            batch = batches[kind][1]
            mine = [i for i, p in enumerate(batch) if n is None or len(p) == n]
            got = engine.generate([batch[i] for i in mine])
            out[kind].update({i: a.tokens for i, a in zip(mine, got, strict=True)})
    finally:
        EngineProcess.stop_all(engines)
    return {kind: [got[i] for i in range(len(got))] for kind, got in out.items()}


@pytest.fixture(scope="module")
def reference(models):
    """Each model served by vLLM alone: the tokens every run must give, by seed."""
    got = alone({k: (m, prompts(0, k) + prompts(1, k)) for k, m in models.items()})
    return {k: {0: t[: len(LENGTHS[k])], 1: t[len(LENGTHS[k]) :]} for k, t in got.items()}


@pytest.fixture(scope="module")
def pairs(models):
    """A prefill and a decode engine per model, started when first asked for and
    shared by the tests (each must leave both serving). Llama's prefill engine
    holds an unread offer for 2 s, its decode engine gives a read up after 3 s."""
    started: dict[str, tuple[EngineProcess, EngineProcess]] = {}
    fast = {"llama": ({"pd_expiry": 2}, {"load_timeout": 3}), "qwen3_next": ({}, {})}

    def pair(kind: str) -> tuple[EngineProcess, EngineProcess]:
        if kind not in started:
            p, c = fast[kind]
            producer, consumer = EngineProcess.many(
                [
                    args(models[kind], kind, "kv_producer", **p),
                    args(models[kind], kind, "kv_consumer", **c),
                ]
            )
            started[kind] = (producer, consumer)
        return started[kind]

    try:
        yield pair
    finally:
        EngineProcess.stop_all([e for engines in started.values() for e in engines])


@pytest.fixture(scope="module")
def tiered(models, tmp_path_factory):
    """A decode engine per model with a disk tier of its own, started when first
    asked for."""
    started: dict[str, EngineProcess] = {}

    def consumer(kind: str) -> EngineProcess:
        if kind not in started:
            disk = tmp_path_factory.mktemp(f"disk-{kind}")
            tiers = [f"disk:{disk}:256MiB"]
            started[kind] = EngineProcess(args(models[kind], kind, "kv_consumer", tiers=tiers))
        return started[kind]

    try:
        yield consumer
    finally:
        for engine in started.values():
            engine.stop()


def hand_over(producer, consumer, batch: list[list[int]], kind: str):
    """Prefill answers and decode results of ``batch``: Llama's prompts together
    (two handoffs at once), the hybrid's one at a time, as its reference
    computes them (its bfloat16 Gated DeltaNet state is not bit-identical when
    a request shares its steps with another: a near tie can go the other way,
    seen once in a CI run where two decodes shared steps)."""
    if BLOCK[kind] is not None:
        answers = prefill(producer, batch)
        return answers, consumer.generate(batch, [to_decode(a) for a in answers])
    answers, got = [], []
    for prompt in batch:
        mine = prefill(producer, [prompt])
        answers += mine
        got += consumer.generate([prompt], [to_decode(a) for a in mine])
    return answers, got


@pytest.mark.parametrize("kind", list(BLOCK))
def test_decode_reads_the_prefill_and_computes_only_the_last_token(pairs, reference, kind):
    producer, consumer = pairs(kind)
    read = len(consumer.call(pd_books)["pulls"])
    batch = prompts(0, kind)
    answers, got = hand_over(producer, consumer, batch, kind)
    want = len(batch[0]) - 1 if kind == "qwen3_next" else len(batch[0])
    assert answers[0].params["remote_num_tokens"] == want  # a hybrid stops a token short
    assert [g.tokens for g in got] == reference[kind][0]
    assert [g.cached for g in got] == [len(p) - 1 for p in batch]
    pulls = consumer.call(pd_books)["pulls"][read:]
    assert len(pulls) == len(batch) and all(p["nbytes"] > 0 for p in pulls)
    # the prefill engine frees what was read (its next steps take the news)
    before = producer.call(pd_books)
    producer.generate([[7, 8, 9]], max_tokens=2)
    after = producer.call(pd_books)
    assert after["held"] == 0 and after["free_blocks"] > before["free_blocks"]
    # both serve on: a second round, prompts of another seed
    _, got = hand_over(producer, consumer, prompts(1, kind), kind)
    assert [g.tokens for g in got] == reference[kind][1]


def test_an_offer_no_decode_engine_reads_is_freed_at_expiry(pairs, reference):
    producer, consumer = pairs("llama")
    batch = prompts(0)
    answers = prefill(producer, batch)
    free = producer.call(pd_books)["free_blocks"]
    time.sleep(2.5)
    producer.generate([[7, 8, 9]], max_tokens=2)  # the steps that see the expiry
    books = producer.call(pd_books)
    assert books["held"] == 0 and books["free_blocks"] > free
    # read after the expiry: the lease is refused, vLLM recomputes, same tokens
    failed = consumer.call(pd_books)["failed"]
    got = consumer.generate(batch, [to_decode(a) for a in answers])
    assert [g.tokens for g in got] == reference["llama"][0]
    assert consumer.call(pd_books)["failed"] == failed + len(batch)


def test_a_prompt_paired_with_another_prompts_answer_is_computed(pairs, reference):
    producer, consumer = pairs("llama")
    mine, theirs = prompts(1), prompts(0)
    answers = prefill(producer, theirs)
    books = consumer.call(pd_books)
    got = consumer.generate(mine, [to_decode(a) for a in answers])
    assert [g.tokens for g in got] == reference["llama"][1]
    after = consumer.call(pd_books)  # refused before a load was promised: none ran
    assert (after["pulls"], after["failed"]) == (books["pulls"], books["failed"])
    producer.generate([[7, 8, 9]], max_tokens=2)
    assert producer.call(pd_books)["held"] == 0  # told at once: nothing waits for expiry


def test_a_frozen_prefill_engine_costs_a_recompute(pairs, reference):
    producer, consumer = pairs("llama")
    batch = prompts(0)
    answers = prefill(producer, batch)
    failed = consumer.call(pd_books)["failed"]
    producer.freeze()
    try:
        began = time.monotonic()
        got = consumer.generate(batch, [to_decode(a) for a in answers])
        waited = time.monotonic() - began
    finally:
        producer.thaw()
    assert [g.tokens for g in got] == reference["llama"][0]
    assert consumer.call(pd_books)["failed"] == failed + len(batch)
    assert waited < 60  # given up at its deadline, not hung
    # both live on
    got = consumer.generate(batch, [to_decode(a) for a in prefill(producer, batch)])
    assert [g.tokens for g in got] == reference["llama"][0]
    assert [g.cached for g in got] == [len(p) - 1 for p in batch]


def test_a_killed_prefill_engine_costs_a_recompute(models, pairs, reference):
    _, consumer = pairs("llama")
    producer = EngineProcess(args(models["llama"], "llama", "kv_producer"))
    try:
        batch = prompts(0)
        answers = prefill(producer, batch)
        producer.kill()
        books = consumer.call(pd_books)
        got = consumer.generate(batch, [to_decode(a) for a in answers])
        assert [g.tokens for g in got] == reference["llama"][0]
        after = consumer.call(pd_books)
        assert after["failed"] == books["failed"] + len(batch)
        assert after["pulls"] == books["pulls"]  # nothing was read
    finally:
        producer.stop()


def test_engines_whose_caches_differ_are_refused(models, pairs, reference):
    producer, _ = pairs("llama")
    from kvarena.integrations.vllm import kv_transfer_config

    other = kv_transfer_config([], role="kv_consumer")  # 64-token blocks: another namespace
    kw = {"distributed_executor_backend": "uni", "block_size": 64, "kv_transfer_config": other}
    consumer = EngineProcess(engine_args(models["llama"], **kw))
    try:
        batch = prompts(0)
        answers = prefill(producer, batch)
        got = consumer.generate(batch, [to_decode(a) for a in answers])
        assert [g.tokens for g in got] == reference["llama"][0]
        assert [g.cached for g in got] == [0, 0, 0]  # refused before any load was promised
        assert not consumer.call(pd_books)["pulls"]
    finally:
        consumer.stop()
    producer.generate([[7, 8, 9]], max_tokens=2)
    assert producer.call(pd_books)["held"] == 0  # told at once


@pytest.mark.parametrize("kind", list(BLOCK))
def test_a_decode_engine_reads_only_what_its_tiers_lack(pairs, tiered, reference, kind):
    """A decode engine whose own tiers hold a prompt's first blocks loads those
    and reads only the rest from the prefill engine (a hybrid's state at the
    prefill's end among them); tokens unchanged."""
    producer, _ = pairs(kind)
    consumer = tiered(kind)
    bs = BLOCK[kind] or 256
    whole, other = prompts(0, kind)[-1], prompts(1, kind)[-1]  # 700 tokens each
    # a prompt its tiers know nothing of is read whole
    got = consumer.generate([other], [to_decode(a) for a in prefill(producer, [other])])
    assert got[0].tokens == reference[kind][1][-1]
    full = consumer.call(pd_books)["pulls"][-1]
    # the decode engine once computed the first 600 tokens itself: its tiers
    # hold their whole blocks
    consumer.generate([whole[:600]], max_tokens=1)
    assert consumer.call(cold)
    got = consumer.generate([whole], [to_decode(a) for a in prefill(producer, [whole])])
    assert got[0].tokens == reference[kind][0][-1]
    assert got[0].cached == len(whole) - 1
    part = consumer.call(pd_books)["pulls"][-1]
    blocks = -(-(len(whole) - 1) // bs)  # the blocks a read of the whole prompt writes
    read = blocks - 600 // bs  # those after the tiers' whole blocks
    assert 0 < read < blocks
    if kind == "llama":  # KV blocks alone: the bytes read are the blocks read
        assert part["nbytes"] * blocks == full["nbytes"] * read
    else:  # the state at the prefill's end travels with the blocks
        assert part["nbytes"] < full["nbytes"]


@pytest.mark.skipif(len(CORES) < 2, reason="two ranks need two usable cores")
def test_tensor_parallel_engines_hand_over_rank_by_rank(models, pairs, reference):
    """Two engines of two ranks each (vLLM's ``mp`` executor, each rank's threads
    on a core of its own): every decode rank reads its own shard from the
    prefill rank of its number, and the tokens are those of the prefill
    engine serving the prompts alone. A decode engine of one rank is refused
    the two-rank offer before any load (computed, same tokens)."""
    from kvarena.integrations.vllm import kv_transfer_config

    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{CORES[0]}|{CORES[1]}"}
    tp = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "block_size": 32}
    engines = EngineProcess.many(
        [
            engine_args(models["llama"], **tp, kv_transfer_config=kv_transfer_config([], role=r))
            for r in ("kv_producer", "kv_consumer")
        ],
        env=env,
    )
    try:
        producer, consumer = engines
        batch = prompts(0)
        alone = [a.tokens for a in producer.generate(batch)]
        answers = prefill(producer, batch)
        assert all(a.params["tp_size"] == 2 for a in answers)
        got = consumer.generate(batch, [to_decode(a) for a in answers])
        assert [g.tokens for g in got] == alone
        assert [g.cached for g in got] == [len(p) - 1 for p in batch]
        _, single = pairs("llama")
        books = single.call(pd_books)
        got = single.generate(batch, [to_decode(a) for a in prefill(producer, batch)])
        assert [g.tokens for g in got] == reference["llama"][0]
        after = single.call(pd_books)  # refused before a load was promised: none ran
        assert (after["pulls"], after["failed"]) == (books["pulls"], books["failed"])
    finally:
        EngineProcess.stop_all(engines)
