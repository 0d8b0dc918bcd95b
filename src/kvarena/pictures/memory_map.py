"""``kvarena plan --picture``: the memory map, drawn to scale.

Each :class:`~.bands.Bar` is one row whose width is its ``total`` bytes; each
band is a rectangle ``nbytes / total`` of that width, at ``offset / total``,
so a band is exactly as wide as its share of the entry or buffer. Every band,
however thin, is also listed in the key under its bar with its offset and
size, since a 4 KiB conv state beside a 37 MiB SSM state is a hairline. In
the SVG each rectangle carries an id (``bar-S-I``, ``band-S-I-J``,
``mark-S-I-K``: section, bar, band) so a test or a tool can find it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .bands import Band, Bar, MemoryMap
from .canvas import COLORS, FIELD_COLORS, figure, human_bytes, save

WIDTH_IN = 12.0
LEFT_IN, RIGHT_IN = 0.4, 0.4
BAR_IN = 0.42
LINE_IN = 0.19
KEY_COLUMNS = 2
KEY_CHARS = 105  # characters of 7-pt key text that fit half the width


def _key_text(bar: Bar, b: Band) -> str:
    share = 100 * b.nbytes / bar.total if bar.total else 0
    text = f"{b.label}: @{b.offset:,}, {b.nbytes:,} B ({human_bytes(b.nbytes)}, {share:.2f}%)"
    return f"{text}  {b.detail}" if b.detail else text


def _key_columns(texts: list[str]) -> int:
    """Two columns of key where every line fits half the width, else one."""
    return KEY_COLUMNS if max(map(len, texts), default=0) <= KEY_CHARS else 1


def _key_lines(bar: Bar) -> int:
    columns = _key_columns([_key_text(bar, b) for b in bar.bands])
    return -(-len(bar.bands) // columns) + len(bar.notes) + bool(bar.marks)


def _height(mm: MemoryMap) -> float:
    h = 0.55
    for bars in (mm.kvarena, mm.vllm):
        if bars:
            h += 0.35
        for bar in bars:
            h += 0.3 + BAR_IN + (0.18 if bar.marks else 0) + LINE_IN * _key_lines(bar) + 0.15
    return h


def _band_color(kind: str, field_index: int) -> str:
    if kind == "field":
        return FIELD_COLORS[field_index % len(FIELD_COLORS)]
    return COLORS[kind]


def _draw_bar(fig: Any, bar: Bar, gid: str, top: float, height: float) -> float:
    """Draw ``bar`` with its top ``top`` inches above the bottom; return the next top."""
    from matplotlib.patches import Rectangle

    width = WIDTH_IN - LEFT_IN - RIGHT_IN
    fig.text(LEFT_IN / WIDTH_IN, (top - 0.22) / height, bar.title, fontsize=10)
    top -= 0.3
    ax = fig.add_axes(
        (LEFT_IN / WIDTH_IN, (top - BAR_IN) / height, width / WIDTH_IN, BAR_IN / height)
    )
    ax.set_xlim(0, bar.total)
    ax.set_ylim(0, 1)
    ax.set_axis_off()
    outline = Rectangle(
        (0, 0),
        bar.total,
        1,
        facecolor="none",
        edgecolor="#333333",
        linewidth=0.8,
        gid=f"bar-{gid}",
        zorder=3,
    )
    outline.set_snap(False)
    ax.add_patch(outline)
    colors = []
    fields = 0
    for j, b in enumerate(bar.bands):
        color = _band_color(b.kind, fields)
        fields += b.kind == "field"
        colors.append(color)
        rect = Rectangle(
            (b.offset, 0),
            b.nbytes,
            1,
            facecolor=color,
            edgecolor="none",
            hatch="////" if b.kind == "padding" else None,
            gid=f"band-{gid}-{j}",
        )
        rect.set_snap(False)
        ax.add_patch(rect)
        share = b.nbytes / bar.total if bar.total else 0
        if share * width * 72 > 7 * len(b.label):  # the label fits inside (~7 pt a char)
            ax.text(
                b.offset + b.nbytes / 2,
                0.5,
                b.label,
                ha="center",
                va="center",
                fontsize=8,
                clip_on=True,
                zorder=4,
            )
    top -= BAR_IN
    if bar.marks:
        for k, (offset, nbytes) in enumerate(bar.marks):
            mark = Rectangle(
                (offset, -0.32),
                nbytes,
                0.18,
                facecolor=COLORS["mark"],
                edgecolor="none",
                clip_on=False,
                gid=f"mark-{gid}-{k}",
            )
            mark.set_snap(False)
            ax.add_patch(mark)
        top -= 0.18
    x0 = LEFT_IN / WIDTH_IN
    texts = [_key_text(bar, b) for b in bar.bands]
    columns = _key_columns(texts)
    col_w = (width / columns) / WIDTH_IN
    rows = -(-len(bar.bands) // columns)
    for j, (b, text) in enumerate(zip(bar.bands, texts, strict=True)):
        r, c = j % rows, j // rows
        y = (top - LINE_IN * (r + 1) + 0.04) / height
        glyph, color = ("\u25a8", "#777777") if b.kind == "padding" else ("\u25a0", colors[j])
        fig.text(x0 + c * col_w, y, glyph, color=color, fontsize=9)
        fig.text(x0 + c * col_w + 0.015, y, text, fontsize=7)
    top -= LINE_IN * rows
    extra = list(bar.notes)
    if bar.marks:
        extra.append(
            f"{bar.mark_label} (red, under the bar): "
            + ", ".join(f"@{o:,} +{n:,}" for o, n in bar.marks)
        )
    for line in extra:
        top -= LINE_IN
        fig.text(x0, (top + 0.04) / height, line, fontsize=7, style="italic")
    return top - 0.15


def draw_memory_map(mm: MemoryMap) -> Any:
    """The memory map as a matplotlib figure (kvarena's bars, then vLLM's)."""
    height = _height(mm)
    fig = figure(WIDTH_IN, height)
    fig.text(LEFT_IN / WIDTH_IN, (height - 0.35) / height, mm.title, fontsize=12, weight="bold")
    top = height - 0.55
    sections = (
        ("k", "kvarena: one contiguous range per block and per request", mm.kvarena),
        ("v", "vLLM page unification, same budget", mm.vllm),
    )
    for s, heading, bars in sections:
        if not bars:
            continue
        fig.text(LEFT_IN / WIDTH_IN, (top - 0.25) / height, heading, fontsize=11, weight="bold")
        top -= 0.35
        for i, bar in enumerate(bars):
            top = _draw_bar(fig, bar, f"{s}-{i}", top, height)
    return fig


def write_memory_map(mm: MemoryMap, path: Path) -> None:
    """Draw ``mm`` and write it to ``path`` (``.svg`` or ``.png``)."""
    save(draw_memory_map(mm), path)
