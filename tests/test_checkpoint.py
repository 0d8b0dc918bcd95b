import math

import pytest
import torch
from conftest import field_lists, random_fill_, tensor_bytes
from hypothesis import given
from hypothesis import strategies as st

from kvarena import EntryField, LayoutMismatchError
from kvarena.checkpoint import CheckpointMismatchError, CheckpointSpec, PageUnits, restore, store
from kvarena.layout import EntryMajorArena, field_extents, min_slot_stride

CPU = torch.device("cpu")


def _arena(fields, entries, seed=None):
    arena = EntryMajorArena(fields, entries, CPU, slot_stride=min_slot_stride(fields))
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for f in fields:
            random_fill_(arena.view(f.name), gen)
    return arena


@given(
    field_lists(min_size=1, max_size=5),
    st.sampled_from([256, 1000, 4096]),
    st.integers(1, 5),
    st.integers(0, 2**31),
)
def test_store_restore_round_trip(fields, unit_bytes, batch, seed):
    spec = CheckpointSpec.build(fields, unit_bytes)
    assert spec.units_per_image == math.ceil(spec.image_bytes / unit_bytes)
    src = _arena(fields, batch + 1, seed)
    n_units = max(1, 2 * batch * spec.units_per_image)
    stride = unit_bytes + 256
    pages = PageUnits(
        buf=torch.full((n_units * stride,), 0xA5, dtype=torch.uint8),
        unit_bytes=unit_bytes,
        unit_stride=stride,
        num_units=n_units,
    )
    perm = torch.randperm(n_units, generator=torch.Generator().manual_seed(seed)).tolist()
    units = [perm[c * spec.units_per_image : (c + 1) * spec.units_per_image] for c in range(batch)]
    store(spec, src, list(range(batch)), pages, units)
    # Bytes outside the image's units stay untouched.
    used = torch.zeros(pages.buf.numel(), dtype=torch.bool)
    left = [spec.image_bytes] * batch
    for c, us in enumerate(units):
        for u in us:
            k = min(unit_bytes, left[c])
            used[u * stride : u * stride + k] = True
            left[c] -= k
    assert (pages.buf[~used] == 0xA5).all()
    # Restore into other slots of a fresh arena whose dropped fields hold a pattern.
    dst = _arena(fields, batch + 1, seed + 1)
    before = {f.name: dst.view(f.name).clone() for f in fields}
    restore(spec, dst, [c + 1 for c in range(batch)], pages, units)
    for f in fields:
        for c in range(batch):
            got = tensor_bytes(dst.view(f.name)[:, c + 1])
            if f.in_checkpoint:
                assert got == tensor_bytes(src.view(f.name)[:, c])
            else:  # dropped fields are neither stored nor overwritten
                assert got == tensor_bytes(before[f.name][:, c + 1])
        assert tensor_bytes(dst.view(f.name)[:, 0]) == tensor_bytes(before[f.name][:, 0])


def test_image_is_the_checkpoint_ranges_back_to_back():
    fields = [
        EntryField("a", 1, (300,), torch.uint8),
        EntryField("skip", 1, (64,), torch.uint8, in_checkpoint=False),
        EntryField("b", 2, (100,), torch.uint8),
    ]
    spec = CheckpointSpec.build(fields, 256)
    assert (
        spec.ranges == ((0, 300), (768, 200))
        and spec.image_bytes == 500
        and spec.units_per_image == 2
    )
    arena = _arena(fields, 1, seed=3)
    pages = PageUnits(
        buf=torch.zeros(1024, dtype=torch.uint8), unit_bytes=256, unit_stride=256, num_units=4
    )
    store(spec, arena, [0], pages, [[3, 1]])
    entry = arena.entry(0)
    image = torch.cat([entry[0:300], entry[768:968]])
    assert torch.equal(pages.buf[768:1024], image[:256])
    assert torch.equal(pages.buf[256:500], image[256:])
    ext = {e.field.name: e for e in field_extents(fields)}
    assert ext["b"].start == 768


def test_refusals_before_any_byte_moves():
    fields = [
        EntryField("s", 2, (64,), torch.float32),
        EntryField("t", 1, (8,), torch.float32, fill=-math.inf),
    ]
    spec = CheckpointSpec.build(fields, 256)
    arena = _arena(fields, 4, seed=1)
    pages = PageUnits(
        buf=torch.zeros(8 * 256, dtype=torch.uint8), unit_bytes=256, unit_stride=256, num_units=8
    )
    ok_units = [list(range(spec.units_per_image))]
    other = _arena([EntryField("s", 2, (64,), torch.bfloat16)], 4)
    with pytest.raises(LayoutMismatchError, match="fingerprint"):
        store(spec, other, [0], pages, ok_units)
    with pytest.raises(CheckpointMismatchError, match="an image takes 3"):
        store(spec, arena, [0], pages, [[0]])
    with pytest.raises(ValueError, match=r"unit_lists\[0\]: id 8 is out of range; legal: 0\.\.7"):
        store(spec, arena, [0], pages, [[0, 1, 8]])
    with pytest.raises(CheckpointMismatchError, match="2 slots but 1 unit lists"):
        store(spec, arena, [0, 1], pages, ok_units)
    partly = EntryMajorArena(fields, 4, CPU, live_entries=2)
    with pytest.raises(ValueError, match=r"id 1 is out of range; legal: 2\.\.3"):
        store(spec, partly, [1], pages, ok_units)
    with pytest.raises(ValueError, match="overlap"):
        store(spec, arena, [0, 1], pages, [[0, 1, 2], [2, 3, 4]])
    assert not pages.buf.any()
    with pytest.raises(ValueError, match=r"unit_bytes must be an int in 1\.\."):
        CheckpointSpec.build(fields, 0)
