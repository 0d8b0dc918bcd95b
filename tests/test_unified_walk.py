"""A seeded random walk of the unified cache against an independent reference.

Blocks, request states and checkpoint images are written, stored, restored,
shared, cached, evicted and relocated by boundary moves both ways. A shadow
copy of the WHOLE buffer is updated from the reference's own rules (never by
reading the cache), and after every step the buffer must equal it byte for
byte, so a stray write anywhere — a gap, a free block, a block's tail, a
released slot — is caught where it happens. The reference also checks every
allocator's books. 20,000 steps by default (``KVARENA_WALK_STEPS``).
"""

import math
import os
import random

import numpy as np
import pytest
import torch
from conftest import plan_for

from kvarena import BoundaryMoveError, UnifiedCache
from kvarena.layout import EntryField, field_extents

STEPS = int(os.environ.get("KVARENA_WALK_STEPS", "20000"))

PAGE = [
    EntryField("k", 2, (4, 8), torch.bfloat16),
    # A non-zero fill aligned beyond 256: blocks have a tail past their fields.
    EntryField("scale", 1, (4,), torch.float32, fill=1.0, align=512),
]
STATE = [
    EntryField("conv", 2, (3, 40), torch.bfloat16),
    EntryField("ssm", 2, (2, 16), torch.float32),
    EntryField("score", 1, (8,), torch.float32, fill=-math.inf, in_checkpoint=False),
]


def fill_bytes(field: EntryField) -> np.ndarray:
    """A field's fill over its whole extent, as bytes (layers x shape of the dtype)."""
    n = field.layers * field.per_layer_numel
    return torch.full((n,), field.fill, dtype=field.dtype).view(torch.uint8).numpy()


class Walk:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        plan = plan_for(PAGE, STATE, 64 * 1024 + 300, 3, entries_per_req=2)
        self.c = UnifiedCache.from_plan(plan, "cpu")
        self.c.blocks.set_write_down(self.written_down)
        self.keys = 0
        self.buf = self.c.buf.numpy()  # a view: the cache's bytes as they are
        c = self.c
        self.stride, self.sstride = c.block_stride, c.slot_stride
        self.base = c.slot_base
        # The reference's books.
        self.refs: dict[int, int] = {}  # live block -> references
        self.cached: set[int] = set()  # cached blocks (live or evictable)
        self.evictable: set[int] = set()
        self.requests: dict[int, list[int]] = {}
        self.images: list[dict] = []  # {"units", "spec", "bytes"}; units held live by us
        self.specs = [c.checkpoint_spec(), c.checkpoint_spec(256)]
        self.next_request = 0
        self.moved_blocks = self.moved_slots = self.refused_moves = self.evictions = 0
        # The expected initial bytes, from the declarations alone.
        self.shadow = np.zeros(c.buf.numel(), dtype=np.uint8)
        for b in range(plan.blocks):
            self.page_fill(b)
        for s in range(c.total_slots - plan.state_slots, c.total_slots):
            self.slot_reset(s)
        self.check("construction")

    # -- the reference's rules for bytes -------------------------------------------------
    def page_fill(self, b: int) -> None:
        for ext in field_extents(PAGE):
            if not ext.field.fill_is_zero_bits:
                at = b * self.stride + ext.start
                self.shadow[at : at + ext.nbytes] = fill_bytes(ext.field)

    def slot_at(self, s: int) -> int:
        return self.base + s * self.sstride

    def slot_reset(self, s: int) -> None:
        at = self.slot_at(s)
        self.shadow[at : at + self.c.slot_bytes] = 0
        for ext in field_extents(STATE):
            if not ext.field.fill_is_zero_bits:
                self.shadow[at + ext.start : at + ext.end] = fill_bytes(ext.field)

    def check(self, what: str) -> None:
        if not np.array_equal(self.buf, self.shadow):
            bad = np.nonzero(self.buf != self.shadow)[0]
            raise AssertionError(f"after {what}: {bad.size} bytes differ, first at {int(bad[0])}")

    def check_books(self) -> None:
        b, s = self.c.blocks, self.c.slots
        assert {x for x in range(b.capacity) if b.refcount(x)} == set(self.refs)
        assert all(b.refcount(x) == n for x, n in self.refs.items())
        assert set(b.evictable_blocks()) == self.evictable
        assert b.num_free == b.capacity - len(self.refs) - len(self.evictable)
        assert {r: list(s.slots_of(r)) for r in s.requests} == self.requests

    # -- the write-down sink ------------------------------------------------------------
    def written_down(self, victims) -> None:
        """Victims arrive before anything changes, every one still evictable here."""
        for v in victims:
            for b in v.blocks:
                self.evicted(b)

    def evicted(self, block: int) -> None:
        assert block in self.evictable and block not in self.refs
        self.evictable.discard(block)
        self.cached.discard(block)
        self.evictions += 1

    # -- steps ---------------------------------------------------------------------------
    def pattern(self, n: int) -> np.ndarray:
        return np.frombuffer(self.rng.randbytes(n), dtype=np.uint8)

    def live_blocks(self) -> list[int]:
        return sorted(self.refs)

    def step_allocate(self) -> None:
        k = self.rng.randint(1, 6)
        b = self.c.blocks
        # Keep a third of the pool for moves to relocate into (a full pool jams).
        if k > b.num_free + b.num_evictable or len(self.refs) + k > 2 * b.capacity // 3:
            return
        for x in b.allocate(k):
            assert x not in self.refs and x not in self.evictable
            self.refs[x] = 1

    def image_units(self) -> set[int]:
        return {u for img in self.images for u in img["units"]}

    def step_write_block(self) -> None:
        live = [x for x in self.live_blocks() if x not in self.image_units()]  # images are ours
        if live:
            x = self.rng.choice(live)
            data = self.pattern(self.c.block_bytes)
            self.c.block_bytes_of(x).copy_(torch.from_numpy(data.copy()))
            self.shadow[x * self.stride : x * self.stride + data.size] = data

    def step_release(self) -> None:
        live = [x for x in self.live_blocks() if x not in self.image_units()]
        if live:
            x = self.rng.choice(live)
            self.c.blocks.release(x)
            self.refs[x] -= 1
            if not self.refs[x]:
                del self.refs[x]
                if x in self.cached:
                    self.evictable.add(x)

    def step_cache(self) -> None:
        live = self.live_blocks()
        if live:
            x = self.rng.choice(live)
            if x not in self.cached:  # a block holds one key
                self.keys += 1
                self.c.blocks.cache(("k", self.keys), [x])
                self.cached.add(x)

    def step_retain(self) -> None:
        pool = self.live_blocks() + sorted(self.evictable)
        if pool:
            x = self.rng.choice(pool)
            self.c.blocks.retain(x)
            self.evictable.discard(x)
            self.refs[x] = self.refs.get(x, 0) + 1

    def step_allocate_state(self) -> None:
        if self.c.slots.num_free < 2:
            return
        r = self.next_request
        self.next_request += 1
        slots = self.c.allocate_slots(r)
        self.requests[r] = list(slots)
        for s in slots:
            self.slot_reset(s)

    def step_write_slot(self) -> None:
        if self.requests:
            s = self.rng.choice(self.requests[self.rng.choice(sorted(self.requests))])
            data = self.pattern(self.c.slot_bytes)
            self.c.slot_bytes_of(s).copy_(torch.from_numpy(data.copy()))
            self.shadow[self.slot_at(s) : self.slot_at(s) + data.size] = data

    def step_free_state(self) -> None:
        if self.requests:
            r = self.rng.choice(sorted(self.requests))
            assert list(self.c.release_slots(r)) == self.requests.pop(r)

    def step_store(self) -> None:
        if not self.requests:
            return
        spec = self.rng.choice(self.specs)
        b = self.c.blocks
        if spec.units_per_image > b.num_free + b.num_evictable:
            return
        s = self.rng.choice(self.requests[self.rng.choice(sorted(self.requests))])
        units = b.allocate(spec.units_per_image)
        for x in units:
            self.refs[x] = 1
        self.c.store(spec, [s], [units])
        at = self.slot_at(s)
        image = np.concatenate([self.shadow[at + o : at + o + n] for o, n in spec.ranges])
        for i, u in enumerate(units):
            part = image[i * spec.unit_bytes : (i + 1) * spec.unit_bytes]
            self.shadow[u * self.stride : u * self.stride + part.size] = part
        self.images.append({"units": units, "spec": spec, "bytes": image})

    def step_restore(self) -> None:
        if not self.images or not self.requests:
            return
        img = self.rng.choice(self.images)
        s = self.rng.choice(self.requests[self.rng.choice(sorted(self.requests))])
        self.c.restore(img["spec"], [s], [img["units"]])
        at, pos = self.slot_at(s), 0
        for o, n in img["spec"].ranges:
            self.shadow[at + o : at + o + n] = img["bytes"][pos : pos + n]
            pos += n

    def step_drop_image(self) -> None:
        if self.images:
            img = self.images.pop(self.rng.randrange(len(self.images)))
            for u in img["units"]:
                self.c.blocks.release(u)
                self.refs[u] -= 1
                if not self.refs[u]:
                    del self.refs[u]
                    if u in self.cached:
                        self.evictable.add(u)

    def apply(self, move) -> None:
        before = self.shadow.copy()
        for old, new in move.block_remap.items():
            self.shadow[new * self.stride : (new + 1) * self.stride] = before[
                old * self.stride : (old + 1) * self.stride
            ]
        remap = move.block_remap
        self.refs = {remap.get(x, x): n for x, n in self.refs.items()}
        self.cached = {remap.get(x, x) for x in self.cached}
        for img in self.images:
            img["units"] = [remap.get(u, u) for u in img["units"]]
        for old, new in move.slot_remap.items():
            self.shadow[self.slot_at(new) : self.slot_at(new) + self.sstride] = before[
                self.slot_at(old) : self.slot_at(old) + self.sstride
            ]
        self.requests = {
            r: [move.slot_remap.get(s, s) for s in slots] for r, slots in self.requests.items()
        }
        for b in range(move.blocks_before, move.blocks_after):
            self.page_fill(b)  # blocks won from STATE start from the PAGE fills

    def step_move(self) -> None:
        """Move the boundary toward a random target, so the walk sweeps between
        many slots and many blocks instead of drifting to one end."""
        n = self.rng.randint(1, 3)
        grow = self.c.num_slots < self.rng.randint(4, 30)
        try:
            move = self.c.grow_state(n) if grow else self.c.shrink_state(n)
        except BoundaryMoveError:
            self.refused_moves += 1
            return  # refused: the buffer check after the step proves nothing moved
        self.moved_blocks += len(move.block_remap)
        self.moved_slots += len(move.slot_remap)
        self.apply(move)

    def step_rebalance(self) -> None:
        move = self.c.rebalance(
            waiting_requests=self.rng.randint(0, 2), blocks_needed=self.rng.randint(0, 12)
        )
        if move is not None:
            self.apply(move)

    def run(self, steps: int) -> dict[str, int]:
        names = [n for n in dir(self) if n.startswith("step_")]
        weights = {
            "step_write_block": 3,
            "step_write_slot": 3,
            "step_allocate": 2,
            "step_release": 4,
            "step_allocate_state": 3,
            "step_free_state": 2,
            "step_store": 2,
            "step_drop_image": 2,
            "step_move": 4,
        }
        choices = [n for n in names for _ in range(weights.get(n, 1))]
        counts = dict.fromkeys(names, 0)
        for i in range(steps):
            name = self.rng.choice(choices)
            getattr(self, name)()
            counts[name] += 1
            self.check(f"step {i} ({name})")
            if i % 64 == 0:
                self.check_books()
        self.check_books()
        return counts


@pytest.mark.parametrize("seed", [20261130, 7])
def test_random_walk_keeps_every_byte_where_the_reference_says(seed):
    walk = Walk(seed=seed)
    counts = walk.run(STEPS)
    # The walk really exercised what it is for: relocations of blocks (images among
    # them) and of states, refused moves, evictions, stores and restores.
    scale = STEPS / 20_000
    assert walk.moved_blocks > 200 * scale and walk.moved_slots > 50 * scale
    assert walk.refused_moves > 50 * scale and walk.evictions > 50 * scale
    assert counts["step_store"] > 500 * scale and counts["step_restore"] > 500 * scale
