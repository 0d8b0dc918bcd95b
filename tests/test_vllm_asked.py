"""The scheduler side's memory of lookups (``asked.py``) over vLLM's own request
objects, without an engine: a request asked again starts where its run ended,
another request's first ask over the same prefix starts where that prefix's
run ended, both walked again after an eviction or a failed load, the runs
bounded; and every answer equal to a lookup made from scratch.

Runs in the ``.venv-vllm`` environment; skipped where vLLM is not installed.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

import torch
from vllm.v1.request import Request
from vllm_scheduler import BS, NS, make_groups, make_request, make_side

from kvarena.integrations.vllm import asked as asked_module
from kvarena.integrations.vllm import catalogue as catalogue_module
from kvarena.integrations.vllm.catalogue import Catalogue
from kvarena.integrations.vllm.key_memo import trusted_hashes
from kvarena.integrations.vllm.ranks import rank_names
from kvarena.integrations.vllm.records import WorkerReport
from kvarena.integrations.vllm.scheduler_side import SchedulerSide
from kvarena.integrations.vllm.settings import ConnectorSettings
from kvarena.prefix.keys import block_keys, key_root
from kvarena.tiers.names import ImageKind, object_name


def _spied(side: SchedulerSide, r: Request, held: int) -> tuple[list[str], list[str]]:
    """``r``'s KV object names, its first ``held`` blocks put in the host tier, and
    a list every name the catalogue is asked from now on is added to."""
    keys = block_keys(key_root(NS), torch.tensor(r.all_token_ids).numpy(), BS)
    names = [object_name(ImageKind.KV_BLOCK, k) for k in keys]
    side.catalogue.hosted(names[:held], [])
    asked: list[str] = []
    real = side.catalogue.locate
    side.catalogue.locate = lambda n: (asked.extend(n), real(n))[1]
    return names, asked


def test_a_request_asked_again_is_looked_up_from_where_its_run_ended():
    """vLLM asks a waiting request step after step: the second ask starts where
    the first run ended (the books only gained names since), finding what was
    saved meanwhile; a block of the run leaving a tier, or a failed load, makes
    the next ask walk the run again and answer what holds now."""
    side = make_side("kv")
    r = make_request("r7", 16 * 40 + 1)
    names, asked = _spied(side, r, 20)
    assert side.matched(r, 0) == (20 * BS, True)
    first = len(asked)
    side.catalogue.hosted(names[20:30], [])  # saved meanwhile
    asked.clear()
    assert side.matched(r, 0) == (30 * BS, True)
    assert names[0] not in asked and len(asked) < first  # from block 20 on
    side.catalogue.hosted([], [names[5]])  # block 5 evicted: the run is walked again
    asked.clear()
    assert side.matched(r, 0) == (5 * BS, True) and names[0] in asked
    side.catalogue.hosted([names[5]], [])
    assert side.matched(r, 0) == (30 * BS, True)
    side.reported(WorkerReport(failed=[names[3]]))  # a load of block 3 failed
    assert side.matched(r, 0) == (3 * BS, True)


def test_a_run_another_request_found_holds_for_a_first_ask_over_the_same_prefix():
    """Requests sharing a prefix (their keys recalled by vLLM's hashes): the
    first ask of the next one starts where the last one's run over that prefix
    ended, asking nothing of the run; a block of it leaving a tier (even if
    back since), or a failed load, makes the next request's first ask walk the
    run again."""
    side = make_side("kv", memo=True)
    shared = 16 * 20
    first = make_request("r0", shared + 16 * 10 + 1, tail=16 * 10 + 1)
    names, asked = _spied(side, first, 20)
    assert side.matched(first, 0) == (20 * BS, True)
    assert names[0] in asked  # the first request walks its run
    side.finished(first)
    for i, change in enumerate(("none", "evicted", "restored", "none", "failed")):
        if change == "evicted":
            side.catalogue.hosted([], [names[7]])
        elif change == "restored":
            side.catalogue.hosted([names[7]], [])
        elif change == "failed":
            side.reported(WorkerReport(failed=[names[3]]))
        r = make_request(f"r{i + 1}", shared + 16 * 10 + 1, tail=16 * 10 + 1)
        asked.clear()
        want = {"evicted": 7, "failed": 3}.get(change, 20)
        assert side.matched(r, 0) == (want * BS, True), change
        walked = names[0] in asked
        assert walked == (change != "none"), (change, asked[:3])
        # the levels cover every block the request loads from (vLLM holding some)
        assert side.matched(r, 16 * 2) == ((want - 2) * BS, True)
        side.finished(r)


def test_a_hybrid_request_asked_again_walks_no_boundary_it_walked_before():
    """A waiting hybrid request whose run holds no state image: asked again, no
    boundary its last walk covered is asked about again. An image of another
    prefix joining the books changes nothing; one joining at a boundary of the
    run is found at the next ask; the image found leaving the books makes the
    next ask walk again."""
    side = make_side("kv", "state")
    r = make_request("h1", 16 * 40 + 1)
    _, asked = _spied(side, r, 30)
    keys = block_keys(key_root(NS), torch.tensor(r.all_token_ids).numpy(), BS)
    images = [object_name(ImageKind.STATE, k) for k in keys]  # boundary b's: images[b - 1]

    def states_asked() -> list[str]:
        return [n for n in asked if n.startswith("st-")]

    assert side.matched(r, 0) == (0, False)  # no image anywhere: no hit
    assert images[29] in asked and images[0] in asked  # every boundary walked
    asked.clear()
    assert side.matched(r, 0) == (0, False) and not states_asked()
    other = make_request("h2", 16 * 40 + 1, seed=5)
    other_keys = block_keys(key_root(NS), torch.tensor(other.all_token_ids).numpy(), BS)
    # another prefix's image, and a name no object has (a shared store lists what it holds)
    side.catalogue.hosted([object_name(ImageKind.STATE, other_keys[9]), "st-not-hex"], [])
    asked.clear()
    assert side.matched(r, 0) == (0, False) and not states_asked()
    side.catalogue.hosted([images[11]], [])  # an image at boundary 12 of the run
    asked.clear()
    assert side.matched(r, 0) == (12 * BS, True) and images[11] in asked
    asked.clear()
    assert side.matched(r, 0) == (12 * BS, True) and not states_asked()
    side.catalogue.hosted([], [images[11]])  # gone again
    asked.clear()
    assert side.matched(r, 0) == (0, False) and images[0] in asked


def test_a_walk_remembered_further_back_than_the_images_kept_is_walked_again(monkeypatch):
    """The catalogue keeps the last ``IMAGES_KEPT`` images that joined its books: a
    walk remembered from before them cannot know where they joined, so the
    next ask walks again (and answers as before)."""
    monkeypatch.setattr(catalogue_module, "IMAGES_KEPT", 2)
    side = make_side("kv", "state")
    r = make_request("h1", 16 * 40 + 1)
    _, asked = _spied(side, r, 30)
    assert side.matched(r, 0) == (0, False)
    side.catalogue.hosted(["st-01", "st-02"], [])  # images of no boundary of the run
    asked.clear()
    assert side.matched(r, 0) == (0, False) and not [n for n in asked if n.startswith("st-")]
    side.catalogue.hosted(["st-03", "st-04", "st-05"], [])  # more than are kept
    asked.clear()
    assert side.matched(r, 0) == (0, False) and [n for n in asked if n.startswith("st-")]


def test_the_runs_remembered_span_a_bounded_number_of_blocks(monkeypatch):
    """Past ``RUN_BLOCKS_KEPT`` blocks the runs met first are forgotten first: a
    request over a forgotten prefix walks its run, one over a kept prefix does not."""
    monkeypatch.setattr(asked_module, "RUN_BLOCKS_KEPT", 45)
    side = make_side("kv", memo=True)
    asked: list[str] = []
    heads = []
    for seed in range(3):  # three prefixes of 20 blocks, each held whole
        r = make_request(f"a{seed}", 16 * 25 + 1, seed=seed + 1, tail=16 * 5 + 1)
        keys = block_keys(key_root(NS), torch.tensor(r.all_token_ids).numpy(), BS)
        names = [object_name(ImageKind.KV_BLOCK, k) for k in keys]
        side.catalogue.hosted(names[:20], [])
        heads.append(names[0])
        assert side.matched(r, 0) == (20 * BS, True)
        side.finished(r)
    assert side.asked._run_blocks == 40  # the first run forgotten (60 > 45)
    real = side.catalogue.locate
    side.catalogue.locate = lambda n: (asked.extend(n), real(n))[1]
    for seed, walks in ((2, False), (0, True)):
        r = make_request(f"b{seed}", 16 * 25 + 1, seed=seed + 1, tail=16 * 5 + 1)
        asked.clear()
        assert side.matched(r, 0) == (20 * BS, True)
        assert (heads[seed] in asked) == walks, seed
        side.finished(r)
    assert side.asked._run_blocks <= 45


_prompt_ops = st.lists(
    st.one_of(
        # a request over prefix p's first ``blocks`` blocks, vLLM holding ``local`` of
        # them; kept (asked again later) or finished
        st.tuples(
            st.just("ask"),
            st.integers(0, 1),
            st.sampled_from([6, 12, 24]),
            st.sampled_from([0, 2]),
            st.booleans(),
        ),
        st.tuples(
            st.sampled_from(["save", "evict", "fail"]), st.integers(0, 1), st.integers(0, 11)
        ),
        st.tuples(
            st.sampled_from(["state", "unstate", "failstate"]),
            st.integers(0, 1),
            st.sampled_from([3, 6, 12, 24]),
        ),
    ),
    max_size=30,
)


def _levels(side: SchedulerSide, r: Request) -> tuple[list[int | None], int | None] | None:
    """The tier levels a hit would load each block and its state from."""
    found = side._found.get(r.request_id)
    if found is None:
        return None
    point = found.resume_point
    kv = [found.finds.kv.get(i) for i in range(found.local, point)]
    return kv, found.finds.state.get(point)


@settings(max_examples=60, deadline=None)
@example(  # a run remembered, one of its blocks evicted: asked again and anew
    ops=[
        ("ask", 0, 24, 0, True),
        ("evict", 0, 5),
        ("ask", 0, 24, 0, True),
        ("ask", 0, 24, 2, False),
    ],
    kinds=("kv", "state"),
    ranks=2,
    held=[24, 24, 24],
    states=[{24}, set(), set()],
)
@example(  # a walk that found no image, remembered while images join and leave
    ops=[
        ("ask", 0, 24, 0, True),
        ("state", 1, 12),
        ("ask", 0, 24, 0, True),
        ("state", 0, 12),
        ("ask", 0, 24, 0, True),
        ("unstate", 0, 12),
        ("ask", 0, 24, 0, True),
        ("state", 0, 6),
        ("failstate", 0, 6),
        ("ask", 0, 24, 0, False),
    ],
    kinds=("kv", "state"),
    ranks=2,
    held=[24, 24, 0],
    states=[set(), set(), set()],
)
@example(  # an image that failed its load, saved again while a walk skipping it is remembered
    ops=[
        ("ask", 0, 24, 0, True),
        ("failstate", 0, 12),
        ("ask", 0, 24, 0, True),
        ("state", 0, 12),
        ("ask", 0, 24, 0, True),
    ],
    kinds=("kv", "state"),
    ranks=1,
    held=[24, 0, 0],
    states=[{12}, set(), set()],
)
@example(  # a run found past blocks vLLM held, then asked from block 0
    ops=[("ask", 1, 24, 2, False), ("ask", 1, 24, 0, False)],
    kinds=("kv",),
    ranks=1,
    held=[0, 24, 0],
    states=[set(), set(), set()],
)
@given(
    ops=_prompt_ops,
    kinds=st.sampled_from([("kv",), ("kv", "state")]),
    ranks=st.sampled_from([1, 2]),
    held=st.lists(st.sampled_from([0, 6, 24]), min_size=3, max_size=3),
    states=st.lists(st.sets(st.sampled_from([3, 6, 12, 24]), max_size=3), min_size=3, max_size=3),
)
def test_every_answer_equals_a_lookup_from_scratch(ops, kinds, ranks, held, states):
    """Requests over three shared prefixes, asked again and again while blocks and
    states are saved, evicted (one rank's object is enough) and fail their loads:
    every answer of a side that remembers (keys recalled by vLLM's hashes, runs
    by request and by prefix, objects found whole on every rank, states probed
    from the run's end down) equals the answer of a side made afresh over the
    same books and the same failed objects. Prefix p starts with its first
    ``held[p]`` blocks saved and its states at ``states[p]``."""
    settings_ = ConnectorSettings.parse({"tiers": ["host:1GiB"]})
    catalogue = Catalogue(settings_, ranks)

    def made(memo: bool) -> SchedulerSide:
        return SchedulerSide(
            groups=make_groups(*kinds),
            namespace=NS,
            catalogue=catalogue,
            block_size=BS,
            ranks=ranks,
            memo=trusted_hashes("sha256", BS, BS) if memo else None,
        )

    side = made(memo=True)
    bases = [make_request(f"p{p}", 16 * 25, seed=p + 1) for p in range(3)]
    keys = [block_keys(key_root(NS), torch.tensor(b.all_token_ids).numpy(), BS) for b in bases]
    failed: set[str] = set()
    live: dict[tuple[int, int], Request] = {}
    start = [("save", p, i) for p in range(3) for i in range(held[p])]
    start += [("state", p, b) for p in range(3) for b in sorted(states[p])]
    for n, op in enumerate(start + ops):
        what, p = op[0], op[1]
        if what == "ask":
            blocks, local, keep = op[2], op[3], op[4]
            # prefix p's first blocks (the same tokens), then a tail of the request's own
            r = live.get((p, blocks)) or make_request(
                f"r{n}", 16 * (blocks + 3) + 1, seed=p + 1, tail=16 * 3 + 1
            )
            fresh = made(memo=False)
            fresh.reported(WorkerReport(failed=sorted(failed)))
            computed = min(local, blocks) * BS
            got = side.matched(r, computed)
            assert got == fresh.matched(r, computed), (n, op, got)
            assert _levels(side, r) == _levels(fresh, r), (n, op)
            if keep:
                live[(p, blocks)] = r
            else:
                side.finished(r)
                live.pop((p, blocks), None)
            continue
        state = what in ("state", "unstate", "failstate")
        i = op[2]
        name = object_name(
            ImageKind.STATE if state else ImageKind.KV_BLOCK, keys[p][i - 1 if state else i]
        )
        every = rank_names(name, ranks)
        if what in ("save", "state"):
            side.reported(WorkerReport(host_added=every, saved=[name]))
            failed.discard(name)
        elif what in ("evict", "unstate"):
            side.reported(WorkerReport(host_dropped=every[-1:]))  # one rank's object
        else:
            side.reported(WorkerReport(failed=[name]))
            failed.add(name)
