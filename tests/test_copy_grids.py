"""Grids a caller knows (``kvarena.copy.grid_copy``), checked by the rule every batch passes.

The grids' check must accept exactly what :func:`validate_batch` accepts for
the same rows (one rule, two representations), and what it accepts must land
byte for byte as the rows say, nothing else written.
"""

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarena.copy import CopyBatch, CopyBoundsError, execute_grids, validate, validate_batch
from kvarena.copy.validate import checked_grids
from kvarena.errors import Error

SIZE = 4096


def rows_of(grids):
    """Every row of ``grids`` by hand: (src, dst, length), family by family."""
    out = []
    for s0, d0, count, n, ss, ds, outer, os_, od in grids:
        for k in range(outer):
            for c in range(count):
                out.append((s0 + k * os_ + c * ss, d0 + k * od + c * ds, n))
    return out


grid = st.tuples(
    st.integers(0, SIZE),  # src
    st.integers(0, SIZE),  # dst
    st.integers(0, 5),  # count
    st.sampled_from([0, 8, 16, 24, 64, 100]),  # length
    st.integers(0, 300),  # src step
    st.integers(0, 300),  # dst step
    st.integers(0, 4),  # outer
    st.integers(0, 900),  # outer src step
    st.integers(0, 900),  # outer dst step
)


@settings(max_examples=300, deadline=None)
@given(
    grids=st.lists(grid, max_size=4),
    same=st.booleans(),
    shift=st.sampled_from([0, 8]),
    numpy_check=st.booleans(),
)
def test_grids_are_accepted_exactly_where_their_rows_are_and_land_byte_for_byte(
    grids, same, shift, numpy_check
):
    """Random grids (overlapping, out of bounds or fine), between two buffers or
    within one storage: refused exactly where the rows as a batch are, writing
    nothing then; else every row lands and nothing else changes. The checks
    on Python ints (a few ranges) and with numpy (many) alike."""
    rows = rows_of(grids)
    batch = CopyBatch(
        np.array([r[0] for r in rows], dtype=np.int64),
        np.array([r[1] for r in rows], dtype=np.int64),
        np.array([r[2] for r in rows], dtype=np.int64),
    )
    rng = np.random.default_rng(len(rows))
    storage = torch.from_numpy(rng.integers(0, 256, 3 * SIZE, dtype=np.uint8))
    if same:
        src, dst = storage[shift : shift + SIZE + 600], storage[SIZE : 2 * SIZE + 600]
    else:
        src = storage[shift : shift + SIZE + 600]
        dst = torch.from_numpy(rng.integers(0, 256, SIZE + 600, dtype=np.uint8))
    before = storage.clone(), dst.clone()
    try:
        validate_batch(batch, src, dst)
        legal = True
    except CopyBoundsError:
        legal = False
    in_python = 0 if numpy_check else validate.RANGES_IN_PYTHON
    if not legal:
        with mock.patch.object(validate, "RANGES_IN_PYTHON", in_python):
            with pytest.raises(CopyBoundsError):
                execute_grids(grids, src, dst)
        assert torch.equal(storage, before[0]) and torch.equal(dst, before[1])
        return
    expect = dst.clone()
    source = src.clone()  # rows never read what they write: the source as it was
    for s, d, n in rows:
        expect[d : d + n] = source[s : s + n]
    with mock.patch.object(validate, "RANGES_IN_PYTHON", in_python):
        stats = execute_grids(grids, src, dst)
    assert torch.equal(dst, expect)
    assert stats.nbytes == sum(r[2] for r in rows)
    if not same:
        assert torch.equal(storage, before[0])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ((0, 0, 2, 8, 8, -8, 1, 0, 0), "non-negative"),
        ((0, 0, 2, 8, 8, 8.0, 1, 0, 0), "non-negative integers"),
        ((0, 4090, 1, 8, 0, 0, 1, 0, 0), "destination rows reach byte 4098"),
        ((0, 0, 3, 8, 8, 4, 1, 0, 0), "overlap"),
        ((0, 0, 2, 8, 8, 8, 2, 0, 8), "overlap"),
    ],
)
def test_a_bad_grid_is_refused_with_its_numbers_and_nothing_moves(bad, match):
    src = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    ok = (512, 1024, 2, 16, 16, 32, 1, 0, 0)
    with pytest.raises(Error, match=match):
        execute_grids([ok, bad], src, dst)
    assert not dst.any()
    assert checked_grids([ok], src, dst) == 32


def test_grids_of_two_devices_or_wider_buffers_are_refused():
    src = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(Error, match=r"uint8|byte"):
        execute_grids([(0, 0, 1, 8, 0, 0, 1, 0, 0)], src.view(torch.int64), src)
    with pytest.raises(Error, match="one device"):
        execute_grids(
            [(0, 0, 1, 8, 0, 0, 1, 0, 0)], src, torch.zeros(64, dtype=torch.uint8, device="meta")
        )


def test_one_call_a_grid_and_words_as_wide_as_every_number_allows(monkeypatch):
    """A grid is one copy call whatever its rows; rows at odd offsets still land."""
    import kvarena.copy.grid_copy as grid_copy

    calls = []
    real = grid_copy.copy_grid
    monkeypatch.setattr(
        grid_copy, "copy_grid", lambda words, *g: calls.append(words.size) or real(words, *g)
    )
    src = torch.from_numpy(np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8))
    dst = torch.zeros(8192, dtype=torch.uint8)
    stats = execute_grids(
        [(0, 0, 6, 64, 64, 128, 4, 384, 1024), (3000, 5003, 3, 5, 7, 9, 1, 0, 0)], src, dst
    )
    assert stats.ops == 2 and stats.spans == 27 and calls == [1, 1]
    for s, d, n in rows_of(
        [(0, 0, 6, 64, 64, 128, 4, 384, 1024), (3000, 5003, 3, 5, 7, 9, 1, 0, 0)]
    ):
        assert torch.equal(dst[d : d + n], src[s : s + n])
    calls.clear()
    execute_grids([(0, 0, 6, 64, 64, 128, 4, 384, 1024)], src, dst)
    assert calls == [8]
