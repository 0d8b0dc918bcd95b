"""``replay --engines 1,2,4,... --picture``: what each arrangement of a fleet hits,
by engine count.

One line per arrangement (a router, alone or over a shared store): the
share of the trace's prompt tokens that hit, against the number of engines
(log scale, one marker per count). In the SVG each arrangement's line has
the id ``fleet-I``, so a test can count its points.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..replay.fleet import FleetResult
from .canvas import figure
from .curves import MARKERS


def draw_fleet_curve(results: Sequence[FleetResult], *, title: str) -> Any:
    fig = figure(9.0, 5.2)
    ax = fig.add_axes((0.09, 0.12, 0.62, 0.76))
    arrangements = list(dict.fromkeys(r.arrangement for r in results))
    counts = sorted({r.engines for r in results})
    for i, name in enumerate(arrangements):
        pts = sorted((r.engines, 100 * r.hit_fraction) for r in results if r.arrangement == name)
        ax.plot(
            [x for x, _ in pts],
            [y for _, y in pts],
            marker=MARKERS[i % len(MARKERS)],
            markersize=5,
            linewidth=1.6,
            linestyle="-" if "shared" in name else "--",
            label=name,
            gid=f"fleet-{i}",
        )
    if len(counts) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(n) for n in counts], fontsize=8)
    ax.minorticks_off()
    top = max((100 * r.hit_fraction for r in results), default=0.0)
    ax.set_ylim(0, min(100.0, 1.25 * top + 1.0))  # the curves, not an empty page above them
    ax.set_xlabel("engines")
    ax.set_ylabel("hit tokens, % of prompt tokens")
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    prompt = results[0].prompt_tokens if results else 0
    fig.text(0.73, 0.2, f"{prompt:,} prompt tokens a fleet", fontsize=8)
    return fig
