"""The unified cache against a plain reference model, step by step.

Random allocate / free / share / cache / write / grow / shrink / rebalance
steps; after each, every live block and state, followed through the remaps,
holds exactly the bytes written to it, and the allocators' books balance.
"""

import math
import os

import numpy as np
import torch
from conftest import plan_for
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvarena import EntryField
from kvarena.pools import BoundaryMoveError, UnifiedCache
from kvarena.pools.blocks import EVICTABLE, LIVE

EXAMPLES = int(os.environ.get("KVARENA_STATEFUL_EXAMPLES", "50"))
STEPS = 60  # 50 examples of up to 60 steps: about 3,000 steps by default

PAGE_FIELDS = [
    EntryField("k", 2, (4, 8), torch.bfloat16),
    EntryField("v", 2, (4, 8), torch.bfloat16),
]
STATE_FIELDS = [
    EntryField("conv", 2, (3, 40), torch.bfloat16),
    EntryField("ssm", 2, (2, 16, 8), torch.float32),
    EntryField("score", 1, (8,), torch.float32, fill=-math.inf, in_checkpoint=False),
]


def pattern(seed: int, n: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


class UnifiedCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        plan = plan_for(PAGE_FIELDS, STATE_FIELDS, 48 * 1024, 2, block_size=4, entries_per_req=2)
        self.cache = UnifiedCache.from_plan(plan, "cpu")
        self.cache.blocks.set_write_down(self._written_down)
        self.handles: dict[int, dict] = {}  # handle -> {"id", "refs", "cached", "seed"}
        self.requests: dict[int, dict[int, int]] = {}  # request -> {slot: seed}
        self.next = 0

    def _written_down(self, victims) -> None:
        for v in victims:
            for b in v.blocks:
                self._evicted(b)

    def _evicted(self, block: int) -> None:
        owners = [h for h, v in self.handles.items() if v["id"] == block]
        assert len(owners) == 1 and self.handles[owners[0]]["refs"] == 0
        del self.handles[owners[0]]

    def _live(self):
        return [h for h, v in self.handles.items() if v["refs"] > 0]

    @rule(k=st.integers(1, 24))
    def allocate_blocks(self, k):
        c = self.cache.blocks
        if k > c.num_free + c.num_evictable:
            return
        for b in self.cache.blocks.allocate(k):
            self.handles[self.next] = {"id": b, "refs": 1, "cached": False, "seed": None}
            self.next += 1

    @rule(data=st.data(), seed=st.integers(0, 2**30))
    def write_block(self, data, seed):
        live = self._live()
        if live:
            h = data.draw(st.sampled_from(live))
            self.cache.block_bytes_of(self.handles[h]["id"]).copy_(
                pattern(seed, self.cache.block_bytes)
            )
            self.handles[h]["seed"] = seed

    @rule(data=st.data())
    def share(self, data):
        if self.handles:
            h = data.draw(st.sampled_from(sorted(self.handles)))
            self.cache.blocks.retain(self.handles[h]["id"])
            self.handles[h]["refs"] += 1

    @rule(data=st.data())
    def mark_cached(self, data):
        live = self._live()
        if live:
            h = data.draw(st.sampled_from(live))
            if not self.handles[h]["cached"]:  # a block holds one key
                self.cache.blocks.cache(("handle", h), [self.handles[h]["id"]])
                self.handles[h]["cached"] = True

    def _release(self, h):
        self.cache.blocks.release(self.handles[h]["id"])
        self.handles[h]["refs"] -= 1
        if self.handles[h]["refs"] == 0 and not self.handles[h]["cached"]:
            del self.handles[h]  # free: its bytes are no one's now

    @rule(data=st.data())
    def release(self, data):
        live = self._live()
        if live:
            self._release(data.draw(st.sampled_from(live)))

    @rule(k=st.integers(1, 12))
    def release_lowest(self, k):
        # Frees the bottom of the PAGE region while the top stays live: the
        # fragmentation that makes a STATE grow relocate blocks.
        for h in sorted(self._live(), key=lambda h: self.handles[h]["id"])[:k]:
            self._release(h)

    @rule()
    def free_topmost_state(self):
        # Frees the top of the STATE region while lower slots stay live: the
        # fragmentation that makes a STATE shrink relocate states.
        if self.requests:
            req = max(self.requests, key=lambda r: max(self.requests[r]))
            self.cache.release_slots(req)
            del self.requests[req]

    @rule(seed=st.integers(0, 2**30))
    def allocate_slots(self, seed):
        if self.cache.slots.num_free < self.cache.slots.entries_per_req:
            return
        req = self.next
        self.next += 1
        slots = self.cache.allocate_slots(req)
        self.requests[req] = {}
        for i, s in enumerate(slots):
            self.cache.slot_bytes_of(s).copy_(pattern(seed + i, self.cache.slot_bytes))
            self.requests[req][s] = seed + i

    @rule(seed=st.integers(0, 2**30))
    def fill_state(self, seed):
        # Requests down to the lowest slot, so that a later shrink finds live states.
        while self.cache.slots.num_free >= self.cache.slots.entries_per_req:
            self.allocate_slots(seed)
            seed += 7

    @rule(data=st.data())
    def release_slots(self, data):
        if self.requests:
            req = data.draw(st.sampled_from(sorted(self.requests)))
            freed = self.cache.release_slots(req)
            assert set(freed) == set(self.requests.pop(req))

    def _move(self, fn, n):
        before = self.cache.buf.clone()
        counts = (
            self.cache.num_blocks,
            self.cache.num_slots,
            self.cache.blocks.num_live,
            self.cache.slots.num_live,
        )
        try:
            move = fn(n)
        except BoundaryMoveError:
            assert torch.equal(self.cache.buf, before)
            assert counts == (
                self.cache.num_blocks,
                self.cache.num_slots,
                self.cache.blocks.num_live,
                self.cache.slots.num_live,
            )
            return
        self._apply(move)

    def _apply(self, move):
        if move is None:
            return
        for v in self.handles.values():
            v["id"] = move.block_remap.get(v["id"], v["id"])
        for req, slots in self.requests.items():
            self.requests[req] = {move.slot_remap.get(s, s): seed for s, seed in slots.items()}

    @rule(n=st.integers(0, 8))
    def grow_state(self, n):
        self._move(self.cache.grow_state, n)

    @rule(n=st.integers(0, 8))
    def shrink_state(self, n):
        self._move(self.cache.shrink_state, n)

    @rule(waiting=st.integers(0, 4), needed=st.integers(0, 40))
    def rebalance(self, waiting, needed):
        self._apply(self.cache.rebalance(waiting_requests=waiting, blocks_needed=needed))

    @invariant()
    def bytes_follow_remaps(self):
        for v in self.handles.values():
            if v["seed"] is not None:
                assert torch.equal(
                    self.cache.block_bytes_of(v["id"]), pattern(v["seed"], self.cache.block_bytes)
                )
        for slots in self.requests.values():
            for s, seed in slots.items():
                assert torch.equal(
                    self.cache.slot_bytes_of(s), pattern(seed, self.cache.slot_bytes)
                )

    @invariant()
    def books_balance(self):
        blocks, slots = self.cache.blocks, self.cache.slots
        assert blocks.num_free + blocks.num_live + blocks.num_evictable == blocks.capacity
        ids = [v["id"] for v in self.handles.values()]
        assert len(ids) == len(set(ids)) and all(0 <= b < blocks.capacity for b in ids)
        for v in self.handles.values():
            assert not blocks.is_free(v["id"])
            assert blocks.refcount(v["id"]) == v["refs"]
            assert blocks.is_evictable(v["id"]) == (v["refs"] == 0)
            assert blocks.is_cached(v["id"]) == v["cached"]
        # The kind array the allocator checks ids against agrees with its books.
        kinds = blocks._region.kind
        assert kinds.size == blocks.capacity
        assert sorted(np.flatnonzero(kinds == LIVE).tolist()) == blocks.live_blocks()
        assert sorted(np.flatnonzero(kinds == EVICTABLE).tolist()) == sorted(
            blocks.evictable_blocks()
        )
        held = [s for r in self.requests.values() for s in r]
        assert len(held) == len(set(held)) == slots.num_live
        assert all(slots.first <= s < slots.total and not slots.is_free(s) for s in held)
        assert slots.num_free + slots.num_live == slots.capacity
        # PAGE blocks end at or below the first STATE slot: the pools never overlap.
        assert (
            blocks.capacity * self.cache.block_stride
            <= self.cache.slot_base + slots.first * self.cache.slot_stride
        )


UnifiedCacheMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None
)
TestUnifiedCache = UnifiedCacheMachine.TestCase
