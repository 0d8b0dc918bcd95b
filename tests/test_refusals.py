"""Every public mutating operation: a refused call raises a kvarena.Error and leaves
every byte and every allocator exactly as it was.

Hypothesis drives random sequences of valid and invalid calls against one cache;
before each call the whole state is snapshotted (buffer bytes and both
allocators' books), and a refusal must leave the snapshot identical.
"""

import math
import os

import numpy as np
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
        (b.capacity, sorted(b._free._set), dict(b._refs), sorted(b._cached), list(b._lru)),
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
        "set_cached": lambda x: c.blocks.set_cached(x),
        "evict": lambda x: c.blocks.evict(x),
        "refresh": lambda x: c.blocks.refresh(x),
        "pin": lambda x: c.blocks.pin(x, "pin"),
        "allocate_state": lambda r: c.allocate_state(r),
        "free_state": lambda r: c.free_state(r),
        "grow_state": lambda n: c.grow_state(n),
        "shrink_state": lambda n: c.shrink_state(n),
        "block_write": lambda x: c.block_bytes_of(x).fill_(7),
        "slot_write": lambda x: c.slot_bytes_of(x).fill_(9),
        "store": lambda x: c.store(spec, x[0], x[1]),
        "restore": lambda x: c.restore(spec, x[1], x[0]),
        "rebalance": lambda x: c.rebalance(waiting_requests=x, blocks_needed=x),
        "page_units": lambda x: c.page_units(x),
    }


ARGS = {
    "allocate_state": REQUESTS,
    "free_state": REQUESTS,
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
