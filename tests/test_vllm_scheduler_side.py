"""The connector's scheduler half over vLLM's own request and scheduler-output
objects, without an engine: what a lookup answers, what a step loads and saves.

Runs in the ``.venv-vllm`` environment; skipped where vLLM is not installed.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import (
    CachedRequestData,
    KVConnectorBlockState,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request

from kvarena.integrations.vllm import asked as asked_module
from kvarena.integrations.vllm.catalogue import Catalogue
from kvarena.integrations.vllm.groups import classify
from kvarena.integrations.vllm.key_memo import trusted_hashes
from kvarena.integrations.vllm.ranks import rank_names
from kvarena.integrations.vllm.records import WorkerReport
from kvarena.integrations.vllm.scheduler_side import SchedulerSide
from kvarena.integrations.vllm.settings import ConnectorSettings
from kvarena.prefix.keys import block_keys, key_root, tail_key
from kvarena.tiers.image import ImageKind, object_name

BS = 16
NS = b'{"model":"tiny"}'


def _groups(*kinds: str):
    specs = {
        "kv": FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32),
        "state": MambaSpec(
            block_size=BS,
            shapes=((3, 32), (2, 8, 8)),
            dtypes=(torch.float32, torch.float32),
            mamba_cache_mode="align",
        ),
    }
    return classify(
        KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=specs[k])
                for i, k in enumerate(kinds)
            ],
        )
    )


def _side(*kinds: str, memo: bool = False) -> SchedulerSide:
    """``memo``: keys recalled by vLLM's block hashes (the requests must carry them)."""
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB"]})
    return SchedulerSide(
        groups=_groups(*kinds),
        namespace=NS,
        catalogue=Catalogue(settings),
        block_size=BS,
        memo=trusted_hashes("sha256", BS, BS) if memo else None,
    )


def _request(rid: str, n: int, seed: int = 0, tail: int = 0) -> Request:
    """``n`` tokens of ``seed``'s prompt; with ``tail``, its last ``tail`` tokens
    the request's own (``rid``'s), as vLLM hashes them (sha256) for ``_side(memo=True)``."""
    tokens = [(seed * 7919 + i * 31) % 1000 + 1 for i in range(n - tail)]
    tokens += [(hash(rid) + i) % 1000 + 1 for i in range(tail)]
    if not tail:
        return Request(rid, tokens, SamplingParams(max_tokens=4), None)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, block_hasher=hasher)


def _blocks(rid: str, groups: int, n: int = 16) -> tuple[list[int], ...]:
    """Distinct, non-null block ids for each group of a request."""
    base = 1 + 100 * int(rid[-1])
    return tuple([base + 40 * g + i for i in range(n)] for g in range(groups))


def _step(
    requests: list[Request],
    counts: dict[str, int],
    started: dict[str, int],
    groups: int,
    offers: dict[str, list[tuple[int, int, int]]] | None = None,
) -> SchedulerOutput:
    """One step's output: ``counts`` tokens scheduled per request from ``started``
    (the first step of a request lists it as new, later ones as cached)."""
    out = SchedulerOutput.make_empty()
    cached = CachedRequestData.make_empty()
    for r in requests:
        if started[r.request_id] == 0:
            out.scheduled_new_reqs.append(
                NewRequestData.from_request(r, _blocks(r.request_id, groups))
            )
        else:
            cached.req_ids.append(r.request_id)
            cached.num_computed_tokens.append(started[r.request_id])
    out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = dict(counts)
    out.total_num_scheduled_tokens = sum(counts.values())
    out.kv_connector_block_state = KVConnectorBlockState(
        req_ids={r.request_id for r in requests},
        resolve_block_ids=lambda rid: _blocks(rid, groups),
        boundary_state_offloads=offers or {},
    )
    return out


def test_each_filled_kv_block_is_saved_once_in_the_step_that_fills_it():
    side = _side("kv")
    r = _request("r1", 100)
    tokens = torch.tensor(r.all_token_ids).numpy()
    side.allocated(r, _blocks("r1", 1), 0)
    saved = []
    done = 0
    keys = block_keys(key_root(NS), torch.tensor(r.all_token_ids).numpy(), BS)
    for chunk in (40, 40, 20):
        plan = side.plan(_step([r], {"r1": chunk}, {"r1": done}, 1))
        saved.append([(c.index, c.tokens) for c in plan.kv_saves])
        for c in plan.kv_saves:
            want = keys[c.index] if c.tokens is None else tail_key(keys[5], tokens[96:100], BS)
            assert c.key == want and c.blocks == (_blocks("r1", 1)[0][c.index],)
        done += chunk
    # 100 tokens: six full blocks, each once, and the prompt's partial last block
    # (4 tokens) in the step that ends the prompt
    assert saved == [[(0, None), (1, None)], [(2, None), (3, None), (4, None)], [(5, None), (6, 4)]]
    # a step that fills nothing new saves nothing again
    again = side.plan(_step([r], {"r1": 1}, {"r1": 100}, 1))
    assert again.kv_saves == []


def test_every_offered_state_at_a_block_boundary_is_saved():
    side = _side("kv", "state")
    r = _request("r2", 70)
    side.allocated(r, _blocks("r2", 2), 0)
    offers = {"r2": [(1, 9, 32), (1, 11, 64), (1, 5, 40), (0, 3, 48)]}
    plan = side.plan(_step([r], {"r2": 70}, {"r2": 0}, 2, offers))
    keys = block_keys(key_root(NS), torch.tensor(r.all_token_ids).numpy(), BS)
    # at 32 and 64 tokens (2 and 4 blocks), in the state group's blocks; not at 40
    # tokens (not a boundary) nor from the attention group
    assert [(c.index, c.blocks, c.key) for c in plan.state_saves] == [
        (2, (9,), keys[1]),
        (4, (11,), keys[3]),
    ]
    assert [c.index for c in plan.kv_saves] == [0, 1, 2, 3]


def test_the_state_where_a_step_ends_on_a_block_boundary_is_saved_from_that_blocks_slot():
    """A prompt whose prefill ends on a block boundary: vLLM does not offer that
    state, yet the next turn of the conversation resumes there. It is saved from
    each state group's block of the boundary's last token; an offer of the same
    boundary wins; a step ending off a boundary saves no state."""
    side = _side("kv", "state")
    r = _request("r4", 64)
    ids = _blocks("r4", 2)
    side.allocated(r, ids, 0)
    plan = side.plan(_step([r], {"r4": 40}, {"r4": 0}, 2))
    assert plan.state_saves == []  # 40 tokens: no boundary
    plan = side.plan(_step([r], {"r4": 24}, {"r4": 40}, 2))
    keys = block_keys(key_root(NS), torch.tensor(r.all_token_ids).numpy(), BS)
    assert [(c.index, c.blocks, c.key) for c in plan.state_saves] == [(4, (ids[1][3],), keys[3])]
    offered = side.plan(_step([r], {"r4": 16}, {"r4": 48}, 2, {"r4": [(1, 77, 64)]}))
    assert [(c.index, c.blocks) for c in offered.state_saves] == [(4, (77,))]


def test_a_lookup_loads_what_the_tiers_hold_and_a_failed_object_is_missed_until_saved():
    side = _side("kv")
    first = _request("r3", 80)
    keys = block_keys(key_root(NS), torch.tensor(first.all_token_ids).numpy(), BS)
    names = [object_name(ImageKind.KV_BLOCK, k) for k in keys]
    side.catalogue.hosted(names[:3], [])  # a worker's report: three blocks in its host tier
    assert side.matched(first, 0) == (48, True)  # resumes after three blocks
    side.allocated(first, _blocks("r3", 1), 48)
    plan = side.plan(_step([first], {"r3": 32}, {"r3": 48}, 1))
    (load,) = plan.loads
    assert [(c.index, c.key, c.blocks) for c in load.kv] == [
        (i, keys[i], (_blocks("r3", 1)[0][i],)) for i in range(3)
    ]
    assert load.block_ids == set(_blocks("r3", 1)[0][:3])
    # the load of block 1 failed on the worker: no lookup uses it until it is saved again
    side.reported(WorkerReport(failed=[names[1]]))
    assert side.matched(_request("r4", 80, seed=1), 0) == (0, False)  # another prompt
    same = Request("r5", list(first.prompt_token_ids), SamplingParams(max_tokens=4), None)
    assert side.matched(same, 0) == (16, True)  # block 0 only: block 1 counts as absent
    side.reported(WorkerReport(saved=[names[1]]))
    assert side.matched(same, 0) == (48, True)


def test_nothing_is_planned_for_a_request_vllm_holds_whole():
    side = _side("kv")
    r = _request("r6", 40)
    side.catalogue.hosted(
        [
            object_name(ImageKind.KV_BLOCK, k)
            for k in block_keys(key_root(NS), torch.tensor(r.all_token_ids).numpy(), BS)
        ],
        [],
    )
    assert side.matched(r, 32) == (0, False)  # vLLM's own cache already reaches the limit


def test_past_the_loads_in_flight_a_hit_is_asked_again_and_a_miss_is_not(monkeypatch):
    import kvarena.integrations.vllm.scheduler_side as sched

    monkeypatch.setattr(sched, "LOADS_IN_FLIGHT", 1)
    side = _side("kv")
    first, second = _request("r5", 80), _request("r6", 80)  # the same tokens: both would hit
    keys = block_keys(key_root(NS), torch.tensor(first.all_token_ids).numpy(), BS)
    side.catalogue.hosted([object_name(ImageKind.KV_BLOCK, k) for k in keys], [])
    # every block held: a hit of every token but the last (block 4 used for 15 rows)
    assert side.matched(first, 0) == (79, True)
    side.allocated(first, _blocks("r5", 1), 79)
    assert side.matched(second, 0) == (None, False)  # one load in flight: ask again
    assert side.matched(_request("r7", 80, seed=3), 0) == (0, False)  # a miss needs no load
    side.loaded({"r5"})  # vLLM reports the first load done
    assert side.matched(second, 0) == (79, True)


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
    side = _side("kv")
    r = _request("r7", 16 * 40 + 1)
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
    side = _side("kv", memo=True)
    shared = 16 * 20
    first = _request("r0", shared + 16 * 10 + 1, tail=16 * 10 + 1)
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
        r = _request(f"r{i + 1}", shared + 16 * 10 + 1, tail=16 * 10 + 1)
        asked.clear()
        want = {"evicted": 7, "failed": 3}.get(change, 20)
        assert side.matched(r, 0) == (want * BS, True), change
        walked = names[0] in asked
        assert walked == (change != "none"), (change, asked[:3])
        # the levels cover every block the request loads from (vLLM holding some)
        assert side.matched(r, 16 * 2) == ((want - 2) * BS, True)
        side.finished(r)


def test_the_runs_remembered_span_a_bounded_number_of_blocks(monkeypatch):
    """Past ``RUN_BLOCKS_KEPT`` blocks the runs met first are forgotten first: a
    request over a forgotten prefix walks its run, one over a kept prefix does not."""
    monkeypatch.setattr(asked_module, "RUN_BLOCKS_KEPT", 45)
    side = _side("kv", memo=True)
    asked: list[str] = []
    heads = []
    for seed in range(3):  # three prefixes of 20 blocks, each held whole
        r = _request(f"a{seed}", 16 * 25 + 1, seed=seed + 1, tail=16 * 5 + 1)
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
        r = _request(f"b{seed}", 16 * 25 + 1, seed=seed + 1, tail=16 * 5 + 1)
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
            st.sampled_from(["state", "unstate"]), st.integers(0, 1), st.sampled_from([3, 6, 12])
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
            groups=_groups(*kinds),
            namespace=NS,
            catalogue=catalogue,
            block_size=BS,
            ranks=ranks,
            memo=trusted_hashes("sha256", BS, BS) if memo else None,
        )

    side = made(memo=True)
    bases = [_request(f"p{p}", 16 * 25, seed=p + 1) for p in range(3)]
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
            r = live.get((p, blocks)) or _request(
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
        state = what in ("state", "unstate")
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


def test_a_part_hit_takes_whole_kv_blocks_alone_for_a_read_to_finish():
    """A decode request whose prefill engine offers the rest asks the tiers for a
    part: every whole KV block they hold, whether or not a state was saved at
    its end (the read brings the state at the prefill's end), no state loaded,
    off the step, and marked as one part of two."""
    side = _side("kv", "state")
    r = _request("r7", 80)
    keys = block_keys(key_root(NS), torch.tensor(r.all_token_ids).numpy(), BS)
    kv = [object_name(ImageKind.KV_BLOCK, k) for k in keys[:4]]
    side.catalogue.hosted([*kv, object_name(ImageKind.STATE, keys[0])], [])
    assert side.matched(r, 0) == (16, True)  # alone: the one boundary with a state
    assert side.matched(r, 0, part=True) == (64, True)  # a part: every whole block
    ids = _blocks("r7", 2)
    side.allocated(r, ids, 64)
    (load,) = side.plan(_step([r], {"r7": 16}, {"r7": 64}, 2)).loads
    assert [c.index for c in load.kv] == [0, 1, 2, 3] and load.state is None
    assert load.joined and not load.in_step
    assert load.block_ids == set(ids[0][:4])


def test_a_host_hit_loads_in_the_step_while_the_engine_is_idle_but_not_beside_decoding():
    """The same host-tier hit, its copy timed by the workers' reports (2 ms):
    the asynchronous way until an asynchronous load's wait is measured; then
    in the step that schedules it while no other request runs (the copy is
    shorter than that wait), two arrivals of one step sharing one budget; the
    asynchronous way while another request decodes (the copy is more than a
    tenth of its steps); in the step again once that request finished."""
    side = _side("kv")
    first = _request("r1", 80)
    keys = block_keys(key_root(NS), torch.tensor(first.all_token_ids).numpy(), BS)
    side.catalogue.hosted([object_name(ImageKind.KV_BLOCK, k) for k in keys], [])
    side.pace.loaded(5 * side._kv_bytes, 2e-3)  # four full blocks and the tail: 2 ms

    def same(rid: str) -> Request:
        return Request(rid, list(first.prompt_token_ids), SamplingParams(max_tokens=4), None)

    assert side.matched(first, 0) == (79, True)  # no asynchronous wait measured yet
    side.allocated(first, _blocks("r1", 1), 79)
    side.plan(_step([], {}, {}, 1))
    side.loaded({"r1"})  # reported done: its wait, since the allocation, is measured
    assert side.pace.wait_s() is not None
    side.pace._waits.clear()
    side.pace.waited(0.003)  # as if measured: 3 ms
    second, third = same("r2"), same("r3")
    assert side.matched(second, 0) == (79, False)  # idle: in the step (2 ms of 3)
    assert side.matched(third, 0) == (79, True)  # the step's budget is spent
    side.allocated(second, _blocks("r2", 1), 79)
    side.plan(_step([second], {"r2": 1}, {"r2": 79}, 1))  # r2 now runs
    side.pace._steps.extend([0.01] * 5)  # 10 ms steps: a tenth is 1 ms < 2 ms
    fourth = same("r4")
    assert side.matched(fourth, 0) == (79, True)  # beside a running request: asynchronous
    side.finished(second)
    assert side.matched(fourth, 0) == (79, False)  # alone again: in the step
