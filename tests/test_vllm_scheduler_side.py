"""The connector's scheduler half over vLLM's own request and scheduler-output
objects, without an engine: what a lookup answers, what a step loads and saves
(the lookups' memory of earlier asks: ``test_vllm_asked.py``).

Runs in the ``.venv-vllm`` environment; skipped where vLLM is not installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import (
    CachedRequestData,
    KVConnectorBlockState,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.request import Request
from vllm_scheduler import BS, NS, make_groups, make_request, make_side

from kvarena.integrations.vllm.catalogue import Catalogue
from kvarena.integrations.vllm.records import WorkerReport
from kvarena.integrations.vllm.scheduler_side import SchedulerSide
from kvarena.integrations.vllm.settings import ConnectorSettings
from kvarena.prefix.keys import block_keys, key_root, tail_key
from kvarena.tiers.names import ImageKind, object_name


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
    side = make_side("kv")
    r = make_request("r1", 100)
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


def test_a_held_partial_block_is_saved_again_only_after_it_failed_a_load():
    """A prompt's partial last block the tiers hold is not saved again by another
    request of the same prompt; once a load of it failed (the lookups skip it
    until it is saved again), the next such request saves it again, and the
    lookups use it once the worker reports it saved."""
    side = make_side("kv")
    tokens = torch.tensor(make_request("r0", 100).all_token_ids).numpy()
    keys = block_keys(key_root(NS), tokens, BS)
    tail = object_name(ImageKind.KV_BLOCK, tail_key(keys[5], tokens[96:100], BS))
    side.catalogue.hosted([tail], [])

    def tails(rid: str) -> list[int | None]:
        r = make_request(rid, 100)
        side.allocated(r, _blocks(rid, 1), 0)
        plan = side.plan(_step([r], {rid: 100}, {rid: 0}, 1))
        side.finished(r)
        return [c.tokens for c in plan.kv_saves if c.tokens is not None]

    assert tails("r1") == []  # held: not saved again
    side.reported(WorkerReport(failed=[tail]))
    assert tails("r2") == [4]  # failed a load: saved again
    side.reported(WorkerReport(saved=[tail]))
    assert tail not in side.asked.skip and tails("r3") == []


def test_every_offered_state_at_a_block_boundary_is_saved():
    side = make_side("kv", "state")
    r = make_request("r2", 70)
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
    side = make_side("kv", "state")
    r = make_request("r4", 64)
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
    side = make_side("kv")
    first = make_request("r3", 80)
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
    assert side.matched(make_request("r4", 80, seed=1), 0) == (0, False)  # another prompt
    same = Request("r5", list(first.prompt_token_ids), SamplingParams(max_tokens=4), None)
    assert side.matched(same, 0) == (16, True)  # block 0 only: block 1 counts as absent
    side.reported(WorkerReport(saved=[names[1]]))
    assert side.matched(same, 0) == (48, True)


def test_a_name_a_tier_refused_is_not_looked_up_there(tmp_path):
    """A worker wrote three blocks through (host and disk) and the disk refused
    the third (full), which the host then evicted: the third is held nowhere,
    so a lookup resumes after two, and loads them from the host."""
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", f"disk:{tmp_path}:1GiB"]})
    side = SchedulerSide(
        groups=make_groups("kv"), namespace=NS, catalogue=Catalogue(settings), block_size=BS
    )
    try:
        r = make_request("r", 80)
        keys = block_keys(key_root(NS), torch.tensor(r.all_token_ids).numpy(), BS)
        names = [object_name(ImageKind.KV_BLOCK, k) for k in keys[:3]]
        side.reported(
            WorkerReport(
                saved=names, host_added=names, written=names, refused=[("disk", names[2], names[2])]
            )
        )
        side.reported(WorkerReport(host_dropped=[names[2]]))
        assert side.matched(r, 0) == (32, True)
        side.reported(WorkerReport(host_dropped=[names[1]]))  # the disk still holds it
        assert side.matched(make_request("r2", 80), 0) == (32, True)
    finally:
        side.catalogue.close()


def test_nothing_is_planned_for_a_request_vllm_holds_whole():
    side = make_side("kv")
    r = make_request("r6", 40)
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
    side = make_side("kv")
    # the same tokens: both would hit
    first, second = make_request("r5", 80), make_request("r6", 80)
    keys = block_keys(key_root(NS), torch.tensor(first.all_token_ids).numpy(), BS)
    side.catalogue.hosted([object_name(ImageKind.KV_BLOCK, k) for k in keys], [])
    # every block held: a hit of every token but the last (block 4 used for 15 rows)
    assert side.matched(first, 0) == (79, True)
    side.allocated(first, _blocks("r5", 1), 79)
    assert side.matched(second, 0) == (None, False)  # one load in flight: ask again
    assert side.matched(make_request("r7", 80, seed=3), 0) == (0, False)  # a miss needs no load
    side.loaded({"r5"})  # vLLM reports the first load done
    assert side.matched(second, 0) == (79, True)


def test_a_part_hit_takes_whole_kv_blocks_alone_for_a_read_to_finish():
    """A decode request whose prefill engine offers the rest asks the tiers for a
    part: every whole KV block they hold, whether or not a state was saved at
    its end (the read brings the state at the prefill's end), no state loaded,
    off the step, and marked as one part of two."""
    side = make_side("kv", "state")
    r = make_request("r7", 80)
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
    side = make_side("kv")
    first = make_request("r1", 80)
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


def test_a_plan_lets_fetched_loads_land_in_what_its_step_leaves():
    """The workers' copies of fetched loads, as reported, set how many bytes of
    them the next step may copy in: none known, one load a step; then a tenth of the
    measured step at their cost, beside running requests and while none runs
    (then the asynchronous way's wait, if longer)."""
    mib = 1 << 20
    side = make_side("kv")
    assert side.plan(_step([], {}, {}, 1)).land_bytes == 0
    side.reported(
        WorkerReport(
            landed=[(mib, 1.5e-3), (2 * mib, 2.5e-3), (8 * mib, 8.5e-3), (16 * mib, 16.5e-3)]
        )
    )
    assert side.plan(_step([], {}, {}, 1)).land_bytes == 0  # no step measured yet
    side.pace._steps.extend([0.02] * 5)  # 20 ms steps: 2 ms a step, 0.5 ms fixed, 1 ms a MiB
    r = make_request("r1", 80)
    assert side.plan(_step([r], {"r1": 1}, {"r1": 79}, 1)).land_bytes == pytest.approx(
        1.5 * mib, abs=2
    )
    side.pace.waited(0.1)
    assert side.plan(_step([r], {"r1": 1}, {"r1": 80}, 1)).land_bytes == pytest.approx(
        1.5 * mib, abs=2
    )
    idle = side.plan(_step([], {}, {}, 1)).land_bytes
    assert idle == pytest.approx(99.5 * mib, abs=2)  # nobody decodes: the wait's worth


def test_a_request_counts_one_lookup_however_often_vllm_asks_while_it_waits():
    """vLLM asks a waiting request again on every step it is not scheduled: the
    lookups counter counts requests (its help says so), not asks."""
    side = make_side("kv")
    waiting, other = make_request("r8", 80), make_request("r9", 80, seed=2)
    for _ in range(3):
        assert side.matched(waiting, 0) == (0, False)
    assert side.telemetry.lookups == 1
    side.matched(other, 0)
    side.matched(other, 16)  # asked again with blocks of its own
    assert side.telemetry.lookups == 2
    side.finished(waiting)  # the same id again later is another request
    side.matched(make_request("r8", 80, seed=4), 0)
    assert side.telemetry.lookups == 3


@pytest.mark.parametrize(
    ("flags", "hit"),
    [((), 256), (("--hybrid",), 256), (("--hybrid", "--no-image"), 0), (("--cluster",), 256)],
    ids=["attention", "hybrid", "hybrid-no-image", "cluster"],
)
def test_the_lookup_benchmark_answers_alike_from_memory_and_by_probing(
    monkeypatch, capsys, flags, hit
):
    """``benchmarks/bench_vllm_lookup.py``'s small case: the in-memory catalogue
    and the probing one (a ``stat`` per rank's name, ``EXISTS`` to a real Redis
    or Redis Cluster) find the same hit for every request: the shared half of
    the prompt, or none where the hybrid's state is held nowhere."""
    import sys
    from pathlib import Path

    from conftest import redis_binary

    redis_binary()  # skips where redis-server is missing (fails under CI)
    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    monkeypatch.delitem(sys.modules, "bench_vllm_lookup", raising=False)
    import bench_vllm_lookup

    argv = ["bench", "--requests", "3", "--tokens", "512", "--held", "64", *flags]
    monkeypatch.setattr(sys, "argv", argv)
    bench_vllm_lookup.main()
    rows = capsys.readouterr().out.splitlines()
    found = {
        label: row.rsplit(None, 1)[-1]
        for row in rows
        for label in ("in memory", "stat + EXISTS")
        if row.startswith(label)
    }
    assert found == {"in memory": f"[{hit}]", "stat + EXISTS": f"[{hit}]"}
