"""The main job: materialize a real model's request states and prove the bytes.

Each step returns a :class:`Check` (what was verified, and whether it held),
so the CLI renders progress and a report, and tests assert on the same
results. Every check compares bytes, never only shapes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import InvalidValueError
from ..layout import (
    EntryField,
    EntryMajorArena,
    SplitEntryMajorArena,
    carve_layer_major,
    entry_bytes_for,
    field_extents,
    layout_fingerprint,
    min_slot_stride,
    plan_field_planes,
    strictest_alignment,
)
from ..layout.regions import align_up
from ..models import ServingOptions, model_cache
from ..pools import UnifiedCache, plan_cache
from .records import Check, DemoConfig
from .system import _hf_checks, _tier_checks, _transfer_checks


def state_fields(model: str, tp: int) -> list[EntryField]:
    """The per-request state declaration of a model (preset name or config path)."""
    cache = model_cache(model, ServingOptions(tp=tp))
    if not cache.state_fields:
        raise InvalidValueError(
            f"{model} keeps no per-request state (only paged KV); the demo needs a model with "
            "states, e.g. qwen3-next-80b-a3b, mamba2-2.7b, nemotron-h-8b, deepseek-v4-flash"
        )
    return list(cache.state_fields)


def _entry_image(arena: EntryMajorArena, i: int) -> bytes:
    """What entry i must hold: each field's [:, i] bytes at its walk offset, zero padding."""
    image = bytearray(arena.entry_bytes)
    for ext in field_extents(arena.fields):
        col = arena.view(ext.field.name)[:, i].contiguous()
        image[ext.start : ext.end] = col.view(-1).view(torch.uint8).numpy().tobytes()
    return bytes(image)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: random patterns hold NaNs, which ``torch.equal`` calls unequal."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def _pattern_(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes, as the field's dtype, written through a (strided) view."""
    if t.numel():
        noise = torch.randint(
            0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen
        )
        t.copy_(noise.view(t.dtype).view(t.shape))


def run_demo(config: DemoConfig, device: torch.device) -> Iterator[Check]:
    """Yield one :class:`Check` per step; all must hold."""
    fields = state_fields(config.model, config.tp)
    gen = torch.Generator().manual_seed(config.seed)
    eb = entry_bytes_for(fields)
    # A state pool of 2N slots at the front of larger slots (someone else's
    # bytes between), with only the top N live, as a growing pool would be.
    n = config.requests
    stride = align_up(eb + 4096, strictest_alignment(fields))
    slots = 2 * n
    host = torch.full(((slots - 1) * stride + eb,), 0xA5, dtype=torch.uint8, device=device)
    for i in range(slots):
        host[i * stride : i * stride + eb] = 0
    gaps = torch.ones_like(host, dtype=torch.bool)
    for i in range(slots):
        gaps[i * stride : i * stride + eb] = False
    arena = EntryMajorArena(fields, slots, device, buf=host, slot_stride=stride, live_entries=n)
    live = range(slots - n, slots)
    live_slice = slice(slots - n, slots)  # a slice, so writes land in the arena, not a copy
    base = host.data_ptr()
    addresses_ok = all(
        arena.view(e.field.name)[layer, i].data_ptr()
        == base + i * stride + e.start + layer * e.field.bytes_per_layer
        for e in field_extents(fields)
        if e.nbytes
        for layer in range(e.field.layers)
        for i in range(slots)
    )
    yield Check(
        "kernel views address the slots",
        addresses_ok,
        f"{len(fields)} fields x layers x {slots} slots at slot_stride {stride:,} B; entry {eb:,} B, "
        f"fingerprint {layout_fingerprint(fields)[:16]}",
    )
    fills_ok = all(
        bool((arena.view(f.name)[:, live_slice] == f.fill).all())
        and not arena.view(f.name)[:, : slots - n].any()
        for f in fields
        if arena.view(f.name).numel()
    )
    yield Check("fills on live slots only", fills_ok, f"{n} live of {slots} slots")

    # Kernels write through per-layer views; each entry must then be exactly
    # its fields' bytes, in declared order, padding zero.
    for f in fields:
        _pattern_(arena.view(f.name)[:, live_slice], gen)
    images_ok = all(
        bytes(arena.entry(i).cpu().numpy().tobytes()) == _entry_image(arena, i) for i in live
    )
    yield Check("entry = its fields' bytes", images_ok, f"{n} entries compared byte for byte")

    # Move every request's state to a free slot: one copy per request.
    moves = list(zip(live, range(n), strict=True))
    for src, dst in moves:
        arena.entry(dst).copy_(arena.entry(src))
    moved_ok = all(
        _same_bytes(arena.view(f.name)[:, dst], arena.view(f.name)[:, src])
        for f in fields
        for src, dst in moves
    )
    yield Check(
        "whole-entry copies", moved_ok, f"{len(moves)} copies of {eb:,} B, views agree per layer"
    )
    yield Check(
        "gaps between slots untouched",
        bool((host[gaps] == 0xA5).all()),
        f"{int(gaps.sum()):,} foreign bytes keep their sentinel",
    )

    # The same state split over two planes of different row widths.
    widths = [4096, 65536]
    per_plane, rows = plan_field_planes(fields, widths)
    planes = [EntryMajorArena(g, 2, device, slot_stride=min_slot_stride(g)) for g in per_plane]
    split = SplitEntryMajorArena(planes)
    for f in fields:
        split.view(f.name).copy_(arena.view(f.name)[:, :2])
    split_ok = all(_same_bytes(split.view(f.name), arena.view(f.name)[:, :2]) for f in fields)
    yield Check(
        "planes planned exactly",
        split_ok,
        f"rows {rows} over widths {widths}: {[[f.name for f in g] for g in per_plane]}",
    )

    yield from _unified_checks(config.model, config.tp, device, gen)
    if device.type == "cpu":
        yield from _tier_checks(config.model, config.tp)
        yield from _transfer_checks(config.model, config.tp)
        yield from _hf_checks()

    # Layer-major regions carved from one buffer, as paged KV kernels want them.
    kv = [
        [
            EntryField("k", 4, (16, 2, 128), torch.bfloat16),
            EntryField("v", 4, (16, 2, 128), torch.bfloat16),
        ],
        [EntryField("k_scale", 4, (16, 2), torch.float32)],
    ]
    blocks = 8
    total = sum(align_up(entry_bytes_for(g) * blocks) for g in kv)
    pool = torch.zeros(total, dtype=torch.uint8, device=device)
    kv_arenas = [a for a in carve_layer_major(kv, blocks, device, buf=pool) if a is not None]
    for a in kv_arenas:
        for f in a.fields:
            _pattern_(a.view(f.name), gen)
    k = kv_arenas[0].view("k")
    contiguous_ok = all(k[layer].is_contiguous() for layer in range(k.shape[0]))
    disjoint_ok = (
        kv_arenas[0].buf.data_ptr() + kv_arenas[0].total_bytes <= kv_arenas[1].buf.data_ptr()
    )
    yield Check(
        "layer-major carve",
        contiguous_ok and disjoint_ok,
        f"{len(kv)} regions over {total:,} B, each layer contiguous",
    )


def _unified_checks(
    model: str, tp: int, device: torch.device, gen: torch.Generator
) -> Iterator[Check]:
    """Plan a budget, build the cache from the plan, checkpoint states into
    PAGE units, and move the boundary both ways under load.

    Models without paged layers (pure Mamba2) have no blocks to hold images or
    to move; after the plan check the step ends there rather than report
    checks that cannot fail.
    """
    preset = model_cache(model, ServingOptions(tp=tp))
    # Room for 4 states and ~20 states' worth of blocks: two checkpoint images
    # and a half-live fragmented pool still leave room to grow STATE by 6.
    budget = max(96 << 20, 24 * min_slot_stride(preset.state_fields))
    plan = plan_cache(preset, budget_bytes=budget, max_seqs=4, clamp=False)
    cache = UnifiedCache.from_plan(plan, device)
    yield Check(
        "cache holds what the plan promised",
        cache.num_blocks == plan.blocks and cache.num_slots == plan.state_slots,
        f"{budget >> 20} MiB: {cache.num_blocks} blocks of {plan.block_size} tokens "
        f"({cache.token_capacity:,} tokens), {cache.num_slots} state slots, "
        f"{plan.unused_bytes:,} B unused",
    )
    if not preset.page_fields:
        return

    # Checkpoint two live states into PAGE units, wipe one, restore it.
    spec = cache.checkpoint_spec()
    owners = ["ckpt-a", "ckpt-b"]
    slots = [cache.allocate_slots(r)[0] for r in owners]
    for s in slots:
        _pattern_(cache.slot_bytes_of(s), gen)
    before = [cache.slot_bytes_of(s).clone() for s in slots]
    units = [cache.blocks.allocate(spec.units_per_image) for _ in slots]
    stored = cache.store(spec, slots, units)
    cache.slot_bytes_of(slots[0]).fill_(0x5A)
    cache.restore(spec, slots[:1], units[:1])
    ranges = spec.ranges
    ckpt_ok = all(
        torch.equal(cache.slot_bytes_of(s)[o : o + n], b[o : o + n])
        for s, b in zip(slots, before, strict=True)
        for o, n in ranges
    )
    yield Check(
        "checkpoint store/restore",
        ckpt_ok,
        f"2 images of {spec.image_bytes:,} B in {spec.units_per_image} blocks each; "
        f"{stored.ops} copy ops for {stored.spans} spans; the restored ranges equal the saved ones",
    )

    blocks = cache.blocks.allocate(cache.blocks.num_free)
    seeds = {}
    for b in blocks[::2]:
        cache.blocks.release(b)  # fragment: every other block free
    for b in blocks[1::2]:
        seeds[b] = int(torch.randint(0, 256, (1,), generator=gen))
        cache.block_bytes_of(b).fill_(seeds[b])
    reqs = {r: cache.allocate_slots(r)[0] for r in range(cache.slots.num_free)}
    for r, slot in reqs.items():
        cache.slot_bytes_of(slot).fill_(r + 1)
    grow = cache.grow_state(6)
    seeds = {grow.block_remap.get(b, b): v for b, v in seeds.items()}
    units = [[grow.block_remap.get(u, u) for u in us] for us in units]
    blocks_ok = all(bool((cache.block_bytes_of(b) == v).all()) for b, v in seeds.items())
    # The images moved with their blocks: restoring the second one after the
    # move still gives back the bytes saved before it.
    cache.slot_bytes_of(slots[1]).fill_(0xA5)
    cache.restore(spec, slots[1:], units[1:])
    image_ok = all(
        torch.equal(cache.slot_bytes_of(slots[1])[o : o + n], before[1][o : o + n])
        for o, n in ranges
    )
    # Fill the slots won from PAGE, then finish the original (topmost) requests:
    # the live states now sit at the bottom, where a shrink releases slots.
    extra = {r: cache.allocate_slots(r)[0] for r in range(100, 100 + cache.slots.num_free)}
    for done in [*reqs, *owners]:
        cache.release_slots(done)
    for r, slot in extra.items():
        cache.slot_bytes_of(slot).fill_(r % 251)
    shrink = cache.shrink_state(len(reqs) + len(owners))
    states_ok = all(
        bool((cache.slot_bytes_of(shrink.slot_remap.get(s, s)) == r % 251).all())
        for r, s in extra.items()
    )
    yield Check(
        "boundary moves",
        blocks_ok and image_ok and states_ok and bool(grow.block_remap) and bool(shrink.slot_remap),
        f"grow +6 slots: {len(grow.block_remap)} live blocks relocated in {grow.copies} "
        f"cop{'y' if grow.copies == 1 else 'ies'}, "
        f"checkpoint images among them; shrink: {len(shrink.slot_remap)} live states relocated; "
        "every byte followed its remap",
    )
