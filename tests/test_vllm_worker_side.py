"""The connector's worker half over vLLM's own CPU cache tensors, without an
engine: a save lands in every tier, a load copies checked bytes into exactly
the blocks named, and a load no tier can serve is reported as failed, by its
request and its blocks, with nothing copied.

Runs in the ``.venv-vllm`` environment; skipped where vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

pytest.importorskip("vllm")

from kvarena.integrations.vllm.groups import classify
from kvarena.integrations.vllm.ranks import rank_key
from kvarena.integrations.vllm.records import BlockCopy, Load, StepPlan
from kvarena.integrations.vllm.worker_side import WorkerSide
from kvarena.testing.vllm_tensors import BLOCK_SIZE, allocation, fill, page
from kvarena.tiers import DiskTier, HostTier, TierStack
from kvarena.tiers.names import ImageKind, object_name

NS = b'{"model":"tiny","rank":0}'
K = [bytes([i]) * 16 for i in range(1, 5)]


@pytest.fixture
def worker(tmp_path):
    kc, caches = allocation("LBHNC", states=1)
    groups = classify(kc)
    tiers = TierStack([HostTier(8 << 20, frame_bytes=64 << 10), DiskTier(tmp_path / "d", 64 << 20)])
    w = WorkerSide(
        groups=groups, namespace=NS, tiers=tiers, block_size=BLOCK_SIZE, save_backlog=1 << 30
    )
    w.register(caches, kc.num_blocks)
    yield w, caches, groups, kc.num_blocks
    w.close()


def finish_loads(w) -> None:
    """The next step: every load the I/O threads fetched is copied in and reported."""
    w.queue.wait()
    w.load(StepPlan())


def test_a_load_from_below_the_host_is_fetched_off_the_step_and_copied_in_a_later_one(worker):
    """A load the host tier cannot serve whole goes to the I/O threads: the step
    that asks for it returns at once and reports nothing; a later step copies the
    fetched bytes in and reports it; one past its deadline is given up (failed:
    vLLM recomputes), whatever its thread fetches later."""
    w, caches, groups, _ = worker
    fill(caches, seed=6)
    w.save(StepPlan(kv_saves=[BlockCopy(index=0, key=K[2], blocks=(2,))]))
    w.flush()
    want = _pages(caches, groups, "kv", 2)
    w.tiers.tiers[0].delete_many([object_name(ImageKind.KV_BLOCK, K[2])])  # only on disk now
    fill(caches, seed=7)
    disk_load = Load(
        request="d", kv=(BlockCopy(index=0, key=K[2], blocks=(5,), level=1),), state=None
    )
    w.load(StepPlan(loads=[disk_load]))
    assert w.received() == (set(), set()) and len(w.queue) == 1  # in flight, the step goes on
    finish_loads(w)
    assert w.received() == ({"d"}, set()) and _pages(caches, groups, "kv", 5) == want
    late = Load(request="e", kv=(BlockCopy(index=0, key=K[2], blocks=(6,), level=1),), state=None)
    before = _pages(caches, groups, "kv", 6)
    disk = w.tiers.tiers[1]
    stuck, read = threading.Event(), disk.get_many
    disk.get_many = lambda names: (stuck.wait(), read(names))[1]  # a read that hangs
    w.queue.deadline_s = 0.0  # past its deadline at the next step
    w.load(StepPlan(loads=[late]))
    w.load(StepPlan())
    assert w.received() == ({"e"}, {"e"}) and w.load_errors() == {6}  # given up: recompute
    stuck.set()  # the read comes back late
    w.queue.wait()
    w.load(StepPlan())
    assert w.received() == (set(), set())
    assert _pages(caches, groups, "kv", 6) == before  # its fetched bytes were dropped
    report = w.report()
    assert report is not None and [t.failures for t in report.loads if t.key == "e"] == [
        {object_name(ImageKind.KV_BLOCK, K[2]): "timeout"}
    ]
    # reported failed: the scheduler does not promise it again until it is saved again
    assert report.failed == [object_name(ImageKind.KV_BLOCK, K[2])]


def test_fetched_loads_land_a_steps_bytes_at_a_time_in_the_order_asked(worker):
    """Three loads fetched together (a store answering at once): a step with room
    for one load's bytes copies in and reports one, the first asked, the next
    step the next, none given up however long it waited once fetched; each
    copy's bytes and seconds are reported (what paces the landings); a plan
    with no bound lands every fetched load at once."""
    w, caches, groups, _ = worker
    fill(caches, seed=8)
    w.save(StepPlan(kv_saves=[BlockCopy(index=i, key=K[i], blocks=(i + 1,)) for i in range(3)]))
    w.flush()
    want = [_pages(caches, groups, "kv", i + 1) for i in range(3)]
    w.tiers.tiers[0].delete_many([object_name(ImageKind.KV_BLOCK, k) for k in K[:3]])
    fill(caches, seed=9)
    jobs = [
        Load(
            request=f"r{i}",
            kv=(BlockCopy(index=i, key=K[i], blocks=(8 + i,), level=1),),
            state=None,
        )
        for i in range(3)
    ]
    w.queue.deadline_s = 0.0  # every load past its deadline at once: fetched ones still land
    w.load(StepPlan(loads=jobs))
    w.queue.wait()
    w.report()
    one = len(page(caches[groups[0].layers[0]], 1)) * sum(
        len(g.layers) for g in groups if g.kind == "kv"
    )
    for i in range(3):
        w.load(StepPlan(land_bytes=one))
        assert w.received() == ({f"r{i}"}, set())
        assert _pages(caches, groups, "kv", 8 + i) == want[i]
        report = w.report()
        assert report is not None and len(report.landed) == 1
        nbytes, seconds = report.landed[0]
        assert nbytes == one and seconds > 0
    assert len(w.queue) == 0 and w.load_errors() == set()
    w.load(StepPlan(loads=[dataclasses.replace(j, request=f"s{i}") for i, j in enumerate(jobs)]))
    w.queue.wait()
    w.load(StepPlan(land_bytes=0))  # no room: the first lands all the same
    assert w.received() == ({"s0"}, set()) and len(w.queue) == 2
    w.load(StepPlan())  # no bound
    assert w.received() == ({"s1", "s2"}, set()) and len(w.queue) == 0


def test_only_a_load_from_a_host_tier_on_top_is_done_in_the_step(tmp_path):
    """Level 0 is the host tier only where the stack starts with it: with the disk
    on top, a load found at level 0 reads the disk, so it goes off the step."""
    kc, caches = allocation("LBHNC", states=1)
    tiers = TierStack([DiskTier(tmp_path / "d", 64 << 20), HostTier(8 << 20, frame_bytes=64 << 10)])
    w = WorkerSide(
        groups=classify(kc), namespace=NS, tiers=tiers, block_size=BLOCK_SIZE, save_backlog=1 << 30
    )
    try:
        w.register(caches, kc.num_blocks)
        w.save(StepPlan(kv_saves=[BlockCopy(index=0, key=K[0], blocks=(2,))]))
        w.flush()
        job = Load(
            request="f", kv=(BlockCopy(index=0, key=K[0], blocks=(5,), level=0),), state=None
        )
        w.load(StepPlan(loads=[job]))
        assert w.received() == (set(), set()) and len(w.queue) == 1  # off the step
        finish_loads(w)
        assert w.received() == ({"f"}, set())
    finally:
        w.close()


def _pages(caches, groups, kind, block):
    names = [n for g in groups if g.kind == kind for n in g.layers]
    return [page(caches[n], block) for n in names]


def test_saved_objects_load_back_into_the_blocks_named(worker):
    w, caches, groups, blocks = worker
    fill(caches, seed=3)
    want_kv, want_state = _pages(caches, groups, "kv", 2), _pages(caches, groups, "state", 5)
    w.save(
        StepPlan(
            kv_saves=[BlockCopy(index=0, key=K[0], blocks=(2,))],
            state_saves=[BlockCopy(index=1, key=K[0], blocks=(5,))],
        )
    )
    w.flush()
    report = w.report()
    names = [object_name(ImageKind.KV_BLOCK, K[0]), object_name(ImageKind.STATE, K[0])]
    assert report is not None and report.saved == names and report.host_added == names
    # the write's part for the engine's metrics: one per step's saves, every tier
    [write] = report.writes
    stored = sum(len(x) for x in w.tiers.tiers[1].get_many(names))
    assert write.key == names[0] and write.rank == 0
    assert write.nbytes == {"host": stored, "disk": stored} and set(write.seconds) == {
        "host",
        "disk",
    }
    assert [(h.label, h.nbytes, h.objects) for h in report.held] == [
        ("host", w.tiers.tiers[0].used_bytes, 2),
        ("disk", w.tiers.tiers[1].used_bytes, 2),
    ]
    for tier in w.tiers.tiers:  # written through: every tier holds both
        assert tier.contains_many(names) == [True, True]
    fill(caches, seed=4)  # other bytes everywhere
    before = {b: _pages(caches, groups, "kv", b) for b in range(blocks)}
    w.load(
        StepPlan(
            loads=[
                Load(
                    request="a",
                    kv=(BlockCopy(index=0, key=K[0], blocks=(7,), level=0),),
                    state=BlockCopy(index=1, key=K[0], blocks=(9,), level=0),
                )
            ]
        )
    )
    # found in the host tier on top: done in the step it is asked for
    assert w.received() == ({"a"}, set()) and w.load_errors() == set()
    assert _pages(caches, groups, "kv", 7) == want_kv
    assert _pages(caches, groups, "state", 9) == want_state
    for b in range(blocks):  # no other block of the attention group was touched
        if b not in (7, 9):
            assert _pages(caches, groups, "kv", b) == before[b], b


def _saved(w, caches, *, seed: int, key: bytes, block: int) -> str:
    """Fill the cache with ``seed``'s bytes, save block ``block`` as ``key``'s KV
    object through every tier, and return its name (the report taken)."""
    fill(caches, seed=seed)
    w.save(StepPlan(kv_saves=[BlockCopy(index=0, key=key, blocks=(block,))]))
    w.flush()
    w.report()
    return object_name(ImageKind.KV_BLOCK, key)


def test_a_load_no_tier_can_serve_is_a_failure_and_copies_nothing(worker):
    w, caches, groups, blocks = worker
    name = _saved(w, caches, seed=5, key=K[1], block=1)
    host, disk = w.tiers.tiers
    # the host's copy is another namespace's; the disk's is gone: nothing serves it
    disk.delete_many([name])
    host.delete_many([name])  # (a host tier keeps the first object of a name)
    foreign = WorkerSide(
        groups=groups,
        namespace=b'{"other":1}',
        tiers=TierStack([host]),
        block_size=BLOCK_SIZE,
        save_backlog=1 << 30,
    )
    foreign.register(caches, blocks)
    foreign.save(StepPlan(kv_saves=[BlockCopy(index=0, key=K[1], blocks=(1,))]))
    foreign.flush()
    before = [_pages(caches, groups, "kv", b) for b in (3, 4)]
    load = Load(
        request="b",
        kv=(
            BlockCopy(index=0, key=K[1], blocks=(3,)),
            BlockCopy(index=1, key=K[2], blocks=(4,)),  # never saved anywhere
        ),
        state=None,
    )
    w.load(StepPlan(loads=[load]))
    finish_loads(w)
    assert w.received() == ({"b"}, {"b"})  # finished, and failed: vLLM recomputes
    assert w.load_errors() == {3, 4} and w.load_failures == 1
    assert [_pages(caches, groups, "kv", b) for b in (3, 4)] == before
    report = w.report()
    assert report is not None
    assert sorted(report.failed) == sorted([name, object_name(ImageKind.KV_BLOCK, K[2])])
    assert report.host_dropped == [name]  # the foreign object is gone from the host tier
    # the load's part for the engine's metrics: why each object failed
    [part] = report.loads
    assert part.key == "b" and part.failures == {
        name: "foreign",
        object_name(ImageKind.KV_BLOCK, K[2]): "missing",
    }
    assert set(part.nbytes) == {"host"}  # the foreign object was read, then refused
    assert host.contains_many([name]) == [False]


def test_a_fetch_that_raises_fails_its_load_and_never_reaches_the_step(worker, caplog):
    """A tier's read raising what no check foresaw (a client library's own error,
    a defect) fails that load, which vLLM recomputes, and is logged with its
    traceback; the step goes on: off the step (a disk read on an I/O thread)
    and in it (the host tier's read in place)."""
    w, caches, groups, _ = worker
    name = _saved(w, caches, seed=8, key=K[3], block=2)
    host, disk = w.tiers.tiers

    def broken(*_):
        raise RuntimeError("the client's own fault")

    before = {b: _pages(caches, groups, "kv", b) for b in (5, 6)}
    host.lend = broken  # the host tier's read in place raises
    in_step = Load(
        request="h",
        kv=(BlockCopy(index=0, key=K[3], blocks=(6,), level=0),),
        state=None,
        in_step=True,
    )
    with caplog.at_level(logging.ERROR, logger="vllm.kvarena"):
        w.load(StepPlan(loads=[in_step]))
    assert w.received() == (set(), set()) and w.load_errors() == {6}  # named by its blocks
    host.delete_many([name])  # on the disk alone now: read off the step
    disk.get_many = broken
    off = Load(request="g", kv=(BlockCopy(index=0, key=K[3], blocks=(5,), level=1),), state=None)
    with caplog.at_level(logging.ERROR, logger="vllm.kvarena"):
        w.load(StepPlan(loads=[off]))
        finish_loads(w)
    assert w.received() == ({"g"}, {"g"}) and w.load_errors() == {5}  # failed: recomputed
    assert w.load_failures == 2 and w.loads_done == 0
    assert {b: _pages(caches, groups, "kv", b) for b in (5, 6)} == before  # nothing copied
    report = w.report()
    assert report is not None
    assert [(p.key, p.failures) for p in report.loads] == [
        ("h", {name: "error"}),
        ("g", {name: "error"}),
    ]
    assert report.failed == [name, name]  # the lookups skip it until it is saved again
    raised = [r for r in caplog.records if r.exc_info and "raised RuntimeError" in r.getMessage()]
    assert [r.exc_info[1].args for r in raised] == [("the client's own fault",)] * 2


def test_a_copy_that_raises_part_way_fails_every_block_of_its_load(worker, caplog):
    """The copy into vLLM's blocks raising part way (torch's own fault, after
    the bytes were written): the load fails whole — every block named, so vLLM
    recomputes and rewrites them — the exception is logged with its traceback
    and never reaches the step; the objects are not reported failed (they are
    sound), and the next load of them lands."""
    w, caches, groups, _ = worker
    fill(caches, seed=9)
    want = [_pages(caches, groups, "kv", b) for b in (2, 3)]
    saves = [BlockCopy(index=i, key=K[i], blocks=(2 + i,)) for i in range(2)]
    w.save(StepPlan(kv_saves=saves))
    w.flush()
    w.report()
    fill(caches, seed=10)
    place, calls = w.pages.place, []

    def faulty(parts, arena):
        calls.append(parts)
        place(parts, arena)
        if len(calls) == 1:
            raise RuntimeError("torch's own fault")

    w.pages.place = faulty
    load = Load(
        request="c",
        kv=tuple(BlockCopy(index=i, key=K[i], blocks=(6 + i,), level=0) for i in range(2)),
        state=None,
        in_step=True,
    )
    with caplog.at_level(logging.ERROR, logger="vllm.kvarena"):
        w.load(StepPlan(loads=[load]))
    assert w.load_errors() == {6, 7} and w.load_failures == 1 and w.loads_done == 0
    raised = [r for r in caplog.records if r.exc_info and "copy raised" in r.getMessage()]
    assert [r.exc_info[1].args for r in raised] == [("torch's own fault",)]
    report = w.report()
    assert report is not None and report.failed == []
    fill(caches, seed=11)
    w.load(StepPlan(loads=[dataclasses.replace(load, request="d")]))
    assert w.load_errors() == set() and w.loads_done == 1 and len(calls) == 2
    assert [_pages(caches, groups, "kv", b) for b in (6, 7)] == want


@pytest.mark.parametrize("states", [0, 1])
def test_a_load_missing_an_object_keeps_the_blocks_before_it_where_they_stand_alone(
    tmp_path, states
):
    """A load whose second of three KV objects is gone. One KV group and no
    state: the first object is copied into its block, and only the blocks from
    the second on are failed (vLLM recomputes from there). With a state group
    beside it (a hybrid resumes only where its state was taken): nothing is
    copied, every block failed. A failed block's page is never touched."""
    kc, caches = allocation("LBHNC", states=states)
    groups = classify(kc)
    tiers = TierStack([DiskTier(tmp_path / "d", 64 << 20)])
    w = WorkerSide(
        groups=groups, namespace=NS, tiers=tiers, block_size=BLOCK_SIZE, save_backlog=1 << 30
    )
    try:
        w.register(caches, kc.num_blocks)
        fill(caches, seed=7)
        first = _pages(caches, groups, "kv", 1)
        w.save(StepPlan(kv_saves=[BlockCopy(index=i, key=K[i], blocks=(1 + i,)) for i in range(3)]))
        w.flush()
        tiers.tiers[0].delete_many([object_name(ImageKind.KV_BLOCK, K[1])])
        fill(caches, seed=8)
        before = {b: _pages(caches, groups, "kv", b) for b in (6, 7, 8)}
        copies = tuple(BlockCopy(index=i, key=K[i], blocks=(6 + i,), level=0) for i in range(3))
        w.load(StepPlan(loads=[Load(request="p", kv=copies, state=None)]))
        finish_loads(w)
        assert w.received() == ({"p"}, {"p"}) and w.load_failures == 1 and w.loads_done == 0
        if states:
            assert w.load_errors() == {6, 7, 8}
            assert _pages(caches, groups, "kv", 6) == before[6]
        else:
            assert w.load_errors() == {7, 8}
            assert _pages(caches, groups, "kv", 6) == first
        assert [_pages(caches, groups, "kv", b) for b in (7, 8)] == [before[7], before[8]]
    finally:
        w.close()


def test_a_rank_reports_what_it_saved_and_failed_by_the_prefix_objects_name(tmp_path):
    """Rank 1 of 2 writes and reads its own shard (a name of its own), but tells
    the scheduler which prefix object it was, so a lookup over every rank can
    skip it whichever shard failed."""
    kc, caches = allocation("LBHNC", states=1)
    w = WorkerSide(
        groups=classify(kc),
        namespace=NS,
        tiers=TierStack([HostTier(8 << 20, frame_bytes=64 << 10)]),
        block_size=BLOCK_SIZE,
        rank=1,
        ranks=2,
        save_backlog=1 << 30,
    )
    try:
        w.register(caches, kc.num_blocks)
        w.save(StepPlan(kv_saves=[BlockCopy(index=0, key=K[0], blocks=(2,))]))
        w.flush()
        prefix = object_name(ImageKind.KV_BLOCK, K[0])
        report = w.report()
        assert report is not None and report.saved == [prefix]
        assert report.host_added == [object_name(ImageKind.KV_BLOCK, rank_key(K[0], 1, 2))]
        w.load(
            StepPlan(
                loads=[
                    Load(
                        request="c",
                        kv=(
                            BlockCopy(index=0, key=K[0], blocks=(3,)),
                            BlockCopy(index=1, key=K[3], blocks=(4,)),
                        ),
                        state=None,
                    )
                ]
            )
        )
        finish_loads(w)
        assert w.received() == ({"c"}, {"c"})
        report = w.report()
        assert report is not None and report.failed == [object_name(ImageKind.KV_BLOCK, K[3])]
    finally:
        w.close()


def test_a_rank_reports_what_a_tier_refused_by_its_label_name_and_prefix(tmp_path):
    """A save a tier does not store (here a disk smaller than any object) is
    reported refused there, by the tier's label, the rank's own name and the
    prefix object's name; the host tier above it holds it."""
    kc, caches = allocation("LBHNC", states=1)
    tiers = TierStack([HostTier(8 << 20, frame_bytes=64 << 10), DiskTier(tmp_path / "d", 1)])
    w = WorkerSide(
        groups=classify(kc),
        namespace=NS,
        tiers=tiers,
        block_size=BLOCK_SIZE,
        rank=1,
        ranks=2,
        save_backlog=1 << 30,
    )
    try:
        w.register(caches, kc.num_blocks)
        w.save(StepPlan(kv_saves=[BlockCopy(index=0, key=K[0], blocks=(2,))]))
        w.flush()
        prefix = object_name(ImageKind.KV_BLOCK, K[0])
        own = object_name(ImageKind.KV_BLOCK, rank_key(K[0], 1, 2))
        report = w.report()
        assert report is not None and report.saved == [prefix] and report.written == [own]
        assert report.refused == [("disk", own, prefix)]
        assert tiers.tiers[0].contains_many([own]) == [True]
        assert tiers.tiers[1].contains_many([own]) == [False]
    finally:
        w.close()


def test_a_partial_block_is_saved_with_its_span_and_loads_only_as_itself(worker):
    """A prompt's partial last block is stored as its page (every layer's, as the
    kernel left it) under a header naming the tokens it holds; a load expecting
    that partial block copies it in; one expecting another span of the same key
    (a longer tail, the full block) refuses it and copies nothing."""
    from kvarena.tiers.image import read_header

    w, caches, groups, _ = worker
    fill(caches, seed=8)
    want = _pages(caches, groups, "kv", 3)
    w.save(StepPlan(kv_saves=[BlockCopy(index=2, key=K[3], blocks=(3,), tokens=5)]))
    w.flush()
    w.report()
    name = object_name(ImageKind.KV_BLOCK, K[3])
    [stored] = w.tiers.tiers[1].get_many([name])
    header = read_header(stored)
    assert (header.start, header.end) == (2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 5)
    fill(caches, seed=9)
    for request, tokens, ok in (("five", 5, True), ("six", 6, False), ("full", None, False)):
        before = _pages(caches, groups, "kv", 6)
        copy = BlockCopy(index=2, key=K[3], blocks=(6,), level=0, tokens=tokens)
        w.load(StepPlan(loads=[Load(request=request, kv=(copy,), state=None)]))
        done, failed = w.received()
        assert done == {request} and (failed == set()) == ok
        assert _pages(caches, groups, "kv", 6) == (want if ok else before)
        assert w.load_errors() == (set() if ok else {6})
