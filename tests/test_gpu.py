"""CUDA paths: run when a GPU is present, skipped cleanly otherwise."""

import numpy as np
import pytest
import torch

from kvarena.checkpoint import CheckpointSpec, PageUnits, restore, store
from kvarena.copy import describe_batch, execute_batch, plan_segmented_copy
from kvarena.copy.executor import triton_available
from kvarena.layout import EntryMajorArena, align_up, strictest_alignment
from kvarena.models import model_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA_PATHS = ["torch"] + (["triton"] if triton_available() else [])


@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("unit", [1000, 4096, 1 << 20])
def test_cuda_round_trip_bytes_and_sentinels(path, unit):
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    src_sizes, copies = [3000, 70000, 256], 64
    total = sum(src_sizes)
    units = -(-total // unit)
    plan = plan_segmented_copy(src_sizes, [unit] * units, total)
    src_bases = (rng.permutation(copies * 3).reshape(copies, 3) * 70144).astype(np.int64)
    dst_bases = (rng.permutation(copies * units).reshape(copies, units) * align_up(unit)).astype(
        np.int64
    )
    src = torch.randint(0, 256, (copies * 3 * 70144,), dtype=torch.uint8, device=dev)
    dst = torch.full((copies * units * align_up(unit),), 0xA5, dtype=torch.uint8, device=dev)
    stats = execute_batch(describe_batch(plan, src_bases, dst_bases), src, dst, path=path)
    if path == "triton":
        assert stats.ops == 1  # one launch for the whole batch
    s_host, d_host = src.cpu().numpy(), dst.cpu().numpy()
    written = np.zeros(d_host.size, dtype=bool)
    for c in range(copies):
        stream = np.concatenate(
            [s_host[b : b + n] for b, n in zip(src_bases[c], src_sizes, strict=True)]
        )
        got, left = [], total
        for b in dst_bases[c]:
            k = min(unit, left)
            got.append(d_host[b : b + k])
            written[b : b + k] = True
            left -= k
        assert np.array_equal(np.concatenate(got), stream)
    assert (d_host[~written] == 0xA5).all()


def test_cuda_checkpoint_round_trip():
    dev = torch.device("cuda")
    fields = list(model_cache("deepseek-v4-flash").state_fields)
    stride = align_up(sum(f.bytes_per_entry for f in fields) + 4096, strictest_alignment(fields))
    state = EntryMajorArena(fields, 8, dev, slot_stride=stride)
    for f in fields:
        v = state.view(f.name)
        v.copy_(torch.randn(v.shape, device=dev).to(f.dtype))
    spec = CheckpointSpec.build(fields, 256 * 1024)
    n = 8 * spec.units_per_image
    pages = PageUnits(
        buf=torch.zeros(n * spec.unit_bytes, dtype=torch.uint8, device=dev),
        unit_bytes=spec.unit_bytes,
        unit_stride=spec.unit_bytes,
        num_units=n,
    )
    units = [list(range(c, n, 8)) for c in range(8)]
    store(spec, state, list(range(8)), pages, units)
    back = EntryMajorArena(fields, 8, dev, slot_stride=stride)
    restore(spec, back, list(range(8)), pages, units)
    for f in fields:
        if f.in_checkpoint:
            assert torch.equal(
                back.view(f.name).view(torch.uint8), state.view(f.name).view(torch.uint8)
            ), f.name
        else:  # never stored, never overwritten: still the fill
            assert bool((back.view(f.name) == f.fill).all()), f.name


def test_cuda_unified_cache_moves_keep_bytes():
    from kvarena import UnifiedCache, plan_cache
    from kvarena.models import ServingOptions

    m = model_cache("qwen3-next-80b-a3b", ServingOptions(tp=8))
    cache = UnifiedCache.from_plan(plan_cache(m, budget_bytes=256 << 20, max_seqs=4), "cuda")
    assert cache.buf.is_cuda and cache.page_view("k").is_cuda
    blocks = cache.blocks.allocate(cache.num_blocks)
    for b in blocks[::2]:
        cache.blocks.release(b)
    for b in blocks[1::2]:
        cache.block_bytes_of(b).fill_(b % 251)
    move = cache.grow_state(8)
    assert move.block_remap  # every other block live: some had to move
    for old, new in move.block_remap.items():
        assert bool((cache.block_bytes_of(new) == old % 251).all())


@pytest.mark.parametrize("path", CUDA_PATHS)
def test_cuda_strided_families_match_the_cpu(path):
    """Evenly spaced blocks (a strided family: one ``copy_`` on the torch path),
    a source read twice, and stragglers: the device bytes equal the CPU's."""
    from kvarena.copy import CopyBatch

    block, count = 8192, 64
    src = np.concatenate(
        [
            2 * count * block + np.arange(count) * 2 * block + block,  # every other block
            np.full(4, block),  # one source (an odd block, never written) into four places
            np.array([block + 5, 3 * block + 999, 2 * count * block + 7]),  # stragglers
        ]
    ).astype(np.int64)
    dst = np.concatenate(
        [np.arange(count) * 2 * block, 4 * count * block + np.arange(7) * 2 * block]
    ).astype(np.int64)
    length = np.array([block] * (count + 4) + [100, 3000, block], dtype=np.int64)
    data = torch.from_numpy(
        np.random.default_rng(2).integers(0, 256, 5 * count * block, dtype=np.uint8)
    )
    want = data.clone()
    execute_batch(CopyBatch(src, dst, length), want, want, path="cpu")
    got = data.to("cuda")
    execute_batch(CopyBatch(src, dst, length), got, got, path=path)
    assert torch.equal(got.cpu(), want)
