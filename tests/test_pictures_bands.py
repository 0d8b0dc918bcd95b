"""The memory map's bands, as data: to the byte, from the walk the cache is carved with."""

import pytest
from conftest import field_lists
from hypothesis import assume, given
from hypothesis import strategies as st

import kvarena as kv
from kvarena.layout import layout_rows
from kvarena.layout.fields import checkpoint_ranges_for
from kvarena.models.vllm_pages import VllmPages
from kvarena.pictures.bands import Band, Bar, memory_map
from kvarena.pools import PoolBudgetError


def _check_tiling(bar):
    at = 0
    for b in bar.bands:
        assert b.offset == at and b.nbytes > 0
        at = b.end
    assert at == bar.total


def _check_entry(bar, fields, stride):
    """Field bands are the walk's rows (those with bytes), padding is what lies between."""
    rows, _, _ = layout_rows(fields)
    fields_drawn = [b for b in bar.bands if b.kind == "field"]
    assert [(b.offset, b.nbytes) for b in fields_drawn] == [
        (r.start, r.nbytes) for r in rows if r.nbytes
    ]
    assert bar.total == stride
    padding = sum(b.nbytes for b in bar.bands if b.kind == "padding")
    assert padding == stride - sum(r.nbytes for r in rows)
    for r in rows:  # the padding the walk puts before a field is a padding band ending there
        if r.pad_before and r.nbytes:
            (before,) = [b for b in bar.bands if b.end == r.start]
            assert before.kind == "padding" and before.nbytes >= r.pad_before


def _check_plan(plan):
    mm = memory_map(plan)
    for bar in (*mm.kvarena, *mm.vllm):
        _check_tiling(bar)
    buffer = mm.kvarena[0]
    kinds = {k: sum(b.nbytes for b in buffer.bands if b.kind == k) for k in ("blocks", "slots")}
    assert kinds["blocks"] == plan.blocks * plan.block_stride
    assert kinds["slots"] == plan.state_slots * plan.slot_stride
    assert sum(b.nbytes for b in buffer.bands if b.kind == "unused") == plan.unused_bytes
    blocks = [b for b in buffer.bands if b.kind == "blocks"]
    assert not blocks or blocks[0].offset == 0  # PAGE from the bottom
    slots = [b for b in buffer.bands if b.kind == "slots"]
    assert not slots or slots[0].end == plan.geometry.top  # STATE from the top
    rest = list(mm.kvarena[1:])
    if plan.page_fields:
        _check_entry(rest.pop(0), plan.page_fields, plan.block_stride)
    if plan.state_fields:
        bar = rest.pop(0)
        _check_entry(bar, plan.state_fields, plan.slot_stride)
        assert list(bar.marks) == list(checkpoint_ranges_for(plan.state_fields))
    assert not rest
    return mm


@pytest.mark.parametrize("preset", kv.PRESETS)
@pytest.mark.parametrize("tp", [1, 8])
def test_presets(preset, tp):
    try:
        model = kv.model_cache(preset, kv.ServingOptions(tp=tp))
    except kv.Error:
        pytest.skip(f"{preset} does not plan at TP {tp}")
    plan = kv.plan_cache(model, budget_bytes=80 << 30, max_seqs=64)
    mm = _check_plan(plan)
    v = VllmPages.of(model, plan.budget_bytes, plan.max_seqs)
    assert bool(mm.vllm) == (v is not None)
    if v:
        buffer, page = mm.vllm
        pad = [b for b in buffer.bands if b.kind == "padding"]
        assert sum(b.nbytes for b in pad) == v.padding_bytes_at_max_seqs
        assert page.total == v.page_bytes
        assert [b.nbytes for b in page.bands] == [
            n for n in (v.state_page_bytes, v.state_page_padding_bytes) if n
        ]
        attention = [b for b in buffer.bands if b.kind == "attention pages"]
        g = v.group_size
        assert attention[0].nbytes == (v.num_block_ids - v.state_block_ids) * g * v.page_bytes


def test_qwen3_next_tp8_numbers():
    """The README's picture: the state page padding vLLM pays, by its published numbers."""
    model = kv.model_cache("qwen3-next-80b-a3b", kv.ServingOptions(tp=8))
    mm = memory_map(kv.plan_cache(model, budget_bytes=80 << 30, max_seqs=64))
    _, page = mm.vllm
    assert [(b.kind, b.nbytes) for b in page.bands] == [("field", 137_216), ("padding", 10_240)]
    slot = mm.kvarena[2]
    assert [(b.label, b.nbytes) for b in slot.bands] == [
        ("conv_state (36 layers)", 221_184),
        ("recurrent_state (36 layers)", 4_718_592),
    ]


@given(
    page=field_lists(max_size=4),
    state=field_lists(max_size=4),
    budget=st.integers(1 << 12, 1 << 24),
    seqs=st.integers(1, 8),
    epr=st.integers(1, 3),
)
def test_random_layouts(page, state, budget, seqs, epr):
    try:
        model = kv.ModelCache.from_fields(page, state, block_size=16, entries_per_req=epr)
        plan = kv.plan_cache(model, budget_bytes=budget, max_seqs=seqs)
    except (PoolBudgetError, kv.InvalidValueError):
        assume(False)
    _check_plan(plan)


def test_a_bar_that_does_not_tile_is_refused():
    with pytest.raises(kv.InvalidValueError, match="does not continue"):
        Bar(title="x", total=10, bands=(Band(label="a", kind="field", offset=1, nbytes=9),))
    with pytest.raises(kv.InvalidValueError, match="end at 5"):
        Bar(title="x", total=10, bands=(Band(label="a", kind="field", offset=0, nbytes=5),))
