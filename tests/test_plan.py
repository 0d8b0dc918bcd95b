"""The one road: plan_cache -> UnifiedCache.from_plan holds exactly what the plan promised."""

import math

import pytest
import torch
from conftest import field_lists, plan_for
from hypothesis import assume, given
from hypothesis import strategies as st

from kvarena import (
    PRESETS,
    CachePlan,
    EntryField,
    InvalidValueError,
    ModelCache,
    PoolBudgetError,
    ServingOptions,
    UnifiedCache,
    model_cache,
    plan_cache,
)
from kvarena.layout import min_slot_stride, strictest_alignment


def assert_cache_matches_plan(plan: CachePlan, cache: UnifiedCache) -> None:
    assert cache.num_blocks == plan.blocks and cache.num_slots == plan.state_slots
    assert cache.block_stride == plan.block_stride and cache.slot_stride == plan.slot_stride
    assert cache.token_capacity == plan.token_capacity
    # Addresses: the last planned block ends at or below the first planned slot,
    # and every field of both pools starts on its declared alignment, absolutely.
    base = cache.buf.data_ptr()
    if plan.blocks:
        last = cache.block_bytes_of(plan.blocks - 1)
        assert last.data_ptr() == base + (plan.blocks - 1) * plan.block_stride
        assert (plan.blocks - 1) * plan.block_stride + plan.block_bytes <= cache.geometry.boundary(
            cache.slots.first
        )
    if plan.state_slots:
        first = cache.slot_bytes_of(cache.slots.first)
        assert first.data_ptr() == base + cache.geometry.boundary(cache.slots.first)
        assert first.data_ptr() + cache.num_slots * plan.slot_stride <= base + cache.buf.numel()
    for fields, view in (
        (plan.page_fields, cache.page_view),
        (plan.state_fields, cache.state_view),
    ):
        for f in fields:
            v = view(f.name)
            if v.numel():
                assert v.data_ptr() % f.start_alignment == 0, f.name
    assert plan.used_bytes + plan.unused_bytes == plan.budget_bytes and plan.unused_bytes >= 0


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("spec_tokens", [0, 2])
def test_every_preset_cache_holds_what_its_plan_promised(preset, spec_tokens):
    tp = 1 if preset == "deepseek-v4-flash" else 8
    if preset == "deepseek-v3" or preset == "llama-3.1-8b" or preset == "qwen3-8b":
        tp = 1
    model = model_cache(preset, ServingOptions(tp=tp, spec_tokens=spec_tokens))
    slot = min_slot_stride(model.state_fields)
    budget = 4 * model.entries_per_req * slot + 37 * min_slot_stride(model.page_fields) + 12_345
    plan = plan_cache(model, budget_bytes=budget, max_seqs=4, clamp=False)
    cache = UnifiedCache.from_plan(plan, "cpu")
    assert_cache_matches_plan(plan, cache)
    assert plan.state_slots == (4 * (1 + spec_tokens) if model.state_fields else 0)
    assert plan.blocks == (37 if model.page_fields else 0)


@given(
    page=field_lists(max_size=3),
    state=field_lists(max_size=3),
    epr=st.integers(1, 3),
    seqs=st.integers(1, 6),
    extra_blocks=st.integers(0, 9),
    slack=st.integers(0, 5000),
    clamp_to=st.integers(0, 3),
)
def test_random_layouts_cache_holds_what_its_plan_promised(
    page, state, epr, seqs, extra_blocks, slack, clamp_to
):
    page = [f for f in page if f.bytes_per_entry]
    state = [f for f in state if f.bytes_per_entry]
    assume(page or state)
    model = ModelCache.from_fields(page, state, block_size=16, entries_per_req=epr)
    slot, block = min_slot_stride(state), min_slot_stride(page)
    # Enough for `seqs - clamp_to` requests (at least one) and a few blocks, with room
    # for the top to round down to the STATE alignment and the boundary to a block.
    fit = max(1, seqs - clamp_to)
    budget = fit * epr * slot + (2 + extra_blocks) * block + strictest_alignment(state) + slack
    plan = plan_cache(model, budget_bytes=budget, max_seqs=seqs)
    assert 1 <= plan.max_seqs <= seqs and plan.clamped == (plan.max_seqs < seqs)
    if state:
        assert plan.max_seqs >= fit
    if page:
        assert plan.blocks >= 1
    cache = UnifiedCache.from_plan(plan, "cpu")
    assert_cache_matches_plan(plan, cache)
    # One more request would not have fitted (with a block left, where there are blocks).
    if plan.clamped:
        with pytest.raises(PoolBudgetError):
            plan_cache(model, budget_bytes=budget, max_seqs=plan.max_seqs + 1, clamp=False)


def test_a_field_aligned_beyond_256_costs_its_stride_in_the_plan_and_the_cache():
    # The case the old report got wrong: blocks planned by entry size, held by stride.
    page = [EntryField("k", 1, (1024,), torch.uint8, align=1024)]
    state = [EntryField("s", 1, (100,), torch.float32)]
    plan = plan_for(page, state, 4 << 20, 2)
    assert plan.block_bytes == 1024 and plan.block_stride == 1024
    page = [
        EntryField("a", 1, (256,), torch.uint8),
        EntryField("k", 1, (16,), torch.uint8, align=1024),
    ]
    plan = plan_for(page, state, 4 << 20, 2)
    assert plan.block_bytes == 1280 and plan.block_stride == 2048
    cache = UnifiedCache.from_plan(plan, "cpu")
    assert_cache_matches_plan(plan, cache)
    assert plan.blocks == (4 << 20) // 2048 - 1  # two 512 B slots take one block's room
    assert cache.page_view("k")[0, 5].data_ptr() % 1024 == 0


def test_page_only_and_state_only_models():
    llama = plan_cache(model_cache("llama-3.1-8b"), budget_bytes=1 << 30, max_seqs=8)
    cache = UnifiedCache.from_plan(llama, "cpu")
    assert (cache.num_blocks, cache.num_slots) == (llama.blocks, 0) == ((1 << 30) // 2097152, 0)
    assert not cache.has_state
    with pytest.raises(ValueError, match="keeps no per-request state"):
        cache.allocate_slots("r")
    with pytest.raises(RuntimeError, match="no STATE pool"):
        cache.grow_state(1)
    mamba = plan_cache(
        model_cache("mamba2-2.7b", ServingOptions(tp=8)), budget_bytes=1 << 30, max_seqs=4
    )
    cache = UnifiedCache.from_plan(mamba, "cpu")
    assert (cache.num_blocks, cache.num_slots) == (0, 4)
    slots = [cache.allocate_slots(r)[0] for r in range(4)]
    assert len(set(slots)) == 4
    # The unused budget is room for more requests: STATE grows into it.
    move = cache.grow_state(3)
    assert move.slots_after == 7 and move.blocks_after == 0 and not move.block_remap
    with pytest.raises(ValueError, match="no PAGE fields"):
        cache.page_units()


def test_budget_refusals_say_what_would_fit():
    model = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=8))
    slot = min_slot_stride(model.state_fields)
    with pytest.raises(PoolBudgetError, match=r"at most max_num_seqs=3 fits \(pass clamp=True"):
        plan_cache(model, budget_bytes=3 * slot + (1 << 20), max_seqs=8, clamp=False)
    with pytest.raises(PoolBudgetError, match="not even one request fits"):
        plan_cache(model, budget_bytes=slot // 2, max_seqs=1)
    # An attention-only model whose budget holds no block is refused, not planned at 0 blocks.
    with pytest.raises(PoolBudgetError, match="not even one request fits"):
        plan_cache(model_cache("llama-3.1-8b"), budget_bytes=1000, max_seqs=1)
    clamped = plan_cache(model, budget_bytes=3 * slot + (1 << 20), max_seqs=8)
    assert clamped.max_seqs == 3 and clamped.clamped and clamped.requested_seqs == 8


def test_plan_refuses_bad_inputs():
    model = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=8))
    for kwargs, match in (
        ({"budget_bytes": 0}, "budget_bytes"),
        ({"budget_bytes": 1.5e9}, "budget_bytes"),
        ({"budget_bytes": True}, "budget_bytes"),
        ({"max_seqs": 0}, "max_seqs"),
        ({"max_seqs": "4"}, "max_seqs"),
        ({"clamp": 1}, "clamp"),
    ):
        args = {"budget_bytes": 1 << 30, "max_seqs": 4} | kwargs
        with pytest.raises(ValueError, match=match):
            plan_cache(model, **args)
    with pytest.raises(ValueError, match="must be a ModelCache"):
        plan_cache("qwen3-next-80b-a3b", budget_bytes=1 << 30, max_seqs=4)
    with pytest.raises(ValueError, match="must be a CachePlan"):
        UnifiedCache.from_plan(model, "cpu")
    plan = plan_cache(model, budget_bytes=1 << 30, max_seqs=4)
    with pytest.raises(ValueError, match=r"no CUDA device|CUDA indices"):
        UnifiedCache.from_plan(plan, "cuda:99")
    with pytest.raises(ValueError, match="state slots do not fit"):
        CachePlan(model=model, budget_bytes=1 << 20, requested_seqs=4, max_seqs=4)


def test_plan_json_is_the_plan():
    plan = plan_cache(
        model_cache("gemma-3-27b", ServingOptions(tp=16)), budget_bytes=2 << 30, max_seqs=4
    )
    d = plan.to_dict()
    assert d["blocks"] == plan.blocks == UnifiedCache.from_plan(plan, "cpu").num_blocks
    assert d["block_stride"] == min_slot_stride(plan.page_fields)
    assert d["slot_stride"] == min_slot_stride(plan.state_fields)
    assert d["page_fingerprint"] == plan.page_fingerprint and len(d["page_fingerprint"]) == 64
    assert d["used_bytes"] == d["blocks"] * d["block_stride"] + d["state_slots"] * d["slot_stride"]
    assert strictest_alignment(plan.state_fields) == 256
    assert not math.isnan(d["token_capacity"]) and d["token_capacity"] == 16 * d["blocks"]


def test_zero_byte_pools_are_no_pools():
    empty = [EntryField("nothing", 0, (4,), torch.float32)]
    page = [EntryField("k", 1, (16, 64), torch.bfloat16)]
    plan = plan_for(page, empty, 1 << 20, 4)
    assert plan.state_fields == () and plan.state_slots == 0
    cache = UnifiedCache.from_plan(plan, "cpu")
    assert cache.num_slots == 0 and cache.num_blocks == plan.blocks > 0
    with pytest.raises(ValueError, match="no PAGE or STATE field holds a byte"):
        ModelCache.from_fields(empty, [EntryField("z", 3, (0,), torch.uint8)], block_size=16)


def test_one_byte_float_fills_must_be_exact():
    with pytest.raises(ValueError, match=r"stores 0\.0 as"):
        EntryField("scale", 1, (4,), torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"stores -1\.0 as 1\.0"):
        EntryField("scale", 1, (4,), torch.float8_e8m0fnu, fill=-1.0)
    with pytest.raises(ValueError, match=r"stores 0\.1 as"):
        EntryField("k", 1, (4,), torch.float8_e4m3fn, fill=0.1)
    assert EntryField("scale", 1, (4,), torch.float8_e8m0fnu, fill=1.0).fill == 1.0


@given(
    page=field_lists(min_size=1, max_size=3),
    state=field_lists(min_size=1, max_size=3),
    budget=st.integers(1, 1 << 20),
    seqs=st.integers(1, 64),
    epr=st.integers(1, 3),
)
def test_a_refusal_names_a_budget_that_would_fit(page, state, budget, seqs, epr):
    """``needed`` is the smallest budget that holds the ask: above the refused one,
    and enough (a plan at it succeeds) — the STATE top's lost alignment included."""
    try:
        model = ModelCache.from_fields(page, state, block_size=16, entries_per_req=epr)
    except InvalidValueError:
        assume(False)
    assume(model.page_fields and model.state_fields)
    try:
        plan_cache(model, budget_bytes=budget, max_seqs=seqs, clamp=False)
    except PoolBudgetError as err:
        assert err.needed > err.available == budget
        again = plan_cache(model, budget_bytes=err.needed, max_seqs=seqs, clamp=False)
        assert again.max_seqs == seqs
        with pytest.raises(PoolBudgetError):
            plan_cache(model, budget_bytes=err.needed - 1, max_seqs=seqs, clamp=False)
    except InvalidValueError:
        assume(False)


def test_a_budget_refusal_survives_a_trip_between_processes():
    import pickle

    model = ModelCache.from_fields(
        [EntryField("k", 1, (16, 64), torch.float32)],
        [EntryField("s", 1, (512,), torch.float32)],
        block_size=16,
    )
    with pytest.raises(PoolBudgetError) as info:
        plan_cache(model, budget_bytes=4096, max_seqs=8, clamp=False)
    back = pickle.loads(pickle.dumps(info.value))
    assert (back.needed, back.available, back.entries, back.max_fitting_seqs, str(back)) == (
        info.value.needed,
        info.value.available,
        info.value.entries,
        info.value.max_fitting_seqs,
        str(info.value),
    )


@given(tokens=st.integers(0, 1 << 40), block_size=st.integers(1, 1 << 12))
def test_blocks_for_is_the_least_number_of_blocks_holding_the_tokens(tokens, block_size):
    from kvarena.pools import blocks_for

    n = blocks_for(tokens, block_size)
    assert (n * block_size >= tokens and (n - 1) * block_size < tokens) or n == tokens == 0


def test_blocks_for_refuses_what_is_not_a_count():
    from kvarena import InvalidValueError
    from kvarena.pools import blocks_for

    for tokens, block_size in ((-1, 16), (1.5, 16), (True, 16), (4, 0), (4, "16")):
        with pytest.raises(InvalidValueError):
            blocks_for(tokens, block_size)
