"""The one place kvarena touches matplotlib: a figure, and its bytes as SVG or PNG.

Figures are built with :class:`matplotlib.figure.Figure` directly, never
through ``pyplot``, so drawing selects no backend and changes no global state
of a program that imports kvarena (matplotlib's non-interactive SVG and Agg
canvases are picked per ``savefig`` by the format). SVG output carries no
date and its ids are salted with a constant (inside an ``rc_context``, so
matplotlib's settings are back as they were after each save): the same plan
draws the same file, and a committed picture changes only when its numbers do.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from .files import require_matplotlib, write_whole

COLORS = {
    "blocks": "#4c78a8",
    "attention pages": "#4c78a8",
    "slots": "#f58518",
    "state pages": "#f58518",
    "unused": "#e6e6e6",
    "padding": "#ffffff",
    "mark": "#d62728",
}
FIELD_COLORS = (
    "#54a24b",
    "#eeca3b",
    "#b279a2",
    "#72b7b2",
    "#ff9da6",
    "#9d755d",
    "#bab0ac",
    "#e45756",
    "#88d27a",
    "#83bcb6",
)


def figure(width_in: float, height_in: float) -> Any:
    """A new figure, white, of the given size in inches."""
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), facecolor="white")


def figure_bytes(fig: Any, fmt: str) -> bytes:
    """``fig`` rendered as ``svg`` or ``png`` bytes."""
    buf = io.BytesIO()
    if fmt == "svg":
        import matplotlib

        with matplotlib.rc_context({"svg.hashsalt": "kvarena"}):
            fig.savefig(buf, format="svg", metadata={"Date": None})
    else:
        fig.savefig(buf, format="png", dpi=150)
    return buf.getvalue()


def save(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` (its extension says the format), whole or not at all."""
    write_whole(path, figure_bytes(fig, path.suffix.lower().lstrip(".")))


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units, three significant digits (for axes and labels)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"  # pragma: no cover - the loop returns
