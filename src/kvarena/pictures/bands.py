"""A memory map as plain data: bars of bands, each band a byte range.

This is the pure half of ``kvarena plan --picture``: from a
:class:`~kvarena.pools.CachePlan` it says what the picture shows, to the
byte, and the drawing (:mod:`.memory_map`) only scales it. Every number comes
from the walk the cache itself is carved with (:func:`~kvarena.layout.layout_rows`
for an entry's fields, :class:`~kvarena.pools.PoolGeometry` for the buffer,
:class:`~kvarena.models.vllm_pages.VllmPages` for vLLM's layout), so the picture
cannot show a layout the cache would not hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint import CheckpointSpec
from ..errors import InvalidValueError
from ..layout import layout_rows
from ..models.vllm_pages import VllmPages
from ..pools import CachePlan

KINDS = ("field", "padding", "unused", "blocks", "slots", "state pages", "attention pages")
"""What a band can be: a field, alignment padding, bytes nothing uses, or a pool's region."""


@dataclass(frozen=True, kw_only=True)
class Band:
    """``nbytes`` bytes at ``offset`` within its bar, of one ``kind`` (see :data:`KINDS`)."""

    label: str
    kind: str
    offset: int
    nbytes: int
    detail: str = ""  # dtype, layers x shape, fill: what a reader needs beside the size

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, kw_only=True)
class Bar:
    """One row of the picture: ``total`` bytes cut into bands that tile it in offset order.

    ``marks`` are byte ranges drawn under the bar (a STATE entry's checkpoint
    ranges); ``notes`` are lines printed beside it.
    """

    title: str
    total: int
    bands: tuple[Band, ...]
    marks: tuple[tuple[int, int], ...] = ()
    mark_label: str = ""
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        at = 0
        for b in self.bands:
            if b.offset != at or b.nbytes < 0 or b.kind not in KINDS:
                raise InvalidValueError(f"bar {self.title!r}: band {b} does not continue at {at}")
            at = b.end
        if at != self.total:
            raise InvalidValueError(
                f"bar {self.title!r}: bands end at {at}, the bar at {self.total}"
            )


@dataclass(frozen=True, kw_only=True)
class MemoryMap:
    """What ``kvarena plan --picture`` draws: kvarena's bars, and vLLM's beside them."""

    title: str
    kvarena: tuple[Bar, ...]
    vllm: tuple[Bar, ...] = ()


def _tile(total: int, pieces: list[tuple[str, str, int, int, str]]) -> tuple[Band, ...]:
    """Bands for ``pieces`` (label, kind, offset, bytes, detail), with every gap
    between them (and after the last) filled by a padding band."""
    bands: list[Band] = []
    at = 0
    for label, kind, offset, nbytes, detail in pieces:
        if offset > at:
            bands.append(Band(label="padding", kind="padding", offset=at, nbytes=offset - at))
        if nbytes:
            bands.append(Band(label=label, kind=kind, offset=offset, nbytes=nbytes, detail=detail))
        at = offset + nbytes
    if total > at:
        bands.append(Band(label="padding", kind="padding", offset=at, nbytes=total - at))
    return tuple(bands)


def entry_bar(title: str, fields: Any, stride: int, *, checkpoint: bool) -> Bar:
    """One entry (a block or a slot) over its stride: each field, the padding
    the walk puts before it, the tail to the entry's end and on to the stride."""
    rows, _, _ = layout_rows(fields)
    pieces = []
    for r in rows:
        fill = "" if r.fill == 0 else f", filled with {r.fill!r}"
        detail = f"{r.dtype}, {r.layers} x {list(r.shape)}{fill}"
        pieces.append((f"{r.name} ({r.layers} layers)", "field", r.start, r.nbytes, detail))
    marks: tuple[tuple[int, int], ...] = ()
    if checkpoint:
        marks = tuple(CheckpointSpec.build(fields, max(stride, 1)).ranges)
    return Bar(
        title=title,
        total=stride,
        bands=_tile(stride, pieces),
        marks=marks,
        mark_label="checkpoint ranges" if marks else "",
    )


def buffer_bar(plan: CachePlan) -> Bar:
    """The whole budget: PAGE blocks from offset 0, STATE slots hanging from the top."""
    g = plan.geometry
    first = g.total_slots - plan.state_slots
    boundary = g.boundary(first) if plan.state_slots else g.top
    page_end = plan.blocks * plan.block_stride
    pieces = []
    if plan.blocks:
        pieces.append(
            (
                f"PAGE: {plan.blocks:,} blocks",
                "blocks",
                0,
                page_end,
                f"{plan.block_stride:,} B each, {plan.token_capacity:,} tokens",
            )
        )
    if page_end < boundary:
        pieces.append(("unused", "unused", page_end, boundary - page_end, "below the boundary"))
    if plan.state_slots:
        pieces.append(
            (
                f"STATE: {plan.state_slots:,} slots",
                "slots",
                boundary,
                g.top - boundary,
                f"{plan.slot_stride:,} B each, {plan.max_seqs:,} requests",
            )
        )
    if g.top < plan.budget_bytes:
        pieces.append(("unused", "unused", g.top, plan.budget_bytes - g.top, "above the top"))
    return Bar(
        title=f"kvarena buffer: {plan.budget_bytes:,} B",
        total=plan.budget_bytes,
        bands=_tile(plan.budget_bytes, pieces),
        notes=(f"unused {plan.unused_bytes:,} B",),
    )


def vllm_bars(plan: CachePlan) -> tuple[Bar, ...]:
    """vLLM's page-unified layout of the same budget (hybrid models only)."""
    v = VllmPages.of(plan.model, plan.budget_bytes, plan.max_seqs)
    if v is None:
        return ()
    g, page = v.group_size, v.page_bytes
    used_ids = min(v.num_block_ids, v.state_block_ids)
    state_region = used_ids * g * page
    padding = v.padding_bytes_at_max_seqs if v.fits_max_seqs else 0
    padding = min(padding, state_region)
    attn_region = (v.num_block_ids - used_ids) * g * page
    pieces = [
        (
            "attention pages",
            "attention pages",
            0,
            attn_region,
            f"{v.kv_token_capacity:,} tokens in {v.attention_block_tokens}-token blocks",
        ),
        (
            "state pages",
            "state pages",
            attn_region,
            state_region - padding,
            f"{used_ids:,} block ids of {g} pages",
        ),
        (
            "page padding",
            "padding",
            attn_region + state_region - padding,
            padding,
            "state pages padded to the attention page",
        ),
    ]
    end = attn_region + state_region
    if end < plan.budget_bytes:
        pieces.append(("unused", "unused", end, plan.budget_bytes - end, ""))
    notes = [f"padding at {plan.max_seqs} requests {v.padding_bytes_at_max_seqs:,} B"]
    if not v.fits_max_seqs:
        notes.append(f"{plan.max_seqs} requests' state pages do not fit this budget")
    buffer = Bar(
        title=f"vLLM buffer: {plan.budget_bytes:,} B",
        total=plan.budget_bytes,
        bands=tuple(
            Band(label=a, kind=k, offset=o, nbytes=n, detail=d) for a, k, o, n, d in pieces if n
        ),
        notes=tuple(notes),
    )
    one_page = Bar(
        title=f"vLLM page (one layer): {page:,} B",
        total=page,
        bands=_tile(
            page,
            [
                (
                    "one layer's state",
                    "field",
                    0,
                    v.state_page_bytes,
                    f"{v.state_page_bytes:,} B",
                )
            ],
        ),
        notes=(
            f"attention block {v.attention_block_tokens} tokens "
            f"(kvarena: {plan.block_size}); state page padding "
            f"{v.state_page_padding_bytes:,} B",
        ),
    )
    return buffer, one_page


def memory_map(plan: CachePlan) -> MemoryMap:
    """Everything ``kvarena plan --picture`` draws for ``plan``."""
    if not isinstance(plan, CachePlan):
        raise TypeError(f"memory_map: plan must be a CachePlan, got {type(plan).__name__}")
    bars = [buffer_bar(plan)]
    if plan.page_fields:
        bars.append(
            entry_bar(
                f"PAGE block (every paged layer, {plan.block_size} tokens): "
                f"{plan.block_stride:,} B",
                plan.page_fields,
                plan.block_stride,
                checkpoint=False,
            )
        )
    if plan.state_fields:
        bars.append(
            entry_bar(
                f"STATE slot (one request): {plan.slot_stride:,} B",
                plan.state_fields,
                plan.slot_stride,
                checkpoint=True,
            )
        )
    opts = plan.model.options
    title = f"{plan.name}: TP {opts.tp}, {plan.budget_bytes:,} B, {plan.max_seqs} requests"
    return MemoryMap(title=title, kvarena=tuple(bars), vllm=vllm_bars(plan))
