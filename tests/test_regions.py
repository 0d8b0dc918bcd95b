import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvarena.layout import ALIGNMENT, align_up, carve, plan_regions

sizes_st = st.lists(st.integers(0, 5000), max_size=8)


@pytest.mark.parametrize(
    ("n", "to", "want"), [(0, 256, 0), (1, 256, 256), (256, 256, 256), (257, 256, 512), (5, 4, 8)]
)
def test_align_up_cases(n, to, want):
    assert align_up(n, to) == want


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 12))
def test_align_up_is_least_multiple_not_below(n, to):
    r = align_up(n, to)
    assert r % to == 0 and n <= r < n + to


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_align_up_refuses(bad):
    with pytest.raises(ValueError, match="align_up"):
        align_up(bad)
    with pytest.raises(ValueError, match="'to'"):
        align_up(3, 0)


def test_plan_regions_by_hand():
    assert plan_regions([]) == ([], 0)
    assert plan_regions([10, 0, 300, 256]) == ([0, 256, 256, 768], 1024)


@given(sizes_st)
def test_plan_regions_packs_aligned_and_disjoint(sizes):
    offsets, total = plan_regions(sizes)
    assert len(offsets) == len(sizes)
    assert total % ALIGNMENT == 0
    end = 0
    for off, size in zip(offsets, sizes, strict=True):
        assert off % ALIGNMENT == 0
        assert off == align_up(end)  # back to back: the least aligned offset
        end = off + size
    assert total == align_up(end)


@given(sizes_st, sizes_st)
def test_plan_regions_concatenates(a, b):
    oa, ta = plan_regions(a)
    ob, tb = plan_regions(b)
    oc, tc = plan_regions(a + b)
    assert oc == oa + [o + ta for o in ob]
    assert tc == ta + tb


def test_plan_regions_refuses_negative():
    with pytest.raises(ValueError, match=r"sizes\[1\].*-3"):
        plan_regions([4, -3])


@given(sizes_st, st.integers(0, 3))
def test_carve_slices_at_planned_addresses(sizes, lead):
    offsets, total = plan_regions(sizes)
    host = torch.zeros(lead * ALIGNMENT + total + 16, dtype=torch.uint8)
    buf = host[lead * ALIGNMENT :]
    parts = carve(buf, sizes)
    for part, off, size in zip(parts, offsets, sizes, strict=True):
        assert part.numel() == size
        assert part.storage_offset() == buf.storage_offset() + off
        if size:  # torch reports data_ptr 0 for an empty tensor
            assert part.data_ptr() == buf.data_ptr() + off


def test_carve_none_and_short():
    assert carve(None, [3, 4]) == [None, None]
    with pytest.raises(ValueError, match="512 bytes"):
        carve(torch.zeros(300, dtype=torch.uint8), [10, 10])
    with pytest.raises(ValueError, match="uint8"):
        carve(torch.zeros(1024, dtype=torch.float32), [10])
