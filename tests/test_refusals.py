"""Every public mutating operation: a refused call raises a kvarena.Error and leaves
every byte and every allocator exactly as it was.

Hypothesis drives random sequences of valid and invalid calls against one cache;
before each call the whole state is snapshotted (buffer bytes and both
allocators' books), and a refusal must leave the snapshot identical.
"""

import math
import os

import numpy as np
import pytest
import torch
from conftest import plan_for
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarena import Error, UnifiedCache
from kvarena.layout import EntryField

PAGE = [
    EntryField("k", 2, (4, 8), torch.bfloat16),
    EntryField("scale", 1, (4,), torch.float32, fill=1.0, align=512),
]
STATE = [
    EntryField("conv", 2, (3, 40), torch.bfloat16),
    EntryField("score", 1, (8,), torch.float32, fill=-math.inf, in_checkpoint=False),
]

# Values a caller might pass where an id or a count belongs: valid ones, out of
# range, negative, and the wrong kinds (bool, float, str, None, lists, tensors).
WEIRD = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([True, False, 2.0, 2.9, "3", None, [1], -(2**63), 2**63, float("nan")]),
    st.integers(0, 40).map(np.int64),
    st.integers(0, 40).map(lambda i: torch.tensor(i)),
)
IDS = st.one_of(st.lists(WEIRD, max_size=4), WEIRD, st.just(np.array([0.5])))
REQUESTS = st.one_of(st.integers(0, 5), st.sampled_from([None, "r", ("t", 1), [1], {}]))


def snapshot(c: UnifiedCache):
    b, s = c.blocks, c.slots
    return (
        c.buf.clone(),
        (
            b.capacity,
            sorted(b._region.free._set),
            b._region.refs.tolist(),
            sorted((repr(k), b.blocks_of(k)) for k in b.keys()),
            list(b._lru),
        ),
        (s.first, sorted(s._free._set), dict(s._owner), {k: list(v) for k, v in s._slots.items()}),
    )


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def operations(c: UnifiedCache, spec):
    """Name -> callable taking one drawn argument."""
    return {
        "allocate": lambda x: c.blocks.allocate(x),
        "release": lambda x: c.blocks.release(x),
        "retain": lambda x: c.blocks.retain(x),
        "cache": lambda x: c.blocks.cache(("k", repr(x)), [x] if isinstance(x, int) else x),
        "evict": lambda x: c.blocks.evict(x),
        "refresh": lambda x: c.blocks.refresh(x),
        "pin": lambda x: c.blocks.pin(x, "pin"),
        "allocate_slots": lambda r: c.allocate_slots(r),
        "release_slots": lambda r: c.release_slots(r),
        "grow_state": lambda n: c.grow_state(n),
        "shrink_state": lambda n: c.shrink_state(n),
        "block_write": lambda x: c.block_bytes_of(x).fill_(7),
        "slot_write": lambda x: c.slot_bytes_of(x).fill_(9),
        "store": lambda x: c.store(spec, x[0], x[1]),
        "restore": lambda x: c.restore(spec, x[0], x[1]),
        "rebalance": lambda x: c.rebalance(waiting_requests=x, blocks_needed=x),
        "page_units": lambda x: c.page_units(x),
    }


ARGS = {
    "allocate_slots": REQUESTS,
    "release_slots": REQUESTS,
    "store": st.tuples(IDS, st.lists(IDS, max_size=3)),
    "restore": st.tuples(IDS, st.lists(IDS, max_size=3)),
    "pin": IDS,
}


@settings(max_examples=int(os.environ.get("KVARENA_REFUSAL_EXAMPLES", "60")), deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_refused_calls_change_nothing(data, seed):
    c = UnifiedCache.from_plan(plan_for(PAGE, STATE, 48 * 1024, 4, entries_per_req=1), "cpu")
    spec = c.checkpoint_spec()
    ops = operations(c, spec)
    refused = 0
    for _ in range(30):
        name = data.draw(st.sampled_from(sorted(ops)))
        arg = data.draw(ARGS.get(name, WEIRD))
        before = snapshot(c)
        try:
            ops[name](arg)
        except Error:
            refused += 1
            assert same(before, snapshot(c)), (name, arg)
        except Exception as exc:  # anything but a kvarena.Error is a defect
            raise AssertionError(f"{name}({arg!r}) raised {type(exc).__name__}: {exc}") from exc
        b, s = c.blocks, c.slots
        assert b.num_free + b.num_live + b.num_evictable == b.capacity
        assert s.num_free + s.num_live == s.capacity


def _doors():
    """Nonsense at every public door: each must be a typed kvarena refusal."""
    import kvarena as kv
    from kvarena import copy as C
    from kvarena import layout as L
    from kvarena.pools import BlockAllocator, StateAllocator
    from kvarena.report import plan_report

    F = kv.EntryField
    f = [F("a", 2, (4, 8), torch.bfloat16)]
    m = kv.model_cache("qwen3-next-80b-a3b", kv.ServingOptions(tp=8))
    p = kv.plan_cache(m, budget_bytes=256 << 20, max_seqs=2)
    c = UnifiedCache.from_plan(p, "cpu")
    spec = c.checkpoint_spec()
    top = c.total_slots - 1
    z = torch.zeros(4, dtype=torch.uint8)
    huge = 2**80
    return {
        "field huge layers": lambda: F("x", huge, (1,), torch.uint8),
        "field huge dim": lambda: F("x", 1, (huge,), torch.uint8),
        "field shape str": lambda: F("x", 1, "abc", torch.uint8),
        "field dtype str": lambda: F("x", 1, (1,), "bfloat16"),
        "field fill huge": lambda: F("x", 1, (1,), torch.float32, fill=10**400),
        "field align huge": lambda: F("x", 1, (1,), torch.float32, align=2**70),
        "checkpoint unit huge": lambda: kv.CheckpointSpec.build(f, 2**70),
        "checkpoint fields str": lambda: kv.CheckpointSpec.build("abc", 256),
        "options tp str": lambda: kv.ServingOptions(tp="2"),
        "model int": lambda: kv.model_cache(123),
        "model options dict": lambda: kv.model_cache("llama-3.1-8b", {"tp": 2}),
        "plan budget huge": lambda: kv.plan_cache(m, budget_bytes=2**70, max_seqs=1),
        "plan seqs huge": lambda: kv.plan_cache(m, budget_bytes=2**30, max_seqs=2**70),
        "cache device object": lambda: UnifiedCache.from_plan(p, object()),
        "cache device nonsense": lambda: UnifiedCache.from_plan(p, "nonsense"),
        "write-down not callable": lambda: c.blocks.set_write_down(5),
        "view list name": lambda: c.state_view(["k"]),
        "grow float": lambda: c.grow_state(1.5),
        "grow huge": lambda: c.grow_state(2**70),
        "units huge": lambda: c.page_units(2**70),
        "store slots str": lambda: c.store(spec, "ab", [[0]]),
        "store units None": lambda: c.store(spec, [top], None),
        "store units nested": lambda: c.store(spec, [top], [[[0]]]),
        "restore units dict": lambda: c.restore(spec, [top], [{}]),
        "allocate str": lambda: c.blocks.allocate("3"),
        "allocate huge": lambda: c.blocks.allocate(2**70),
        "arena entries huge": lambda: L.EntryMajorArena(f, 10**12, "cpu"),
        "arena stride huge": lambda: L.EntryMajorArena(f, 2, "cpu", slot_stride=2**70),
        "arena buf list": lambda: L.EntryMajorArena(f, 2, "cpu", buf=[0] * 1000),
        "layer-major huge": lambda: L.LayerMajorArena(f, 2**62, "cpu"),
        "carve huge": lambda: L.carve(z, [2**70]),
        "planes huge": lambda: L.plan_field_planes(f, [2**70]),
        "segments huge": lambda: C.plan_segmented_copy([2**70], [1], 1),
        "batch of lists of floats": lambda: C.CopyBatch([0.5], [0], [1]),
        "execute path": lambda: C.execute_batch(C.CopyBatch([0], [0], [1]), z, z, path="x"),
        "state allocator huge": lambda: StateAllocator(2**70, 1),
        "block allocator huge": lambda: BlockAllocator(2**40),
        "from_fields block size": lambda: kv.ModelCache.from_fields(f, [], block_size=0),
        "fingerprint None": lambda: kv.layout_fingerprint(None),
        "report context": lambda: plan_report(p, context_tokens=-1),
    }


def test_nonsense_at_every_door_is_a_typed_refusal():
    for name, call in _doors().items():
        try:
            call()
        except Error:
            continue
        except Exception as exc:
            raise AssertionError(f"{name}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError(f"{name}: accepted")


def test_a_bool_among_integer_ids_is_refused():
    """numpy reads ``[1, True]`` as ``[1, 1]``; the id check must not."""
    from kvarena.checks import check_ids
    from kvarena.pools.blocks import BlockAllocator

    for ids in ([1, True], (0, np.False_), [2, 3, False]):
        with pytest.raises(Error, match="must be an int"):
            check_ids(ids, "ids", lo=0, hi=8)
    blocks = BlockAllocator(8)
    held = blocks.allocate(2)
    with pytest.raises(Error, match="must be an int"):
        blocks.pin([held[1], True], "pin")
    assert [blocks.refcount(b) for b in held] == [1, 1]
    assert check_ids([1, 2, np.int64(3)], "ids", lo=0, hi=8).tolist() == [1, 2, 3]
