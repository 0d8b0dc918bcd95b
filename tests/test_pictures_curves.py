"""The budget curve has one point per budget per policy; the timeline draws its panels."""

import xml.etree.ElementTree as ET

import pytest
from test_replay import SMALL, synthetic_lines

from kvarena.replay import ReplayConfig, parse_trace, replay
from kvarena.replay.sweep import sweep

pytest.importorskip("matplotlib")

from kvarena.pictures.canvas import figure_bytes
from kvarena.pictures.curves import draw_budget_curve, draw_timeline

SVG = "{http://www.w3.org/2000/svg}"


def _groups(svg: bytes) -> dict[str, ET.Element]:
    return {g.get("id"): g for g in ET.fromstring(svg).iter(f"{SVG}g") if g.get("id")}


def test_one_marker_per_budget_per_policy():
    trace = parse_trace(synthetic_lines(3, conversations=12))
    budgets = (1 << 20, 2 << 20, 4 << 20)
    sw = sweep(
        SMALL, trace, ReplayConfig(budget_bytes=1, max_seqs=4), budgets, compare=True, workers=1
    )
    groups = _groups(figure_bytes(draw_budget_curve(sw, title="t"), "svg"))
    for i, _policy in enumerate(sw.policies):
        uses = list(groups[f"curve-{i}"].iter(f"{SVG}use"))
        assert len(uses) == len(budgets)
        ys = [float(u.get("y")) for u in uses]
        # Higher share, higher on the page (smaller y): the markers follow the points' order.
        shares = [p.share_of_bound for p in sw.curve(sw.policies[i])]
        order = sorted(range(len(ys)), key=lambda k: (-shares[k], k))
        assert sorted(ys) == [ys[k] for k in order] or len(set(shares)) < len(shares)
    assert f"curve-{len(sw.policies)}" not in groups and "bound" in groups


def test_the_timeline_draws_four_panels():
    trace = parse_trace(synthetic_lines(5, conversations=10))
    r = replay(SMALL, trace, ReplayConfig(budget_bytes=1 << 20, max_seqs=4, timeline=True))
    groups = _groups(figure_bytes(draw_timeline(r, title="t", count=20), "svg"))
    assert {f"axes_{i}" for i in range(1, 5)} <= set(groups)
    png = figure_bytes(draw_timeline(r, title="t"), "png")
    assert png[:4] == b"\x89PNG"
