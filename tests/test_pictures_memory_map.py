"""The memory map is drawn to scale: every band's width in the SVG is its byte share."""

import re
import xml.etree.ElementTree as ET

import pytest
from conftest import field_lists
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvarena as kv
from kvarena.pictures.bands import memory_map
from kvarena.pictures.canvas import figure_bytes
from kvarena.pictures.memory_map import draw_memory_map
from kvarena.pools import PoolBudgetError

pytest.importorskip("matplotlib")

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _extents(svg: bytes) -> dict[str, tuple[float, float]]:
    """Every id'd rectangle's [x0, x1] in SVG units."""
    out = {}
    for g in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}g"):
        gid = g.get("id", "")
        if not re.match(r"(bar|band|mark)-", gid):
            continue
        (path,) = list(g.iter("{http://www.w3.org/2000/svg}path"))
        xs = [float(x) for x in NUMBER.findall(path.get("d"))[0::2]]
        out[gid] = (min(xs), max(xs))
    return out


def _check_to_scale(plan):
    mm = memory_map(plan)
    ext = _extents(figure_bytes(draw_memory_map(mm), "svg"))
    for s, bars in (("k", mm.kvarena), ("v", mm.vllm)):
        for i, bar in enumerate(bars):
            x0, x1 = ext[f"bar-{s}-{i}"]
            width = x1 - x0
            at = x0
            for j, band in enumerate(bar.bands):
                b0, b1 = ext[f"band-{s}-{i}-{j}"]
                share = band.nbytes / bar.total
                # Within 1% of the share; SVG writes 6 decimals, which bounds the thinnest.
                assert abs((b1 - b0) / width - share) <= 0.01 * share + 2e-6 / width, (bar, band)
                assert abs(b0 - at) <= 1e-5 + 1e-6 * width  # in offset order, no gaps
                assert abs(b0 - x0 - band.offset / bar.total * width) <= 1e-4
                at = b1
            assert abs(at - x1) <= 1e-4
            for k, (offset, nbytes) in enumerate(bar.marks):
                m0, m1 = ext[f"mark-{s}-{i}-{k}"]
                assert abs((m1 - m0) / width - nbytes / bar.total) <= 0.01 * nbytes / bar.total
                assert abs(m0 - x0 - offset / bar.total * width) <= 1e-4
            paddings = [b for b in bar.bands if b.kind == "padding"]
            drawn = sum(
                ext[f"band-{s}-{i}-{bar.bands.index(b)}"][1]
                - ext[f"band-{s}-{i}-{bar.bands.index(b)}"][0]
                for b in paddings
            )
            want = sum(b.nbytes for b in paddings) / bar.total * width
            assert abs(drawn - want) <= 0.01 * want + 1e-4
    return mm


@pytest.mark.parametrize("preset", kv.PRESETS)
def test_presets_to_scale(preset):
    model = kv.model_cache(preset, kv.ServingOptions(tp=8 if preset != "mamba2-2.7b" else 1))
    _check_to_scale(kv.plan_cache(model, budget_bytes=80 << 30, max_seqs=64))


@settings(max_examples=15)
@given(
    page=field_lists(max_size=4),
    state=field_lists(max_size=4),
    budget=st.integers(1 << 14, 1 << 24),
    seqs=st.integers(1, 8),
)
def test_random_layouts_to_scale(page, state, budget, seqs):
    try:
        model = kv.ModelCache.from_fields(page, state, block_size=16)
        plan = kv.plan_cache(model, budget_bytes=budget, max_seqs=seqs)
    except (PoolBudgetError, kv.InvalidValueError):
        assume(False)
    _check_to_scale(plan)


def test_png_is_a_png(tmp_path):
    from kvarena.pictures.memory_map import write_memory_map

    plan = kv.plan_cache(kv.model_cache("llama-3.1-8b"), budget_bytes=1 << 30, max_seqs=4)
    path = tmp_path / "map.png"
    write_memory_map(memory_map(plan), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["map.png"]  # no temporary file left
