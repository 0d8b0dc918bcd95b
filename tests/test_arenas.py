import math

import pytest
import torch
from conftest import field_lists, random_fill_, tensor_bytes
from hypothesis import given
from hypothesis import strategies as st

from kvarena import EntryField
from kvarena.layout import (
    EntryMajorArena,
    LayerMajorArena,
    SplitEntryMajorArena,
    align_up,
    carve_layer_major,
    entry_bytes_for,
    field_extents,
    min_slot_stride,
    plan_regions,
    strictest_alignment,
)

CPU = torch.device("cpu")
SENTINEL = 0xA5


def expected_fill_bytes(field: EntryField) -> bytes:
    one = torch.full((1,), field.fill, dtype=field.dtype)
    return tensor_bytes(one) * (field.bytes_per_entry // field.itemsize)


def check_view_addresses(view, field, base_offset, layer_stride, entry_stride, entries):
    """Every (layer, entry) pair starts where the contract says, in bytes."""
    item = field.itemsize
    assert view.shape == (field.layers, entries, *field.shape)
    assert view.dtype == field.dtype
    for layer in range(field.layers):
        for i in range(entries):
            at = view[layer, i]
            assert (
                at.storage_offset() * item == base_offset + layer * layer_stride + i * entry_stride
            )
    if view.numel():
        assert view[0, 0].is_contiguous()


@st.composite
def arena_cases(draw):
    fields = draw(field_lists(max_size=5))
    eb = entry_bytes_for(fields)
    align = strictest_alignment(fields)
    extra = draw(st.integers(0, 3)) * align
    entries = draw(st.integers(0, 5))
    live = draw(st.integers(0, entries))
    lead = draw(st.integers(0, 3)) * align
    return fields, align_up(eb, align) + extra, entries, live, lead


@given(arena_cases(), st.integers(0, 2**31))
def test_entry_major_bytes_addresses_fills_and_sentinels(case, seed):
    fields, stride, entries, live, lead = case
    eb = entry_bytes_for(fields)
    total = (entries - 1) * stride + eb if entries else 0
    # A host allocation full of sentinels; the arena's entries are zeroed (as
    # the contract requires of a caller's buffer) but its gaps and the bytes
    # before and after belong to someone else and keep their sentinels.
    host = torch.full((lead + total + 512,), SENTINEL, dtype=torch.uint8)
    buf = host[lead : lead + total]
    for i in range(entries):
        buf[i * stride : i * stride + eb] = 0
    before = host.clone()
    arena = EntryMajorArena(fields, entries, CPU, buf=buf, slot_stride=stride, live_entries=live)
    assert arena.total_bytes == total and arena.entry_bytes == eb and arena.slot_stride == stride
    first_live = entries - live

    extents = field_extents(fields)
    for ext in extents:
        f = ext.field
        view = arena.view(f.name)
        assert arena.field_offset(f.name) == ext.start
        check_view_addresses(view, f, lead + ext.start, f.bytes_per_layer, stride, entries)
        # Fill on live entries only; non-live entries stay zero.
        for i in range(entries):
            got = tensor_bytes(view[:, i])
            want = expected_fill_bytes(f) if i >= first_live else bytes(f.bytes_per_entry)
            assert got == want, (f.name, i)

    # Write random bytes through every view, then read whole entries.
    gen = torch.Generator().manual_seed(seed)
    for ext in extents:
        random_fill_(arena.view(ext.field.name), gen)
    for i in range(entries):
        want = bytearray(eb)  # padding stays zero
        for ext in extents:
            want[ext.start : ext.end] = tensor_bytes(arena.view(ext.field.name)[:, i])
        assert tensor_bytes(arena.entry(i)) == bytes(want)
        assert arena.entry(i).storage_offset() == lead + i * stride

    # Nothing outside the entries was written: not before, between or after.
    mask = torch.ones_like(host, dtype=torch.bool)
    for i in range(entries):
        mask[lead + i * stride : lead + i * stride + eb] = False
    assert torch.equal(host[mask], before[mask])


@given(field_lists(max_size=5), st.integers(0, 4))
def test_owned_entry_major_is_zeroed_with_padding_zero(fields, entries):
    eb = entry_bytes_for(fields)
    stride = align_up(eb, strictest_alignment(fields))
    arena = EntryMajorArena(fields, entries, CPU, slot_stride=stride)
    assert arena.buf.numel() == ((entries - 1) * stride + eb if entries else 0)
    for i in range(entries):
        raw = tensor_bytes(arena.entry(i))
        for ext in field_extents(fields):
            assert raw[ext.start : ext.end] == expected_fill_bytes(ext.field)
        pad = bytearray(raw)
        for ext in field_extents(fields):
            pad[ext.start : ext.end] = bytes(ext.nbytes)
        assert pad == bytes(eb)


STRIDE = 6144  # the smallest legal stride for _gdn_fields()


def _gdn_fields():
    return [
        EntryField("conv", 3, (3, 64), torch.bfloat16),
        EntryField("ssm", 3, (4, 8, 8), torch.float32, align=1024),
        EntryField("score", 2, (8,), torch.float32, fill=-math.inf, in_checkpoint=False),
    ]


def test_entry_major_strides_by_hand():
    # conv: [0, 1152); ssm (align 1024): [2048, 5120); score: [5120, 5184) -> 5376.
    fields = _gdn_fields()
    assert [(e.start, e.end) for e in field_extents(fields)] == [
        (0, 1152),
        (2048, 5120),
        (5120, 5184),
    ]
    assert entry_bytes_for(fields) == 5376
    with pytest.raises(ValueError, match="smallest legal stride here is 6144"):
        EntryMajorArena(fields, 4, CPU)  # the default stride 5376 breaks ssm's alignment
    arena = EntryMajorArena(fields, 4, CPU, slot_stride=8192)
    conv, ssm = arena.view("conv"), arena.view("ssm")
    assert conv.stride() == (3 * 64, 8192 // 2, 64, 1)
    assert ssm.stride() == (4 * 8 * 8, 8192 // 4, 64, 8, 1)
    assert arena.field_offset("ssm") == 2048
    assert arena.entry(3).numel() == arena.entry_bytes == 5376
    assert arena.entry(3).storage_offset() == 3 * 8192


def test_entry_major_refusals():
    fields = _gdn_fields()
    eb = entry_bytes_for(fields)
    with pytest.raises(ValueError, match="duplicate field name 'conv'"):
        EntryMajorArena([fields[0], fields[0]], 2, CPU)
    with pytest.raises(ValueError, match=f"below the entry size {eb}"):
        EntryMajorArena(fields, 2, CPU, slot_stride=eb - 256)
    with pytest.raises(ValueError, match="strictest alignment 1024"):
        EntryMajorArena(fields, 2, CPU, slot_stride=eb + 256)
    with pytest.raises(ValueError, match=r"live_entries must be an int in 0\.\.2, got 3"):
        EntryMajorArena(fields, 2, CPU, live_entries=3, slot_stride=STRIDE)
    with pytest.raises(ValueError, match=r"entries must be an int in 0\.\.67108864, got -1"):
        EntryMajorArena(fields, -1, CPU, slot_stride=STRIDE)
    with pytest.raises(ValueError, match="needs at least"):
        EntryMajorArena(fields, 2, CPU, buf=torch.zeros(eb, dtype=torch.uint8), slot_stride=STRIDE)
    host = torch.zeros(4 * eb, dtype=torch.uint8)
    with pytest.raises(ValueError, match="storage offset 256"):
        EntryMajorArena(fields, 2, CPU, buf=host[256:], slot_stride=STRIDE)
    with pytest.raises(ValueError, match="uint8"):
        EntryMajorArena(
            fields, 2, CPU, buf=torch.zeros(4 * eb, dtype=torch.int32), slot_stride=STRIDE
        )
    with pytest.raises(ValueError, match="meta"):
        EntryMajorArena(fields, 2, "meta", buf=host, slot_stride=STRIDE)
    arena = EntryMajorArena(fields, 2, CPU, slot_stride=STRIDE)
    for bad in (-1, 2, 1.0):
        with pytest.raises(IndexError):
            arena.entry(bad)
    with pytest.raises(KeyError, match=r"\['conv', 'ssm', 'score'\]"):
        arena.view("nope")
    with pytest.raises(KeyError, match="nope"):
        arena.field_offset("nope")


def test_no_fields_and_zero_entries_are_legal():
    empty = EntryMajorArena([], 3, CPU)
    assert (empty.entry_bytes, empty.total_bytes, empty.entry(2).numel()) == (0, 0, 0)
    none = EntryMajorArena(_gdn_fields(), 0, CPU, slot_stride=STRIDE)
    assert none.total_bytes == 0 and none.view("ssm").shape == (3, 0, 4, 8, 8)


def test_split_arena_routes_and_refuses():
    fields = _gdn_fields()
    a = EntryMajorArena(fields[:1], 3, CPU)
    b = EntryMajorArena(fields[1:], 3, CPU, slot_stride=4096)
    split = SplitEntryMajorArena([a, b])
    assert split.entry_bytes == a.entry_bytes + b.entry_bytes
    assert split.view("ssm").data_ptr() == b.view("ssm").data_ptr()
    assert split.field_offset("score") == b.field_offset("score")
    assert split.plane_of("conv") == 0 and split.entries == 3
    assert not hasattr(split, "entry")
    with pytest.raises(ValueError, match="no planes"):
        SplitEntryMajorArena([])
    with pytest.raises(ValueError, match="'conv' is in plane 0 and plane 1"):
        SplitEntryMajorArena([a, EntryMajorArena(fields[:1], 3, CPU)])
    with pytest.raises(ValueError, match="2 entries"):
        SplitEntryMajorArena([a, EntryMajorArena(fields[1:], 2, CPU, slot_stride=4096)])
    with pytest.raises(KeyError, match="'conv', 'ssm', 'score'"):
        split.view("k")


@given(field_lists(min_size=1, max_size=5), st.integers(0, 4), st.integers(0, 2**31))
def test_layer_major_addresses_and_fills(fields, entries, seed):
    names = {f.name for f in fields}
    arena = LayerMajorArena(fields, entries, CPU)
    assert arena.total_bytes == entry_bytes_for(fields) * entries == arena.buf.numel()
    for ext in field_extents(fields):
        f = ext.field
        assert arena.field_offset(f.name) == ext.start * entries
        view = arena.view(f.name)
        check_view_addresses(
            view, f, ext.start * entries, f.bytes_per_layer * entries, f.bytes_per_layer, entries
        )
        if view.numel():
            assert view[0].is_contiguous()  # each layer contiguous
        assert tensor_bytes(view) == expected_fill_bytes(f) * entries
    # Writing through one view never touches another field's bytes.
    gen = torch.Generator().manual_seed(seed)
    snapshot = {n: tensor_bytes(arena.view(n)) for n in names}
    victim = fields[0].name
    random_fill_(arena.view(victim), gen)
    for n in names - {victim}:
        assert tensor_bytes(arena.view(n)) == snapshot[n]


def test_layer_major_over_a_caller_buffer_is_never_written():
    fields = [
        EntryField("k", 2, (4, 8), torch.bfloat16),
        EntryField("v", 2, (4, 8), torch.bfloat16),
    ]
    need = entry_bytes_for(fields) * 5
    host = torch.randint(0, 256, (512 + need + 256,), dtype=torch.uint8)
    before = host.clone()
    arena = LayerMajorArena(fields, 5, CPU, buf=host[512 : 512 + need])
    assert torch.equal(host, before)
    check_view_addresses(arena.view("v"), fields[1], 512 + 256 * 5, 64 * 5, 64, 5)
    scored = [*fields, EntryField("score", 1, (4,), torch.float32, fill=-math.inf)]
    with pytest.raises(ValueError, match=r"\['score'\] declare a non-zero fill"):
        LayerMajorArena(scored, 5, CPU, buf=torch.zeros(10**5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no fields"):
        LayerMajorArena([], 5, CPU)
    with pytest.raises(ValueError, match="duplicate"):
        LayerMajorArena([fields[0], fields[0]], 5, CPU)
    assert not hasattr(arena, "entry")


def test_carve_layer_major_places_groups_by_plan_regions():
    g1 = [EntryField("k", 2, (3,), torch.float32)]
    g2 = [EntryField("v", 1, (5,), torch.bfloat16)]
    entries = 7
    sizes = [entry_bytes_for(g) * entries for g in (g1, [], g2)]
    offsets, total = plan_regions(sizes)
    host = torch.zeros(256 + total, dtype=torch.uint8)
    arenas = carve_layer_major([g1, [], g2], entries, CPU, buf=host[256:])
    assert arenas[1] is None
    assert arenas[0].buf.storage_offset() == 256 + offsets[0]
    assert arenas[2].buf.storage_offset() == 256 + offsets[2]
    assert arenas[2].view("v").storage_offset() * 2 == 256 + offsets[2]
    owned = carve_layer_major([g1, g2], entries, CPU)
    assert owned[0].buf.data_ptr() != owned[1].buf.data_ptr()
    with pytest.raises(ValueError, match="need"):
        carve_layer_major([g1, g2], entries, CPU, buf=torch.zeros(16, dtype=torch.uint8))


@given(field_lists(max_size=5), st.integers(1, 3))
def test_min_slot_stride_is_the_smallest_legal_stride(fields, entries):
    from kvarena import layout_fingerprint
    from kvarena.layout import min_slot_stride

    stride = min_slot_stride(fields)
    eb, align = entry_bytes_for(fields), strictest_alignment(fields)
    assert stride == align_up(eb, align) and stride % align == 0 and stride >= eb
    arena = EntryMajorArena(fields, entries, CPU, slot_stride=stride)
    assert arena.fingerprint == layout_fingerprint(fields)
    for ext in field_extents(fields):
        # Every field start stays on its alignment in every slot.
        assert all(
            (i * stride + ext.start) % ext.field.start_alignment == 0 for i in range(entries)
        )
    smaller = stride - align  # the next multiple of the alignment down is too short
    assert smaller < eb or eb == 0
    if eb:
        with pytest.raises(ValueError, match="below the entry size"):
            EntryMajorArena(fields, entries, CPU, slot_stride=smaller)


@given(fields=field_lists(min_size=1, max_size=4), entries=st.integers(1, 4))
def test_owned_buffers_align_every_field_absolutely(fields, entries):
    # Kernels and DMA engines see addresses: align=1024 means a 1024-aligned address.
    arenas = [EntryMajorArena(fields, entries, CPU, slot_stride=min_slot_stride(fields))]
    arenas.append(LayerMajorArena(fields, entries, CPU))
    for arena in arenas:
        assert arena.buf.storage_offset() == 0
        for f in fields:
            v = arena.view(f.name)
            if v.numel():
                assert v.data_ptr() % f.start_alignment == 0, (type(arena).__name__, f)
