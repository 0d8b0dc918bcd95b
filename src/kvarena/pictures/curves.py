"""``replay --sweep --picture`` and ``replay --timeline``: a replay's numbers over
budget and over time.

The budget curve plots each policy's hit tokens as a share of the
infinite-cache bound against the budget (log scale, one marker per replayed
budget) with the bound as a line at 1. In the SVG each policy's line has the
id ``curve-I`` (its markers are drawn inside it, one per budget) and the bound
``bound``, so a test can count points. The timeline stacks four panels over
simulated time: device occupancy, the boundary (STATE slots held), hit tokens
per window and evictions per window.
"""

from __future__ import annotations

from typing import Any

from ..replay.run import ReplayResult
from ..replay.sweep import Sweep
from ..replay.timeline import windows
from .canvas import figure, human_bytes

MARKERS = ("o", "s", "^", "D", "v", "P")


def draw_budget_curve(sw: Sweep, *, title: str) -> Any:
    """The sweep's curves as a figure."""
    fig = figure(9.0, 5.2)
    ax = fig.add_axes((0.09, 0.12, 0.62, 0.76))
    xs = list(sw.budgets)
    for i, policy in enumerate(sw.policies):
        pts = sw.curve(policy)
        ax.plot(
            [p.budget_bytes for p in pts],
            [p.share_of_bound for p in pts],
            marker=MARKERS[i % len(MARKERS)],
            markersize=5,
            linewidth=1.6,
            label=policy,
            gid=f"curve-{i}",
        )
    ax.axhline(
        1.0, color="#333333", linestyle="--", linewidth=1.0, label="infinite cache", gid="bound"
    )
    if len(xs) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([human_bytes(b) for b in xs], rotation=30, fontsize=8)
    ax.minorticks_off()
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("device cache budget")
    ax.set_ylabel("hit tokens / infinite-cache hit tokens")
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    bound = sw.bound
    fig.text(
        0.73,
        0.2,
        f"bound: {bound.hit_tokens:,} of {bound.prompt_tokens:,}\nprompt tokens "
        f"({100 * bound.hit_tokens / max(1, bound.prompt_tokens):.1f}%), {bound.requests:,} "
        "requests",
        fontsize=8,
    )
    return fig


def draw_timeline(result: ReplayResult, *, title: str, count: int = 80) -> Any:
    """Four panels over the replay's simulated time (needs ``ReplayConfig(timeline=True)``)."""
    ws = windows(result.timeline, count)
    fig = figure(10.0, 8.0)
    axes = fig.subplots(4, 1, sharex=True)
    t = [w.end for w in ws]
    width = (ws[0].end - ws[0].start) * 0.9 if ws else 1.0
    occ, slots, hits, ev = axes
    occ.fill_between(t, [w.live for w in ws], step="pre", alpha=0.8, label="held by requests")
    occ.fill_between(
        t,
        [w.live for w in ws],
        [w.occupancy for w in ws],
        step="pre",
        alpha=0.5,
        label="cached (evictable)",
    )
    occ.set_ylim(0, 1.05)
    occ.set_ylabel("PAGE blocks\nin use")
    occ.legend(loc="lower right", fontsize=7)
    slots.step(t, [w.slots for w in ws], where="pre", color="#f58518")
    slots.set_ylabel("STATE slots\n(boundary)")
    hits.bar(t, [w.hit_tokens for w in ws], width=-width, align="edge", color="#54a24b")
    hits.set_ylabel("hit tokens\nper window")
    ev.bar(t, [w.evicted_blocks for w in ws], width=-width, align="edge", label="blocks")
    ev.set_ylabel("evicted blocks\nper window")
    if any(w.evicted_images for w in ws):
        twin = ev.twinx()
        twin.plot(t, [w.evicted_images for w in ws], color="#d62728", linewidth=1.0)
        twin.set_ylabel("images", color="#d62728")
    ev.set_xlabel("simulated seconds")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[0].set_title(title, fontsize=10, loc="left")
    fig.subplots_adjust(left=0.1, right=0.9, top=0.94, bottom=0.07, hspace=0.15)
    return fig
