import os
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvarena.copy import (
    CopyBatch,
    CopyBoundsError,
    CopyStats,
    describe_batch,
    execute_batch,
    executor,
    plan_segmented_copy,
    thresholds,
)
from kvarena.copy.executor import triton_available
from kvarena.copy.thresholds import PROGRESSION_MIN_BYTES
from kvarena.spans import coalesce, progressions

# The Triton path runs here only under its interpreter (TRITON_INTERPRET=1);
# on a GPU machine it runs for real in tests/test_gpu.py.
PATHS = ["cpu", "torch"] + (
    ["triton"] if triton_available() and os.environ.get("TRITON_INTERPRET") == "1" else []
)


def _gathering(
    batch: CopyBatch, src_buf: torch.Tensor, dst_buf: torch.Tensor, **kwargs
) -> tuple[CopyStats, int]:
    """``execute_batch``'s stats and how many gathers it issued."""
    with mock.patch.object(executor, "_copy_gather", wraps=executor._copy_gather) as gather:
        stats = execute_batch(batch, src_buf, dst_buf, **kwargs)
    return stats, gather.call_count


def _spans_written(
    target: torch.Tensor,
    source: torch.Tensor,
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray | int,
    shift: int = 0,
) -> torch.Tensor:
    """``target`` as a batch should leave it: a copy with each span's bytes of
    ``source`` written at ``shift + dst``, one span at a time (the reference the
    executor's roads are checked against)."""
    out = target.clone()
    lengths = np.broadcast_to(length, np.shape(src))
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        out[shift + d : shift + d + n] = source[s : s + n]
    return out


def test_plan_by_hand():
    p = plan_segmented_copy([5, 7], [3, 4, 5], 12)
    rows = list(
        zip(p.src_segment, p.src_offset, p.dst_segment, p.dst_offset, p.length, strict=True)
    )
    assert [tuple(int(x) for x in r) for r in rows] == [
        (0, 0, 0, 0, 3),
        (0, 3, 1, 0, 2),
        (1, 0, 1, 2, 2),
        (1, 2, 2, 0, 5),
    ]
    assert plan_segmented_copy([5, 7], [3, 4, 5], 4).length.tolist() == [3, 1]
    assert plan_segmented_copy([5], [5], 0).num_spans == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([5], [5], -1), "total_bytes must be an int in 0..[0-9]+, got -1"),
        (([5, 0], [5], 5), r"src_sizes\[1\]"),
        (([5], [2, -1], 1), r"dst_sizes\[1\]"),
        (([5], [9], 6), "source stream holds 5 bytes but 6"),
        (([9], [5], 6), "destination stream holds 5 bytes"),
    ],
)
def test_plan_refusals(args, match):
    with pytest.raises(ValueError, match=match):
        plan_segmented_copy(*args)


sizes = st.lists(st.integers(1, 300), min_size=1, max_size=8)


@given(sizes, sizes, st.data())
def test_plan_covers_total_in_order_within_segments(src, dst, data):
    total = data.draw(st.integers(0, min(sum(src), sum(dst))))
    p = plan_segmented_copy(src, dst, total)
    assert int(p.length.sum()) == total and (p.length > 0).all()
    src_starts = np.concatenate(([0], np.cumsum(src)[:-1]))
    dst_starts = np.concatenate(([0], np.cumsum(dst)[:-1]))
    pos = 0
    for i in range(p.num_spans):
        s, so, d, do, n = (
            int(a[i]) for a in (p.src_segment, p.src_offset, p.dst_segment, p.dst_offset, p.length)
        )
        assert src_starts[s] + so == pos == dst_starts[d] + do  # in stream order
        assert so + n <= src[s] and do + n <= dst[d]  # never crosses a segment
        pos += n
    r = p.reversed()
    assert r.src_sizes == p.dst_sizes and (r.src_offset == p.dst_offset).all()


def test_describe_batch_and_refusals():
    p = plan_segmented_copy([5, 7], [3, 4, 5], 12)
    b = describe_batch(p, [[0, 100], [1000, 2000]], [[0, 10, 20], [50, 60, 70]])
    assert b.src.tolist() == [0, 3, 100, 102, 1000, 1003, 2000, 2002]
    assert b.dst.tolist() == [0, 10, 12, 20, 50, 60, 62, 70]
    assert b.length.tolist() == [3, 2, 2, 5] * 2
    with pytest.raises(ValueError, match="2 source copies but 1 destination"):
        describe_batch(p, [[0, 100], [1000, 2000]], [[0, 10, 20]])
    with pytest.raises(ValueError, match=r"shape \[copies, 3\]"):
        describe_batch(p, [[0, 100]], [[0, 10]])
    with pytest.raises(ValueError, match="negative"):
        describe_batch(p, [[0, -1]], [[0, 10, 20]])


@given(
    st.lists(st.integers(1, 200), min_size=1, max_size=6),
    st.lists(st.integers(1, 200), min_size=1, max_size=6),
    st.integers(1, 40),
    st.integers(0, 2**31),
    st.sampled_from([64, 1 << 16]),
    st.sampled_from(PATHS),
    st.sampled_from([0, 1 << 18]),
)
def test_execute_round_trip_and_sentinels(
    src_sizes, dst_sizes, copies, seed, large, path, progression
):
    total = min(sum(src_sizes), sum(dst_sizes))
    plan = plan_segmented_copy(src_sizes, dst_sizes, total)
    rng = np.random.default_rng(seed)
    # Each copy's segments scattered at random, disjoint slots of 256 bytes.
    src_slots = rng.permutation(copies * len(src_sizes)).reshape(copies, -1) * 256
    dst_slots = rng.permutation(copies * len(dst_sizes)).reshape(copies, -1) * 256
    src_buf = torch.from_numpy(rng.integers(0, 256, copies * len(src_sizes) * 256, dtype=np.uint8))
    dst_buf = torch.full((copies * len(dst_sizes) * 256,), 0xA5, dtype=torch.uint8)
    batch = describe_batch(plan, src_slots, dst_slots)
    stats = execute_batch(
        batch,
        src_buf,
        dst_buf,
        large_span_bytes=large,
        progression_min_bytes=progression,
        torch_span_bytes=large,
        path=path,
    )
    assert stats.nbytes == copies * total and stats.path == path
    assert stats.ops <= 2 * batch.num_spans  # never per layer or field: at most 2 per span
    written = np.zeros(dst_buf.numel(), dtype=bool)
    for c in range(copies):
        stream = b"".join(
            src_buf[int(b) : int(b) + n].numpy().tobytes()
            for b, n in zip(src_slots[c], src_sizes, strict=True)
        )[:total]
        got = b""
        left = total
        for b, n in zip(dst_slots[c], dst_sizes, strict=True):
            k = min(n, left)
            got += dst_buf[int(b) : int(b) + k].numpy().tobytes()
            written[int(b) : int(b) + k] = True
            left -= k
        assert got == stream
    assert (dst_buf.numpy()[~written] == 0xA5).all()
    # Restore with the same plan, reversed, into a fresh source-shaped buffer.
    back = torch.zeros_like(src_buf)
    execute_batch(
        describe_batch(plan.reversed(), dst_slots, src_slots),
        dst_buf,
        back,
        progression_min_bytes=progression,
        path=path,
    )
    for c in range(copies):
        left = total
        for b, n in zip(src_slots[c], src_sizes, strict=True):
            k = min(n, left)
            assert torch.equal(back[int(b) : int(b) + k], src_buf[int(b) : int(b) + k])
            left -= k


def test_coalesce_merges_runs_continuing_on_both_sides():
    src = np.array([100, 0, 10, 30], dtype=np.int64)
    dst = np.array([600, 500, 510, 900], dtype=np.int64)
    n = np.array([5, 10, 20, 4], dtype=np.int64)
    s, d, k = coalesce(src, dst, n)
    # [0,10)->500 and [10,30)->510 join; [30,34)->900 breaks on the destination side.
    assert (s.tolist(), d.tolist(), k.tolist()) == ([0, 100, 30], [500, 600, 900], [30, 5, 4])
    src_buf = torch.from_numpy(np.arange(256, dtype=np.uint8))
    dst_buf = torch.zeros(1024, dtype=torch.uint8)
    stats = execute_batch(CopyBatch(src, dst, n), src_buf, dst_buf)
    assert stats.spans == 4 and stats.ops == 3  # one copy per coalesced run
    assert dst_buf[500:530].tolist() == list(range(30)) and dst_buf[520:525].tolist() == list(
        range(20, 25)
    )


def test_execute_refuses_before_writing():
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)

    def batch(s, d, n):
        return CopyBatch(
            np.array(s, dtype=np.int64), np.array(d, dtype=np.int64), np.array(n, dtype=np.int64)
        )

    with pytest.raises(CopyBoundsError, match=r"lengths up to 65.*\[0, 64\)"):
        execute_batch(batch([0, 0], [0, 16], [8, 65]), src, dst)
    with pytest.raises(CopyBoundsError, match=r"reach byte 72 .*\[0, 64\)"):
        execute_batch(batch([0, 60], [0, 16], [8, 12]), src, dst)
    # A length of 2**63 - 1 would wrap a start + length sum negative; it is refused.
    with pytest.raises(CopyBoundsError, match="lengths up to 9223372036854775807"):
        execute_batch(batch([1], [1], [2**63 - 1]), src, dst)
    with pytest.raises(ValueError, match="CopyBatch src must hold integers"):
        execute_batch(CopyBatch(np.array([0.5]), np.array([0]), np.array([8])), src, dst)
    with pytest.raises(CopyBoundsError, match="overlap"):
        execute_batch(batch([0, 8], [0, 4], [8, 8]), src, dst)
    with pytest.raises(CopyBoundsError, match=r"reads \[0, 8\) where it also writes \[4, 12\)"):
        execute_batch(batch([0], [4], [8]), src, src)
    with pytest.raises(CopyBoundsError, match=r"reads \[40, 48\) where it also writes \[32, 48\)"):
        execute_batch(batch([0, 40], [32, 50], [16, 8]), src, src)
    assert not dst.any()  # nothing written by any refused batch
    assert torch.equal(src, torch.arange(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        execute_batch(batch([0], [0], [4]), src.float(), dst)
    # Disjoint spans inside one storage are fine.
    execute_batch(batch([0], [32], [8]), src, src)
    assert src[32:40].tolist() == list(range(8))


@given(
    spans=st.lists(
        st.tuples(st.integers(0, 120), st.integers(0, 120), st.integers(0, 12)),
        min_size=1,
        max_size=12,
    )
)
def test_one_storage_batches_are_refused_exactly_when_they_race(spans):
    # Byte sets decide: a byte written twice, or a byte read that is written,
    # is a refusal (and nothing moves); anything else copies exactly.
    s, d, n = (np.array(c, dtype=np.int64) for c in zip(*spans, strict=True))
    written = [b for dd, nn in zip(d, n, strict=True) for b in range(dd, dd + nn)]
    read = {b for ss, nn in zip(s, n, strict=True) for b in range(ss, ss + nn)}
    races = len(written) != len(set(written)) or bool(read & set(written))
    buf = torch.arange(132, dtype=torch.uint8)
    before = buf.clone()
    if races:
        with pytest.raises(CopyBoundsError):
            execute_batch(CopyBatch(s, d, n), buf, buf)
        assert torch.equal(buf, before)
        return
    execute_batch(CopyBatch(s, d, n), buf, buf)
    expected = before.clone()
    for ss, dd, nn in zip(s, d, n, strict=True):
        expected[dd : dd + nn] = before[ss : ss + nn]
    assert torch.equal(buf, expected)


def test_a_gather_reading_above_a_buffer_that_starts_just_past_its_first_row():
    # One storage: the source buffer starts 100 bytes into the first row
    # written, and every row read lies far above. No span reads what another
    # writes, so the batch is legal; torch compares the first row of the
    # source VIEW with the first row written, so the view starts at the
    # lowest row read.
    length, n = 16384, 32
    buf = torch.from_numpy(
        np.random.default_rng(1).integers(0, 256, 4 * n * length, dtype=np.uint8)
    )
    before = buf.clone()
    src = 2 * n * length + np.random.default_rng(0).permutation(n).astype(np.int64) * length
    dst = np.arange(n, dtype=np.int64) * 2 * length
    _, gathers = _gathering(CopyBatch(src, dst, np.full(n, length)), buf[100:], buf)
    assert gathers == 1
    expect = _spans_written(before, before[100:], src, dst, length)
    assert torch.equal(buf, expect)


def test_one_source_read_twice_is_legal_in_one_storage():
    # One state stored into two images, or one image restored into two slots.
    buf = torch.arange(64, dtype=torch.uint8)
    src = np.array([0, 0], dtype=np.int64)
    stats = execute_batch(
        CopyBatch(src, np.array([16, 40], dtype=np.int64), np.array([8, 8], dtype=np.int64)),
        buf,
        buf,
    )
    assert stats.spans == 2
    assert buf[16:24].tolist() == buf[40:48].tolist() == list(range(8))


def test_describe_batch_takes_integer_offsets_only():
    plan = plan_segmented_copy([8], [8], 8)
    for bad in ([[2.9]], [["3"]], [[True]], np.array([[1.0]])):
        with pytest.raises(ValueError, match=r"\(byte offsets\) must hold integers"):
            describe_batch(plan, bad, [[0]])
    batch = describe_batch(plan, np.array([[np.int32(16)]]), torch.tensor([[24]]))
    assert batch.src.tolist() == [16] and batch.dst.tolist() == [24]
    with pytest.raises(ValueError, match="above"):
        describe_batch(plan, [[2**62]], [[0]])


@pytest.mark.parametrize("units_per_image", [1, 4, 7])
def test_short_spans_move_in_one_pass_when_adjacent_on_one_side(units_per_image):
    # A store: each image's bytes are contiguous at the source and land in
    # scattered units; a restore is the mirror. Both take the one-pass paths.
    unit, copies = 1024, 24
    image = unit * units_per_image - 100  # the last unit only partly used
    plan = plan_segmented_copy([image], [unit] * units_per_image, image)
    rng = np.random.default_rng(units_per_image)
    slots = (np.arange(copies) * (image + 300)).reshape(copies, 1).astype(np.int64)
    units = (
        rng.permutation(copies * units_per_image + 5)[: copies * units_per_image] * unit
    ).reshape(copies, -1)
    state = torch.from_numpy(rng.integers(0, 256, copies * (image + 300), dtype=np.uint8))
    pages = torch.full(((copies * units_per_image + 5) * unit,), 0xA5, dtype=torch.uint8)
    stats = execute_batch(describe_batch(plan, slots, units), state, pages, path="cpu")
    assert stats.ops <= max(1, -(-copies * units_per_image // 4)) + copies  # runs, not spans
    back = torch.full_like(state, 0x5A)
    execute_batch(describe_batch(plan.reversed(), units, slots), pages, back, path="cpu")
    written = np.zeros(back.numel(), dtype=bool)
    for c in range(copies):
        lo = int(slots[c, 0])
        assert torch.equal(back[lo : lo + image], state[lo : lo + image])
        written[lo : lo + image] = True
    assert (back.numpy()[~written] == 0x5A).all()


@pytest.mark.parametrize("same_storage", [False, True])
def test_large_batches_split_over_threads_move_exactly_the_spans(same_storage, monkeypatch):

    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # more shares than cores
    rng = np.random.default_rng(7)
    n = 48 << 20
    buf = torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
    # Disjoint destinations in the upper half, sources in the lower half: long spans
    # (one copy each) and short ones of several lengths (grouped rows), shuffled.
    lengths = rng.choice(
        [256, 4096, 16384, 200_000, 600_000], size=120, p=[0.3, 0.3, 0.2, 0.15, 0.05]
    )
    dst = np.cumsum(np.concatenate([[0], lengths[:-1] + 512])) + (n // 2)
    src = rng.integers(0, n // 2 - (1 << 20), size=lengths.size)
    order = rng.permutation(lengths.size)
    batch = CopyBatch(src[order], dst[order], lengths[order])
    assert batch.nbytes >= thresholds.PARALLEL_MIN_BYTES
    before = buf.clone()
    if same_storage:
        stats = execute_batch(batch, buf, buf)
        target, source = buf, before
    else:
        target = torch.zeros(n, dtype=torch.uint8)
        stats = execute_batch(batch, buf, target)
        source = before
    expect = _spans_written(
        before if same_storage else torch.zeros(n, dtype=torch.uint8), source, src, dst, lengths
    )
    assert torch.equal(target, expect) and stats.spans == 120


@given(
    count=st.integers(1, 600),
    length=st.sampled_from([1, 3, 512, 1024, 4096, 16384, 16384 + 2048, 1 << 20]),
)
def test_pieces_cover_the_same_bytes_in_order(count, length):
    """Spans cut into pieces (so numpy releases the GIL) name exactly the spans'
    bytes, in the same order, and more than 500 items whenever pieces can be long
    enough."""
    from kvarena.copy.short_spans import MIN_PIECE_BYTES, NUMPY_GIL_ITEMS, _pieces

    starts = np.arange(count, dtype=np.int64)[::-1] * (length + 7)
    pieces, piece = _pieces(starts, length)
    assert length % piece == 0 and pieces.size * piece == count * length
    want = np.concatenate([np.arange(s, s + length) for s in starts[:50]])
    got = np.concatenate([np.arange(p, p + piece) for p in pieces[: 50 * (length // piece)]])
    assert np.array_equal(got, want)
    if count <= NUMPY_GIL_ITEMS and length % 2 == 0 and length // 2 >= MIN_PIECE_BYTES:
        assert pieces.size > count


def test_few_short_spans_in_threads_are_byte_exact():
    """300 spans of 16 KiB (a threaded batch whose groups are too small for numpy
    to release the GIL without pieces), scattered both ways: every byte lands."""
    n, length = 300, 16 << 10
    rng = np.random.default_rng(3)
    src_buf = torch.from_numpy(rng.integers(0, 256, n * length * 2, dtype=np.uint8))
    dst_buf = torch.zeros(n * length * 2, dtype=torch.uint8)
    src = rng.permutation(2 * n)[:n] * length
    dst = rng.permutation(2 * n)[:n] * length
    execute_batch(CopyBatch(src, dst, np.full(n, length)), src_buf, dst_buf, path="cpu")
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        assert torch.equal(dst_buf[d : d + length], src_buf[s : s + length])
    written = torch.zeros(dst_buf.numel(), dtype=torch.bool)
    for d in dst.tolist():
        written[d : d + length] = True
    assert not dst_buf[~written].any()  # nothing outside the spans written


@given(
    families=st.lists(
        st.tuples(
            st.integers(1, 300),  # length
            st.integers(1, 9),  # count
            st.integers(0, 3),  # source step, in lengths (0: one source read again)
            st.integers(1, 3),  # destination step, in lengths
            st.booleans(),  # destination rows walk down
        ),
        min_size=1,
        max_size=5,
    ),
    extra=st.integers(0, 6),
    seed=st.integers(0, 2**31),
    same_storage=st.booleans(),
    min_bytes=st.sampled_from([0, 64, 1024]),
    torch_span=st.sampled_from([1, 100, 1 << 20]),
    path=st.sampled_from(PATHS),
)
def test_strided_families_move_exactly_their_spans(
    families, extra, seed, same_storage, min_bytes, torch_span, path
):
    """Spans in arithmetic families (blocks from every other slot, units over
    consecutive blocks, one source read into several places, rows written
    downward) plus stragglers,
    shuffled: each family moves as one strided copy, every byte lands, nothing
    else is written, in one storage or two."""
    rng = np.random.default_rng(seed)
    spans: list[tuple[int, int, int]] = []
    src_at, dst_at = 0, 0
    for length, count, ss, ds, down in families:
        step_s, step_d = ss * length, ds * length
        rows = range(count - 1, -1, -1) if down else range(count)
        spans += [(src_at + i * step_s, dst_at + j * step_d, length) for i, j in enumerate(rows)]
        src_at += step_s * count + length + int(rng.integers(0, 50))
        dst_at += step_d * count + length + int(rng.integers(0, 50))
    for _ in range(extra):
        length = int(rng.integers(1, 200))
        spans.append((int(rng.integers(0, src_at + 1)), dst_at, length))
        dst_at += length + int(rng.integers(0, 9))
    order = rng.permutation(len(spans))
    src = np.array([spans[i][0] for i in order], dtype=np.int64)
    dst = np.array([spans[i][1] for i in order], dtype=np.int64)
    length = np.array([spans[i][2] for i in order], dtype=np.int64)
    src_size = int((src + length).max())
    data = torch.from_numpy(rng.integers(0, 256, src_size, dtype=np.uint8))
    if same_storage:  # sources below, destinations above, in one buffer
        buf = torch.cat([data, torch.full((dst_at + 1,), 0xA5, dtype=torch.uint8)])
        src_buf, dst_buf, shift = buf, buf, src_size
    else:
        src_buf, dst_buf, shift = data, torch.full((dst_at + 1,), 0xA5, dtype=torch.uint8), 0
    expect = _spans_written(dst_buf, data, src, dst, length, shift)
    stats = execute_batch(
        CopyBatch(src, dst + shift, length),
        src_buf,
        dst_buf,
        progression_min_bytes=min_bytes,
        torch_span_bytes=torch_span,
        path=path,
    )
    assert torch.equal(dst_buf, expect)
    assert stats.nbytes == int(length.sum()) and stats.spans == len(spans)
    if min_bytes == 0 and extra == 0 and path != "triton" and torch_span > 300:
        assert stats.ops <= 2 * len(families)  # a call (or two) per family, not per span


def test_a_strided_relocation_is_one_copy():
    """Every other block of the upper half moved to every other block of the
    lower half (a boundary move over interleaved live and free blocks): one call."""
    block, count = 4096, 96
    buf = torch.from_numpy(
        np.random.default_rng(1).integers(0, 256, 4 * count * block, dtype=np.uint8)
    )
    before = buf.clone()
    src = 2 * count * block + np.arange(count, dtype=np.int64) * 2 * block + block
    dst = np.arange(count, dtype=np.int64) * 2 * block
    stats = execute_batch(CopyBatch(src, dst, np.full(count, block)), buf, buf)
    assert stats.ops == 1 and stats.spans == count
    expect = _spans_written(before, before, src, dst, block)
    assert torch.equal(buf, expect)


@pytest.mark.parametrize("blocks", ["consecutive", "every_third", "scattered"])
def test_objects_into_a_layer_major_cache_are_one_grid(blocks):
    """Objects of every layer's page back to back, loaded into a layer-major
    cache (each layer a region, a block a page in it): each object's layers are
    one family, and where the objects' blocks advance evenly the families are
    one grid, one call (a scattered request's pages, a page apart on the
    destination in any order, are one gather). Every byte lands, nothing else
    is written; the grid's shape checked by hand."""
    from kvarena.spans import grids

    page, layers, count, region_blocks = 4096, 6, 9, 40
    ids = {
        "consecutive": np.arange(3, 3 + count),
        "every_third": 1 + 3 * np.arange(count),
        "scattered": np.random.default_rng(3).permutation(region_blocks)[:count],
    }[blocks]
    region = region_blocks * page
    src = (np.arange(count)[:, None] * layers * page + np.arange(layers)[None, :] * page).ravel()
    dst = (ids[:, None] * page + np.arange(layers)[None, :] * region).ravel()
    length = np.full(src.size, page, dtype=np.int64)
    rng = np.random.default_rng(7)
    data = torch.from_numpy(rng.integers(0, 256, count * layers * page, dtype=np.uint8))
    cache = torch.full((layers * region,), 0xA5, dtype=torch.uint8)
    expect = _spans_written(cache, data, src, dst, length)
    stats = execute_batch(CopyBatch(src, dst, length), data, cache)
    assert torch.equal(cache, expect)
    assert stats.ops == 1
    families, _ = progressions(src, dst, length, 0, min_spans=4)
    step = int(ids[1] - ids[0]) * page
    if blocks != "scattered":
        grid = (0, int(ids[0]) * page, layers, page, page, region, count, layers * page, step)
        assert grids(families) == [grid]


@pytest.mark.parametrize("rows", ["short", "middle", "long"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_a_downward_family_is_one_copy(interleaved, rows):
    """States read upward into blocks written downward (slots come from the top,
    blocks from the bottom) move as one gather, short rows, long ones and those
    between (large_span_bytes up to torch_span_bytes), also when the rows read
    and the rows written interleave in one storage. The thresholds are scaled
    down here."""
    block, count = 64 * 1024, 96
    rng = np.random.default_rng(2)
    buf = torch.from_numpy(rng.integers(0, 256, 2 * count * block + block, dtype=np.uint8))
    before = buf.clone()
    if interleaved:  # odd blocks read upward, even blocks written downward
        src = np.arange(count, dtype=np.int64) * 2 * block + block
        dst = (count - 1 - np.arange(count, dtype=np.int64)) * 2 * block
    else:
        src = count * block + np.arange(count, dtype=np.int64) * block
        dst = (count - 1 - np.arange(count, dtype=np.int64)) * block
    limits = {
        "short": {},
        "middle": {"large_span_bytes": block, "torch_span_bytes": 2 * block},
        "long": {"large_span_bytes": block, "torch_span_bytes": block},
    }[rows]
    stats, gathers = _gathering(CopyBatch(src, dst, np.full(count, block)), buf, buf, **limits)
    assert stats.path == "cpu" and gathers == 1 and stats.ops == 1
    expect = _spans_written(before, before, src, dst, block)
    assert torch.equal(buf, expect)


def _upward_run(perm: np.ndarray, n: int) -> bool:
    """Whether ``n`` consecutive entries of ``perm`` rise by one constant step: a
    strided family the executor takes as one strided copy before it gathers."""
    d = np.diff(perm)
    return any(d[i] > 0 and bool((d[i : i + n - 1] == d[i]).all()) for i in range(len(d) - n + 2))


@given(
    length=st.sampled_from([64, 1000, 4096]),
    count=st.integers(2, 64),
    step=st.integers(1, 3),
    restore=st.booleans(),
    same_storage=st.booleans(),
    seed=st.integers(0, 2**31),
    path=st.sampled_from(PATHS),
    long=st.booleans(),
)
def test_units_in_any_order_are_gathered_exactly(
    length, count, step, restore, same_storage, seed, path, long
):
    """An image read in order and written to evenly spaced blocks handed out in
    any order (a store), or the reverse (a restore): on CPU one gather over a
    strided destination view, for short spans and (thresholds scaled down to
    the span length) long ones in families of MIN_RUN or more; on every path
    every byte lands and nothing else is written, in one storage or two."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(count).astype(np.int64)
    image = np.arange(count, dtype=np.int64) * length
    blocks = perm * step * length
    src, dst = (blocks, image) if restore else (image, blocks)
    size = count * step * length
    data = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    if same_storage:  # sources below, destinations above, in one buffer
        buf = torch.cat([data, torch.full((size,), 0xA5, dtype=torch.uint8)])
        src_buf, dst_buf, shift = buf, buf, size
    else:
        src_buf, dst_buf, shift = data, torch.full((size,), 0xA5, dtype=torch.uint8), 0
    expect = _spans_written(dst_buf, data, src, dst, length, shift)
    stats = execute_batch(
        CopyBatch(src, dst + shift, np.full(count, length)),
        src_buf,
        dst_buf,
        progression_min_bytes=0,
        path=path,
        **({"large_span_bytes": length, "torch_span_bytes": length} if long else {}),
    )
    assert torch.equal(dst_buf, expect)
    if path == "cpu" and long and step > 1 and not _upward_run(perm, thresholds.MIN_RUN):
        # No two spans continue each other and no strided family lies in the
        # order: one gather, or a copy_ each below MIN_RUN.
        assert stats.ops == (1 if count >= thresholds.MIN_RUN else count)
    elif path == "cpu" and step > 1 and count >= 4:
        # One gather, after any strided families of two or more spans the
        # permutation happens to hold: never a call per span.
        assert stats.ops <= count // 2 + 1


@pytest.mark.parametrize("large", [1 << 20, 4 << 20])
def test_a_span_short_and_long_at_once_is_copied_once(large):
    """Thresholds a caller sets so that spans are short (below
    ``large_span_bytes``) and long (from ``torch_span_bytes``) at once: each
    family is gathered once, not once per road."""
    count, length = 8, 1 << 20
    perm = np.random.default_rng(7).permutation(count).astype(np.int64)
    src = np.arange(count, dtype=np.int64) * length
    dst = perm * 2 * length  # every other block: no two spans coalesce
    data = torch.from_numpy(
        np.random.default_rng(8).integers(0, 256, count * length, dtype=np.uint8)
    )
    out = torch.zeros(2 * count * length, dtype=torch.uint8)
    stats, gathers = _gathering(
        CopyBatch(src, dst, np.full(count, length)),
        data,
        out,
        large_span_bytes=large,
        torch_span_bytes=1 << 20,
    )
    expect = _spans_written(torch.zeros_like(out), data, src, dst, length)
    assert torch.equal(out, expect)
    assert gathers == stats.ops == 1


@pytest.mark.parametrize("align", [1, 2, 4, 8])
@pytest.mark.parametrize("buffer_offset", [0, 1, 4, 8])
@pytest.mark.parametrize("road", ["gather", "long gather", "strided", "one each"])
def test_every_torch_road_moves_exact_bytes_at_any_alignment(align, buffer_offset, road):
    """The torch roads copy in the widest words dividing every offset, length,
    step and both buffers' starts: spans aligned to 1..8 bytes, in buffers that
    start 0..8 bytes into their storage, land byte for byte on every road, and
    no byte outside them is written."""
    rng = np.random.default_rng(align * 100 + buffer_offset)
    count, length = 8, 64 * align + (align if align < 8 else 0)
    step = length + 3 * align
    if road == "strided":  # reads and writes advance by one step each
        src = np.arange(count, dtype=np.int64) * step + align
        dst = np.arange(count, dtype=np.int64) * step
    else:  # written evenly spaced, read in shuffled order
        src = rng.permutation(count).astype(np.int64) * step + align
        dst = np.arange(count, dtype=np.int64) * step
    size = count * (step + align) + 2 * align
    storage = torch.from_numpy(rng.integers(0, 256, size + buffer_offset, dtype=np.uint8))
    src_buf = storage[buffer_offset:]
    dst_store = torch.full((size + buffer_offset,), 0xA5, dtype=torch.uint8)
    dst_buf = dst_store[buffer_offset:]
    expect = _spans_written(dst_store, src_buf, src, dst, length, buffer_offset)
    thresholds = {
        "gather": {"large_span_bytes": length + 1},
        "long gather": {"large_span_bytes": length, "torch_span_bytes": length},
        # Between the short and the long spans: a strided family, not a gather.
        "strided": {"large_span_bytes": length, "torch_span_bytes": length + 1},
        "one each": {"large_span_bytes": 1, "torch_span_bytes": 1},
    }[road]
    families = {
        "gather": "_copy_gather",
        "long gather": "_copy_gather",
        "strided": "copy_grid",
        "one each": "_copy_one",
    }[road]
    if road == "one each":  # a gather would take evenly spaced rows: space them unevenly
        dst = dst + np.arange(count, dtype=np.int64) % 2 * align
        assert int(dst.max()) + length <= size
        expect = _spans_written(dst_store, src_buf, src, dst, length, buffer_offset)
    with mock.patch.object(executor, families, wraps=getattr(executor, families)) as called:
        execute_batch(
            CopyBatch(src, dst, np.full(count, length)),
            src_buf,
            dst_buf,
            progression_min_bytes=0,
            **thresholds,
        )
    assert called.call_count >= 1, road
    assert torch.equal(dst_store, expect)


@pytest.mark.parametrize(
    ("length", "shift", "word"),
    [(256 << 10, 0, 16), (256 << 10, 8, 4), (128 << 10, 0, 8), (512 << 10, 0, 8)],
)
def test_gathered_rows_leave_torchs_one_thread_row_size(length, shift, word):
    """A gathered row of 32,768-65,535 elements would run on one thread: 256 KiB
    rows move as 16-byte words where every offset allows (rows on every
    thread), else as 4-byte words (each row split over threads); rows of 128
    and 512 KiB keep 8-byte words. Every byte lands either way."""
    count = 4
    perm = np.random.default_rng(9).permutation(count).astype(np.int64)
    src, dst = perm * length + shift, np.arange(count, dtype=np.int64) * 2 * length
    data = torch.from_numpy(
        np.random.default_rng(10).integers(0, 256, count * length + shift, dtype=np.uint8)
    )
    out = torch.zeros(2 * count * length, dtype=torch.uint8)
    with mock.patch.object(torch, "index_select", wraps=torch.index_select) as select:
        stats = execute_batch(
            CopyBatch(src, dst, np.full(count, length)), data, out, large_span_bytes=length + 1
        )
    assert stats.ops == 1 and select.call_count == 1
    rows = select.call_args.args[0]
    assert rows.element_size() == word and rows.shape[1] == length // word
    expect = _spans_written(torch.zeros_like(out), data, src, dst, length)
    assert torch.equal(out, expect)


def test_spans_between_gather_in_families_of_min_run():
    """Spans between the short and the long, written evenly spaced from
    anywhere, are one gather from MIN_RUN of them; fewer go one copy each."""
    block = 4096
    for count in (thresholds.MIN_RUN - 1, thresholds.MIN_RUN, 3 * thresholds.MIN_RUN):
        perm = np.random.default_rng(count).permutation(count).astype(np.int64)
        src, dst = perm * 2 * block + block, np.arange(count, dtype=np.int64) * 2 * block
        buf = torch.from_numpy(
            np.random.default_rng(11).integers(0, 256, 2 * count * block, dtype=np.uint8)
        )
        before = buf.clone()
        stats, gathers = _gathering(
            CopyBatch(src, dst, np.full(count, block)),
            buf,
            buf,
            large_span_bytes=block,
            torch_span_bytes=2 * block,
            progression_min_bytes=0,
        )
        many = count >= thresholds.MIN_RUN
        assert gathers == many and stats.ops == (1 if many else count)
        expect = _spans_written(before, before, src, dst, block)
        assert torch.equal(buf, expect)


@pytest.mark.parametrize("threaded_span", [thresholds.THREADED_SPAN_BYTES, 16 * 1024])
def test_threaded_batches_move_spans_in_no_family_one_memcpy_each(threaded_span, monkeypatch):
    """A batch split over threads moves spans that no gather or strided family
    takes (uneven destinations) one memcpy each from THREADED_SPAN_BYTES, and
    grouped below it; the bytes are the same either way."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # threads, whatever the runner's
    length, count = 8 * 1024, 640
    assert length * count >= thresholds.PARALLEL_MIN_BYTES
    rng = np.random.default_rng(12)
    gaps = rng.integers(1, 16, count) * 64
    dst = (np.cumsum(length + gaps) - (length + gaps))[rng.permutation(count)]
    src = rng.permutation(count).astype(np.int64) * length
    data = torch.from_numpy(rng.integers(0, 256, count * length, dtype=np.uint8))
    out = torch.zeros(int(dst.max()) + length, dtype=torch.uint8)
    stats = execute_batch(
        CopyBatch(src, dst, np.full(count, length)), data, out, threaded_span_bytes=threaded_span
    )
    expect = _spans_written(torch.zeros_like(out), data, src, dst, length)
    assert torch.equal(out, expect)
    if threaded_span <= length:
        assert stats.ops == count  # one memcpy each
    else:
        assert stats.ops < count // 8  # grouped: a few staging passes


@pytest.mark.parametrize("path", PATHS)
def test_spans_of_many_kernel_blocks_land_exactly(path):
    """Spans around and across the Triton kernel's block of 1,024 words (one
    program per block, each finding its span by a binary search over the
    spans' first blocks), in 8-byte and 1-byte words, shuffled destinations:
    every path writes exactly the spans (the Triton path under its
    interpreter here, on a GPU in tests/test_gpu.py)."""
    rng = np.random.default_rng(13)
    for word in (8, 1):
        lengths = np.array([1, 1023, 1024, 1025, 3 * 1024 + 1, 1, 5000, 2048, 7, 4096]) * word
        gaps = rng.integers(0, 8, lengths.size) * word
        starts = np.cumsum(lengths + gaps) - lengths
        order = rng.permutation(lengths.size)
        dst, length = starts[order], lengths[order]
        src = rng.integers(0, 40_000, lengths.size) * word
        data = torch.from_numpy(rng.integers(0, 256, 40_000 * word + 5001 * word, dtype=np.uint8))
        out = torch.full((int((dst + length).max()) + 64,), 0xA5, dtype=torch.uint8)
        stats = execute_batch(CopyBatch(src, dst, length), data, out, path=path)
        assert torch.equal(out, _spans_written(torch.full_like(out, 0xA5), data, src, dst, length))
        assert stats.spans == lengths.size and stats.nbytes == int(lengths.sum())


def test_a_shuffled_image_is_one_gather():
    """64 units of 16 KiB into every other block, in shuffled order: one gather."""
    count, length = 64, 16 * 1024
    perm = np.random.default_rng(5).permutation(count).astype(np.int64)
    src = np.arange(count, dtype=np.int64) * length
    dst = 2 * count * length + perm * 2 * length
    families, _ = progressions(src, dst, np.full(count, length), PROGRESSION_MIN_BYTES)
    assert not families  # nothing for the strided path: the gather does it all
    buf = torch.from_numpy(
        np.random.default_rng(6).integers(0, 256, 4 * count * length, dtype=np.uint8)
    )
    before = buf.clone()
    stats, gathers = _gathering(CopyBatch(src, dst, np.full(count, length)), buf, buf)
    assert stats.ops == 1 and stats.path == "cpu" and gathers == 1
    expect = _spans_written(before, before, src, dst, length)
    assert torch.equal(buf, expect)


def test_thresholds_are_checked_at_the_door():
    buf = torch.zeros(64, dtype=torch.uint8)
    batch = CopyBatch(np.array([0]), np.array([32]), np.array([8]))
    for kwargs in (
        {"large_span_bytes": 0},
        {"progression_min_bytes": -1},
        {"large_span_bytes": 1.5},
        {"torch_span_bytes": 0},
        {"threaded_span_bytes": 0},
    ):
        with pytest.raises(ValueError, match="execute_batch"):
            execute_batch(batch, buf, buf, **kwargs)
    assert not buf.any()
