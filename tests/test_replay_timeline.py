"""A replay's timeline: one sample per event, windows that add up to the totals."""

import itertools

from test_replay import SMALL, synthetic_lines

from kvarena.replay import ReplayConfig, parse_trace, replay
from kvarena.replay.timeline import Sample, windows


def _run(budget=2 << 20, **kw):
    trace = parse_trace(synthetic_lines(5, conversations=30))
    cfg = ReplayConfig(budget_bytes=budget, max_seqs=4, timeline=True, **kw)
    return trace, replay(SMALL, trace, cfg)


def test_one_sample_per_event_and_totals_agree():
    trace, r = _run()
    s = r.timeline
    # Every request arrives, ends its prefill and finishes: three events each.
    assert len(s) == 3 * r.admitted and r.admitted == len(trace)
    assert [x.t for x in s] == sorted(x.t for x in s)
    last = s[-1]
    assert last.hit_tokens == r.hit_tokens and last.prompt_tokens == r.prompt_tokens
    assert last.evicted_blocks == r.metrics["evicted_blocks"]
    assert last.evicted_images == r.metrics["evicted_images"]
    assert (last.blocks, last.slots) == (r.blocks, r.slots)
    assert last.running == 0 and last.waiting == 0 and last.live_blocks == 0
    for x in s:
        assert 0 <= x.live_blocks + x.cached_blocks <= x.blocks
        assert 0 <= x.live_slots <= x.slots
    hits = [b.hit_tokens - a.hit_tokens for a, b in itertools.pairwise(s)]
    assert min(hits) >= 0 and max(hits) > 0


def test_windows_add_up_to_the_totals():
    _, r = _run()
    for count in (1, 7, 40, 10_000):
        ws = windows(r.timeline, count)
        assert len(ws) == min(count, len(r.timeline))
        assert sum(w.hit_tokens for w in ws) == r.hit_tokens
        assert sum(w.prompt_tokens for w in ws) == r.prompt_tokens
        assert sum(w.evicted_blocks for w in ws) == r.metrics["evicted_blocks"]
        assert all(0 <= w.live <= w.occupancy <= 1 for w in ws)
        assert ws[0].start == r.timeline[0].t and abs(ws[-1].end - r.timeline[-1].t) < 1e-9


def test_a_boundary_move_shows_in_the_slots():
    _, r = _run(budget=1 << 20)
    assert r.boundary_moves > 0
    assert len({x.slots for x in r.timeline}) > 1


def test_no_timeline_unless_asked():
    trace = parse_trace(synthetic_lines(5, conversations=3))
    r = replay(SMALL, trace, ReplayConfig(budget_bytes=2 << 20, max_seqs=4))
    assert r.timeline == [] and "timeline" not in r.to_dict()
    assert windows([], 10) == []


def test_sample_to_dict_names_every_field():
    x = Sample(
        t=1.0,
        blocks=2,
        live_blocks=1,
        cached_blocks=1,
        slots=3,
        live_slots=0,
        running=0,
        waiting=1,
        hit_tokens=4,
        prompt_tokens=5,
        evicted_blocks=6,
        evicted_images=7,
    )
    assert x.to_dict()["evicted_images"] == 7 and len(x.to_dict()) == 12
