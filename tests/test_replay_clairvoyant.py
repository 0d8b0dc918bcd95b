"""Clairvoyant placement: its boundaries against a brute force over every pair of
requests, and its replay against the policies it bounds."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarena import EntryField, InvalidValueError, ModelCache
from kvarena.prefix import CheckpointPolicy
from kvarena.replay import ReplayConfig, TraceRequest, replay
from kvarena.replay.clairvoyant import clairvoyant_bound, parting_points

HYBRID = ModelCache.from_fields(
    [EntryField("k", 2, (16, 32), torch.bfloat16)],
    [EntryField("ssm", 2, (4, 128), torch.float32)],
    block_size=16,
    name="clairvoyant-hybrid",
)


def _requests(prompts: list[list[int]]) -> list[TraceRequest]:
    return [
        TraceRequest(arrival_ms=10.0 * i, tokens=np.asarray(p, dtype=np.int64), output_tokens=4)
        for i, p in enumerate(prompts)
    ]


def _brute(prompts: list[list[int]], bs: int) -> list[tuple[int, ...]]:
    """Boundary b of request i: some later j shares b full blocks with it, capped by
    the len - 1 tokens j can resume at most."""

    def shared_blocks(a: list[int], b: list[int]) -> int:
        n = 0
        while (n + 1) * bs <= min(len(a), len(b)) and a[n * bs : (n + 1) * bs] == b[
            n * bs : (n + 1) * bs
        ]:
            n += 1
        return n

    out = []
    for i, p in enumerate(prompts):
        points = set()
        for q in prompts[i + 1 :]:
            s = min(shared_blocks(p, q), (len(q) - 1) // bs)
            if s:
                points.add(s)
        out.append(tuple(sorted(points)))
    return out


# Prompts over a two-letter alphabet with tiny blocks share and part often.
prompts_st = st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=14), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(prompts=prompts_st, bs=st.integers(1, 3))
def test_parting_points_equal_the_brute_force(prompts: list[list[int]], bs: int) -> None:
    assert parting_points(_requests(prompts), bs) == _brute(prompts, bs)


def test_parting_points_of_a_shared_system_prompt_and_a_next_turn() -> None:
    system = list(range(48))  # three 16-token blocks
    first = system + list(range(100, 132))  # + two blocks
    second = system + list(range(200, 216)) + [7]  # parts from `first` after the system prompt
    turn = first + list(range(300, 340))  # the next turn contains `first` whole
    got = parting_points(_requests([first, second, turn]), 16)
    # first: `second` parts at 3 blocks, `turn` shares all 5 (and could resume there);
    # second shares 3 blocks with `turn`; the last request has nobody after it.
    assert got == [(3, 5), (3,), ()]


def test_a_prompt_that_ends_on_a_boundary_cannot_resume_there() -> None:
    a = list(range(32))
    got = parting_points(_requests([[*a, 1, 2], a]), 16)
    # The second shares both blocks but resumes at most at len - 1 = 31 tokens: 1 block.
    assert got == [(1,), ()]


def _trace(seed: int) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 1 << 30, 16 * int(rng.integers(4, 12))) for _ in range(6)]
    prompts = []
    for _ in range(60):
        d = docs[int(rng.integers(0, len(docs)))]
        prompts.append(np.concatenate([d, rng.integers(0, 1 << 30, int(rng.integers(5, 60)))]))
    return _requests([p.tolist() for p in prompts])


@pytest.mark.parametrize("seed", [0, 1])
def test_clairvoyant_replay_keeps_images_only_where_read_and_hits_at_least_the_policies(
    seed: int,
) -> None:
    trace = _trace(seed)
    cfg = ReplayConfig(budget_bytes=4 << 20, max_seqs=4)
    bound = clairvoyant_bound(HYBRID, trace, cfg)
    kv_only = ModelCache.from_fields(HYBRID.page_fields, [], block_size=16, name="kv")
    kv = replay(kv_only, trace, cfg).hit_tokens
    m = bound.metrics
    assert 0 < bound.hit_tokens <= kv
    # Memory large enough to evict nothing: every image kept is read by a later request.
    assert m["evicted_images"] == 0 and m["images_written"] <= sum(
        len(p) for p in parting_points(trace, 16)
    )
    assert bound.hit_tokens == kv  # nothing evicted, nothing lost: every KV hit resumes
    for text in ("end", "end,branch", "end,branch,learn"):
        cfg_policy = ReplayConfig(
            budget_bytes=4 << 20, max_seqs=4, policy=CheckpointPolicy.parse(text)
        )
        policy = replay(HYBRID, trace, cfg_policy)
        assert policy.hit_tokens <= bound.hit_tokens, text


def test_replay_refuses_checkpoints_that_do_not_fit_the_trace() -> None:
    trace = _trace(0)
    cfg = ReplayConfig(budget_bytes=4 << 20, max_seqs=4)
    with pytest.raises(InvalidValueError, match="one sequence of boundaries per request"):
        replay(HYBRID, trace, cfg, checkpoints=[()] * (len(trace) - 1))
    with pytest.raises(InvalidValueError, match=r"checkpoints\[2\] holds 0"):
        replay(HYBRID, trace, cfg, checkpoints=[(), (), (0,)] + [()] * (len(trace) - 3))


def test_parting_points_refuse_what_is_no_trace_or_block_size() -> None:
    with pytest.raises(InvalidValueError, match="block_size"):
        parting_points(_trace(0), 0)
    with pytest.raises(InvalidValueError, match="TraceRequest"):
        parting_points([[1, 2, 3]], 16)  # type: ignore[list-item]
