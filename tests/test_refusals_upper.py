"""Random valid and invalid calls at the prefix cache, the tier stack and the
transformers pool: a refused call raises a kvarena.Error and leaves every book as it
was (the buffer's bytes, both allocators, the prefix cache's keys, images, running
requests and metrics, each tier's index), as the unified cache's own test does."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_refusals import WEIRD
from test_tier_prefix import make

from kvarena import Error
from kvarena.tiers import HostTier, TierObject, TierStack

EXAMPLES = int(os.environ.get("KVARENA_REFUSAL_EXAMPLES", "40"))

TOKENS = st.one_of(
    st.lists(st.integers(0, 30), min_size=1, max_size=24),
    st.sampled_from(
        [[], [-1, 2], [1.5], "abc", None, [[1, 2]], [True, 2], torch.arange(3, device="meta")]
    ),
)
EXTRA = st.sampled_from([(), ("lora",), "lora", [float("nan")], [[[[[[[[[["x"]]]]]]]]]], 5])
REQUEST = st.one_of(st.integers(0, 3), st.sampled_from([None, [1], {}, "r"]))


def books(pc) -> tuple:
    c = pc.cache
    b, s = c.blocks, c.slots
    host = pc.tiers.tiers[0]
    return (
        c.buf.clone(),
        (
            sorted(b._region.free._set),
            b._region.refs.tolist(),
            sorted(map(repr, b.keys())),
            list(b._lru),
        ),
        (sorted(s._free._set), dict(s._owner)),
        (sorted(pc._copying), sorted(pc._running, key=repr), sorted(pc.placement._wanted)),
        pc.metrics.to_dict(),
        (list(host._index.items()), host.used_bytes, sorted(host._free._set)),
    )


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


CALLS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), REQUEST, TOKENS, EXTRA, WEIRD),
        st.tuples(st.just("lookup"), TOKENS, EXTRA),
        st.tuples(st.just("commit"), REQUEST, WEIRD),
        st.tuples(st.just("checkpoint"), REQUEST, WEIRD),
        st.tuples(st.just("finish"), REQUEST),
        st.tuples(st.just("rebalance"), WEIRD, WEIRD),
        st.tuples(st.just("drain"), WEIRD),
        st.tuples(st.just("put"), st.sampled_from(["kv-a", "../x", "", 5]), WEIRD),
    ),
    max_size=25,
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(calls=CALLS)
def test_refused_calls_change_no_book(calls):
    pc = make(TierStack([HostTier(8 * 1024, frame_bytes=512)]), budget=24 * 1024)
    for call in calls:
        name, *args = call
        before = books(pc)
        try:
            if name == "admit":
                request, tokens, extra, reserve = args
                pc.admit(request, tokens, extra=extra, reserve_tokens=reserve)
            elif name == "lookup":
                pc.lookup(*args)
            elif name == "commit":
                pc.commit(*args)
            elif name == "checkpoint":
                pc.checkpoint(*args)
            elif name == "finish":
                pc.finish(*args)
            elif name == "rebalance":
                pc.rebalance(waiting_requests=args[0], blocks_needed=args[1])
            elif name == "drain":
                pc.drain(args[0])
            else:
                obj_name, size = args
                pc.tiers.write_back([TierObject(obj_name, (b"x",), size)])
        except Error:
            assert same(before, books(pc)), call
        except Exception as exc:  # anything but a kvarena.Error is a defect
            raise AssertionError(f"{call!r} raised {type(exc).__name__}: {exc}") from exc
        pc.check_books()
        pc.tiers.tiers[0].check_books()


transformers = pytest.importorskip("transformers")


def pool_books(pool) -> tuple:
    c = pool.cache
    b, s = c.blocks, c.slots
    return (
        c.buf.clone(),
        (
            sorted(b._region.free._set),
            b._region.refs.tolist(),
            sorted(map(repr, b.keys())),
            len(c.holdings),
        ),
        (sorted(s._free._set), dict(s._owner)),
        pool.live_caches,
        pool.prefix.metrics.to_dict(),
    )


@pytest.fixture(scope="module")
def tiny():
    from kvarena.integrations.transformers import KvarenaPool
    from kvarena.integrations.transformers.tiny import tiny_model

    model = tiny_model("qwen3_next")
    return model, lambda: KvarenaPool.from_config(model.config, budget_bytes=4 << 20, max_seqs=2)


POOL_CALLS = st.lists(
    st.one_of(
        st.tuples(st.just("new_cache"), WEIRD),
        st.tuples(
            st.just("prefill"),
            st.sampled_from(
                [
                    torch.ones(1, 5, dtype=torch.long),
                    torch.ones(2, 5, dtype=torch.long),
                    torch.ones(1, 0, dtype=torch.long),
                    torch.full((1, 5), 10**7),
                    torch.full((1, 5), -3),
                    torch.ones(1, 5),
                    [[1, 2]],
                ]
            ),
        ),
        st.tuples(st.just("release"), st.integers(0, 3)),
        st.tuples(
            st.just("reorder"),
            st.integers(0, 3),
            st.sampled_from([[0], torch.tensor([[0]]), torch.tensor([0.0]), torch.tensor([5])]),
        ),
        st.tuples(st.just("crop"), st.integers(0, 3), WEIRD),
    ),
    max_size=12,
)


@settings(max_examples=max(5, EXAMPLES // 4), deadline=None)
@given(calls=POOL_CALLS)
def test_refused_pool_calls_change_no_book(tiny, calls):
    model, new_pool = tiny
    pool = new_pool()
    caches: list = []
    for call in calls:
        name, *args = call
        before = pool_books(pool)
        try:
            if name == "new_cache":
                caches.append(pool.new_cache(args[0]))
            elif name == "prefill":
                caches.append(pool.prefill(model, args[0]))
            elif name == "release":
                if not caches:
                    continue
                pool.release(caches[args[0] % len(caches)])  # twice: refused
            elif name == "reorder":
                if not caches:
                    continue
                caches[args[0] % len(caches)].reorder_cache(args[1])
            else:
                if not caches:
                    continue
                caches[args[0] % len(caches)].crop(args[1])
        except Error:
            assert same(before, pool_books(pool)), call
        except Exception as exc:
            raise AssertionError(f"{call!r} raised {type(exc).__name__}: {exc}") from exc
    for c in caches:
        if not c.released:
            pool.release(c)
    assert pool.live_caches == 0 and pool.cache.blocks.num_live == 0
    assert np.all(np.asarray(pool.cache.slots.num_free == pool.cache.slots.capacity))
