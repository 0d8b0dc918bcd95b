import itertools
import math
import subprocess
import sys

import pytest
import torch
from conftest import field_lists
from hypothesis import given

from kvarena import EntryField, describe, layout_fingerprint
from kvarena.layout import (
    ALIGNMENT,
    align_up,
    checkpoint_ranges_for,
    entry_bytes_for,
    field_extents,
    layout_encoding,
    layout_rows,
)

BF16 = torch.bfloat16


def test_bytes_per_entry_is_layers_times_shape_times_itemsize():
    f = EntryField("ssm", 36, (32, 128, 128), BF16)
    assert f.per_layer_numel == 32 * 128 * 128
    assert f.bytes_per_entry == 36 * 32 * 128 * 128 * 2
    assert EntryField("s", 3, (), torch.float32).bytes_per_entry == 12  # scalar per layer
    assert EntryField("z", 0, (5,), torch.float32).bytes_per_entry == 0


def test_walk_by_hand():
    fields = [
        EntryField("a", 1, (10,), torch.uint8),  # [0, 10)
        EntryField("b", 2, (3,), torch.float32),  # [256, 280)
        EntryField("c", 1, (1,), torch.uint8, align=1024),  # [1024, 1025)
        EntryField("d", 0, (7,), torch.float32),  # [1280, 1280)
    ]
    got = [(e.field.name, e.start, e.end) for e in field_extents(fields)]
    assert got == [("a", 0, 10), ("b", 256, 280), ("c", 1024, 1025), ("d", 1280, 1280)]
    assert entry_bytes_for(fields) == 1280
    assert entry_bytes_for([]) == 0


@given(field_lists())
def test_walk_properties(fields):
    extents = field_extents(fields)
    running = 0
    for ext in extents:
        f = ext.field
        assert ext.start == align_up(running, max(ALIGNMENT, f.align))
        assert ext.end - ext.start == f.bytes_per_entry
        running = ext.end
    eb = entry_bytes_for(fields)
    assert eb == (align_up(extents[-1].end) if extents else 0)
    assert eb % ALIGNMENT == 0
    # Fields never overlap and all lie inside the entry.
    for a, b in itertools.pairwise(extents):
        assert a.end <= b.start
    assert all(e.end <= eb for e in extents)


def test_checkpoint_ranges_by_hand():
    f = [
        EntryField("a", 1, (10,), torch.uint8),  # [0, 10)
        EntryField("b", 1, (300,), torch.uint8),  # [256, 556)
        EntryField("x", 1, (4,), torch.uint8, in_checkpoint=False),  # [768, 772)
        EntryField("c", 1, (4,), torch.uint8),  # [1024, 1028)
        EntryField("y", 0, (4,), torch.uint8, in_checkpoint=False),  # breaks, 0 bytes
        EntryField("z", 0, (4,), torch.uint8),  # zero-length run -> dropped
    ]
    assert checkpoint_ranges_for(f) == [(0, 556), (1024, 4)]
    assert checkpoint_ranges_for([]) == []


@given(field_lists())
def test_checkpoint_ranges_cover_carried_bytes_only(fields):
    ranges = checkpoint_ranges_for(fields)
    covered = set()
    for off, n in ranges:
        assert n > 0
        covered.update(range(off, off + n))
    for ext in field_extents(fields):
        span = set(range(ext.start, ext.end))
        if ext.field.in_checkpoint:
            assert span <= covered
        else:
            assert not span & covered
    # Ranges are ordered, disjoint and maximal: two ranges never touch.
    for (o1, n1), (o2, _) in itertools.pairwise(ranges):
        assert o1 + n1 < o2 or any(
            not e.field.in_checkpoint and o1 + n1 <= e.start <= o2 for e in field_extents(fields)
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": ""}, "non-empty"),
        ({"layers": -1}, "layers"),
        ({"layers": 2.0}, "layers"),
        ({"shape": (3, -2)}, "-2"),
        ({"shape": 5}, "sequence"),
        ({"dtype": "bfloat16"}, "torch.dtype"),
        ({"dtype": torch.int4}, "whole-byte"),
        ({"dtype": torch.uint8, "fill": -1}, r"\[0, 255\]"),
        ({"dtype": torch.int32, "fill": float("inf")}, "integer dtype"),
        ({"dtype": torch.int32, "fill": float("nan")}, "integer dtype"),
        ({"dtype": torch.int32, "fill": 0.5}, "integral"),
        ({"dtype": torch.float16, "fill": 1e6}, "65504"),
        ({"dtype": torch.float8_e4m3fn, "fill": float("-inf")}, "no -inf"),
        ({"dtype": torch.bool, "fill": 2}, "0/1"),
        ({"fill": "x"}, "real number"),
        ({"align": 100}, "multiple of 256"),
        ({"align": -256}, "align must be an int in 0..[0-9]+, got -256"),
        ({"in_checkpoint": 1}, "bool"),
    ],
)
def test_field_refusals_name_the_value(kwargs, match):
    args = {"name": "f", "layers": 1, "shape": (4,), "dtype": torch.float32} | kwargs
    with pytest.raises(ValueError, match=match):
        EntryField(**args)


def test_fill_normalised_and_accepted():
    assert EntryField("s", 1, (2,), torch.float32, fill=-math.inf).fill == -math.inf
    assert EntryField("i", 1, (2,), torch.int32, fill=3.0).fill == 3
    assert isinstance(EntryField("i", 1, (2,), torch.int32, fill=3.0).fill, int)
    assert EntryField("b", 1, (2,), BF16, fill=0) == EntryField("b", 1, (2,), BF16, fill=0.0)
    assert EntryField("n", 1, (2,), torch.float32, fill=math.nan).fill != 0
    assert EntryField("l", 1, [2, 3], BF16).shape == (2, 3)  # lists become tuples


def _qwen_like():
    return [
        EntryField("conv_state", 36, (3, 8192), BF16),
        EntryField("ssm_state", 36, (32, 128, 128), BF16),
        EntryField("score", 2, (8, 1024), torch.float32, fill=-math.inf, in_checkpoint=False),
    ]


def test_fingerprint_is_stable_across_processes():
    here = layout_fingerprint(_qwen_like())
    code = (
        "import math, torch, kvarena as k;"
        "B=torch.bfloat16;"
        "print(k.layout_fingerprint(["
        "k.EntryField('conv_state',36,(3,8192),B),"
        "k.EntryField('ssm_state',36,(32,128,128),B),"
        "k.EntryField('score',2,(8,1024),torch.float32,fill=-math.inf,in_checkpoint=False)]))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert here == there
    # Pinned: a fingerprint that changes between versions makes two peers refuse each
    # other; if the encoding must change, bump its format name and this value together.
    assert here == "b94f82047b5d2c96dc049bef1d15d3be066c885eaee609da37211a989efb5690"


def test_fingerprint_encoding_is_documented_json():
    enc = layout_encoding(_qwen_like()).decode()
    assert enc.startswith('{"alignment":256,"entry_bytes":')
    assert '"fill":"float:-inf"' in enc and '"dtype":"bfloat16"' in enc
    assert '"start":1769472' in enc


@pytest.mark.parametrize(
    "change",
    [
        lambda f: [*f[:2], EntryField("score", 2, (8, 1024), torch.float32, fill=-math.inf)],
        lambda f: [*f[:2], EntryField("score", 2, (8, 1024), torch.float32, in_checkpoint=False)],
        lambda f: [*f[:2], EntryField("score", 2, (8, 1024), torch.float32, fill=-0.0)],
        lambda f: [f[1], f[0], f[2]],
        lambda f: [*f[:2], EntryField("score", 2, (8, 1024), torch.int32, in_checkpoint=False)],
        lambda f: [f[0], EntryField("ssm_state", 36, (32, 128, 128), BF16, align=4096), f[2]],
        lambda f: [EntryField("conv", 36, (3, 8192), BF16), *f[1:]],
    ],
)
def test_fingerprint_sees_every_declared_difference(change):
    base = _qwen_like()
    assert layout_fingerprint(change(base)) != layout_fingerprint(base)


def test_describe_lists_offsets_padding_and_total():
    fields = [
        EntryField("k", 2, (3,), torch.float32),
        EntryField("v", 1, (5,), torch.uint8, in_checkpoint=False),
    ]
    rows, tail, eb = layout_rows(fields)
    assert [(r.name, r.start, r.nbytes, r.pad_before, r.in_checkpoint) for r in rows] == [
        ("k", 0, 24, 0, True),
        ("v", 256, 5, 232, False),
    ]
    assert (tail, eb) == (251, 512)
    text = describe(fields)
    assert "entry: 512 bytes (29 field bytes, 483 padding, 251 of it at the tail)" in text
    assert text.splitlines()[2].split()[:2] == ["k", "float32"]
