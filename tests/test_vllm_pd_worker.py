"""Two workers' halves of disaggregation on real NIXL agents in one process, by bytes.

A prefill worker over one of vLLM's own allocations (filled), a decode
worker over another (zero): a pull READs a request's KV blocks and its
states, and every layer's page of every decode block must then equal the
prefill block it was read from, with no other decode byte changed; the
prefill worker reports the offer sent once the READ's notification arrives,
also when the READ lands before the worker heard of the offer. A pull with
no hello, one whose lease ended before it was posted (nothing read), a
refused one, and an offer nobody reads each end as they must. Runs in the ``.venv-vllm`` environment; skipped without NIXL."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from kvarena.integrations.vllm.groups import classify
from kvarena.integrations.vllm.pd_worker import PdWorker
from kvarena.integrations.vllm.records import Pull
from kvarena.integrations.vllm.tensors import cache_pages
from kvarena.testing.vllm_tensors import allocation, fill, page
from kvarena.transfer import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

KV = [((1,), (4,)), ((7,), (2,))]  # (prefill block, decode block), the attention group's
STATE = ((2, 3), (5, 6))  # the two state groups' blocks there and here


@pytest.fixture()
def workers():
    kc, there = allocation("LBHNC")
    _, here = allocation("LBHNC")
    fill(there, seed=5)
    groups = classify(kc)
    made = [
        PdWorker(
            cache_pages(c, groups, num_blocks=kc.num_blocks),
            namespace=b"ns",
            rank=0,
            ranks=1,
            timeout_s=10,
        )
        for c in (there, here)
    ]
    try:
        yield made[0], made[1], there, here, groups
    finally:
        for w in made:
            w.close()


def pull(rid: str = "d1", remote: str = "p1", lease_s: float = 10.0) -> Pull:
    return Pull(
        request=rid,
        engine_id="prefill",
        remote_request=remote,
        host="127.0.0.1",
        port=1,
        kv_local=tuple(m for _, m in KV),
        kv_remote=tuple(r for r, _ in KV),
        state_local=STATE[1],
        state_remote=STATE[0],
        lease_end=time.monotonic() + lease_s,
    )


def until(cond, *workers, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        for w in workers:
            w.progress()
        time.sleep(0.001)


def test_a_pull_reads_every_page_into_its_block_and_frees_the_offer(workers):
    producer, consumer, there, here, groups = workers
    consumer.learn({"prefill": {0: producer.hello().to_dict()}})
    untouched = {n: t.clone() for n, t in here.items()}
    producer.offered(["p1"])
    consumer.submit([pull()])
    done: set[str] = set()
    sent: set[str] = set()

    def over() -> bool:
        _, d, failed, errors = consumer.take()
        assert not failed and not errors
        done.update(d)
        sent.update(producer.take()[0])
        return "d1" in done and "p1" in sent

    until(over, consumer, producer)
    [got] = consumer.finished
    assert got.request == "d1" and got.nbytes > 0 and got.descriptors > 0
    written = set()  # the groups' tensors share storage: a block id is written for all
    for g in groups:
        mine = [x.index for x in groups if x.kind == g.kind].index(g.index)
        if g.kind == "kv":
            pairs = [(r[mine], m[mine]) for r, m in KV]
        else:
            pairs = [(STATE[0][mine], STATE[1][mine])]
        for r, m in pairs:
            written.add(m)
            for name in g.layers:
                assert page(here[name], m) == page(there[name], r)
    for g in groups:
        for name in g.layers:
            for b in range(here[name].shape[0]):
                if b not in written:
                    assert torch.equal(here[name][b], untouched[name][b]), (name, b)


def test_a_read_before_the_offer_is_known_still_frees_it(workers):
    producer, consumer, *_ = workers
    consumer.learn({"prefill": {0: producer.hello().to_dict()}})
    consumer.submit([pull()])
    until(lambda: bool(consumer.finished), consumer, producer)
    # the notification arrives before the plan names the offer: kept, not sent
    until(lambda: "p1" in producer._early, producer)
    assert producer.take()[0] == set()
    producer.offered(["p1"])
    assert producer.take()[0] == {"p1"}


def test_pulls_that_cannot_be_read_fail_and_name_their_blocks(workers):
    producer, consumer, _, here, _ = workers
    untouched = {n: t.clone() for n, t in here.items()}
    consumer.submit([pull("no-hello")])  # the scheduler never handed this engine's hello
    consumer.progress()
    consumer.learn({"prefill": {0: producer.hello().to_dict()}})
    consumer.submit([pull("late", lease_s=-1)])  # its lease over: never posted
    refused = Pull(
        request="refused",
        engine_id="prefill",
        remote_request="p2",
        host="127.0.0.1",
        port=1,
        kv_local=((3,),),
        refused="why",
    )
    consumer.submit([refused])
    consumer.progress()
    _, done, failed, errors = consumer.take()
    assert done == failed == {"no-hello", "late", "refused"}
    assert errors == pull().block_ids | {3}
    assert consumer.failures == 3 and not consumer.finished
    assert all(torch.equal(here[n], t) for n, t in untouched.items())  # nothing read


def test_an_offer_nobody_reads_is_sent_at_its_expiry_once(workers):
    producer, _, *_ = workers
    producer.offered(["p1", "p2"])
    producer.expired(["p1", "unknown"])
    assert producer.take()[0] == {"p1"}
    producer.expired(["p1"])
    assert producer.take()[0] == set()
