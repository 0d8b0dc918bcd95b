"""The connector's copies over vLLM's own cache tensors, in each KV cache layout.

The tensors are made by vLLM's own code (``get_kv_cache_config_from_groups``
and ``allocate_kv_cache``, the ones its model runner calls) for a hybrid of a
full-attention group and two Mamba-style groups, in the layer-major ``LBHNC``
(what vLLM's CPU backend runs) and the block-major ``BLHNC`` and ``BLNHC``
(what CUDA backends may take). Every check is by bytes: what the connector
gathers is each layer's page of the block, in the group's layer order, in
every layout; what it scatters lands there and nowhere else.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from kvarena.integrations.vllm.connector import KvarenaConnector
from kvarena.integrations.vllm.groups import classify
from kvarena.integrations.vllm.settings import ConnectorConfigError
from kvarena.integrations.vllm.tensors import cache_pages
from kvarena.testing.vllm_tensors import ATTN, BLOCKS, allocation, fill, page

# Block ids owned by one group each, as vLLM's block pool hands them out (block-major
# groups alias the same bytes from byte 0, so a block belongs to one group at a time).
OWNED = {0: [1, 4, 7], 1: [2, 5], 2: [3, 9]}


def objects(groups, kind):
    """Each object of ``kind``: one block id per group of that kind."""
    mine = [g.index for g in groups if g.kind == kind]
    return [list(ids) for ids in zip(*(OWNED[i] for i in mine), strict=True)]


def owned_pages_only(target, caches, groups, num_blocks, layout) -> None:
    """``target`` holds ``caches``' pages at each group's own blocks and nothing at
    the blocks no group owns (groups alias one allocation, so a block's bytes
    are whichever group owns it)."""
    owned = {b for ids in OWNED.values() for b in ids}
    for g in groups:
        for name in g.layers:
            for b in range(num_blocks):
                if b in OWNED[g.index]:
                    assert page(target[name], b) == page(caches[name], b), (layout, name, b)
                elif b not in owned:
                    assert not any(page(target[name], b)), (layout, name, b)  # untouched


def ranges(pages, kind, ids) -> int:
    """The contiguous ranges one object is once the copy engine coalesces its spans."""
    from kvarena.spans import coalesce

    [_, batch], *more = pages.batches(kind, np.asarray([ids]), np.zeros(1, dtype=np.int64))
    assert not more  # one storage: vLLM allocates the groups' tensors together
    return int(coalesce(batch.src, batch.dst, batch.length)[0].size)


def oracle_ranges(caches, groups, kind, ids, num_blocks) -> int:
    """The same count from torch alone: every payload byte's place in the storage
    (each layer's page of its block, in element order, layers in group order),
    and the places where the next byte does not follow."""
    places = []
    mine = [g for g in groups if g.kind == kind]
    for g, b in zip(mine, ids, strict=True):
        for name in g.layers:
            t = caches[name].view(torch.uint8)
            every = torch.arange(t.untyped_storage().nbytes(), dtype=torch.int64)
            at = every.as_strided(t.shape, t.stride(), t.storage_offset())
            places.append(at.select(0 if t.shape[0] == num_blocks else 1, b).reshape(-1))
    flat = torch.cat(places)
    return int((flat[1:] - flat[:-1] != 1).sum()) + 1


def road(monkeypatch, which: str) -> dict[str, int]:
    """Make the cache's copies take ``which`` road (``grids``: the grids its layout
    declares; ``batch``: a batch the copy engine plans), counting the calls of each."""
    import kvarena.integrations.vllm.tensors as tensors

    calls = {"grids": 0, "batch": 0}
    monkeypatch.setattr(
        tensors, "worth_grids", lambda found, nbytes: which == "grids" and bool(found)
    )
    for name, real in (("grids", tensors.execute_grids), ("batch", tensors.execute_batch)):

        def spy(*args, real=real, name=name):
            calls[name] += 1
            return real(*args)

        monkeypatch.setattr(tensors, f"execute_{name}", spy)
    return calls


@pytest.mark.parametrize("which", ["grids", "batch"])
@pytest.mark.parametrize("reverse", [False, True], ids=["as handed out", "reversed"])
@pytest.mark.parametrize(
    ("layout", "padded"), [("LBHNC", True), ("BLHNC", True), ("BLHNC", False), ("BLNHC", False)]
)
def test_objects_gather_each_layers_page_in_group_order_and_scatter_exactly(
    layout, padded, reverse, which, monkeypatch
):
    """Both roads, objects in the order their blocks were handed out (evenly
    spaced: one grid a run) and reversed (blocks descending: a grid an object)."""
    kc, caches = allocation(layout, padded=padded)
    groups = classify(kc)
    fill(caches, seed=1)
    pages = cache_pages(caches, groups, num_blocks=kc.num_blocks)
    _, target = allocation(layout, padded=padded)
    into = cache_pages(target, groups, num_blocks=kc.num_blocks)
    calls = road(monkeypatch, which)
    for kind in ("kv", "state"):
        objs = objects(groups, kind)[:: -1 if reverse else 1]
        # as few ranges as the bytes allow: in block-major layouts a group's block
        # is one range (padded state pages leave gaps), in layer-major one per layer
        assert ranges(pages, kind, objs[0]) == oracle_ranges(
            caches, groups, kind, objs[0], kc.num_blocks
        )
        if layout == "BLHNC":
            assert ranges(pages, "kv", objects(groups, "kv")[0]) == 1
        stage = pages.gather(kind, objs)[0]  # one batch per storage
        size = pages.payload[kind]
        assert stage.numel() == len(objs) * size
        mine = [g for g in groups if g.kind == kind]
        for j, ids in enumerate(objs):
            want = b"".join(
                page(caches[n], b) for g, b in zip(mine, ids, strict=True) for n in g.layers
            )
            assert bytes(stage[j * size : (j + 1) * size].numpy()) == want
        views = [memoryview(stage.numpy())[j * size : (j + 1) * size] for j in range(len(objs))]
        into.place({kind: (objs, views, [None] * len(objs))}, None)
    owned_pages_only(target, caches, groups, kc.num_blocks, layout)
    assert calls[which] == 4 and sum(calls.values()) == 4  # a gather and a place a kind


@pytest.mark.parametrize("which", ["grids", "batch"])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_a_load_of_both_kinds_is_one_batch_per_storage_and_a_wrong_size_is_refused(
    layout, which, monkeypatch
):
    """A load's KV blocks and state together: one copy per storage (the kinds
    share vLLM's allocation), every page exact, nothing else written; a payload
    of another size than its kind's is refused before a byte moves."""
    from kvarena.errors import InvalidValueError

    kc, caches = allocation(layout, padded=True)
    groups = classify(kc)
    fill(caches, seed=3)
    pages = cache_pages(caches, groups, num_blocks=kc.num_blocks)
    parts = {}
    for kind in ("kv", "state"):
        objs = objects(groups, kind)
        stage = pages.gather(kind, objs)[0].numpy()
        size = pages.payload[kind]
        views = [memoryview(stage[j * size : (j + 1) * size]) for j in range(len(objs))]
        parts[kind] = (objs, views, [None] * len(objs))
    _, target = allocation(layout, padded=True)
    into = cache_pages(target, groups, num_blocks=kc.num_blocks)
    before = {n: t.clone() for n, t in target.items()}
    short = memoryview(bytes(len(parts["state"][1][0]) - 1))
    bad = {**parts, "state": (parts["state"][0], [short], [None])}
    with pytest.raises(InvalidValueError, match="state payload of"):
        into.place(bad, None)
    assert all(torch.equal(target[n], before[n]) for n in target)
    calls = road(monkeypatch, which)
    into.place(parts, None)
    assert calls[which] == 1 and sum(calls.values()) == 1  # one storage, both kinds
    owned_pages_only(target, caches, groups, kc.num_blocks, layout)


@pytest.mark.parametrize("which", ["grids", "batch"])
def test_a_payload_lent_by_the_host_tier_is_copied_straight_from_its_allocation(which, monkeypatch):
    """What the host tier lends in place is read there (by the offset it lends
    it at), the rest staged: both land exactly in their blocks, by either road."""
    from kvarena.tiers import HostTier, TierObject

    kc, caches = allocation("LBHNC", padded=True)
    groups = classify(kc)
    fill(caches, seed=2)
    pages = cache_pages(caches, groups, num_blocks=kc.num_blocks)
    objs = objects(groups, "kv")
    size = pages.payload["kv"]
    stage = pages.gather("kv", objs)[0].numpy()
    host = HostTier(8 * size, frame_bytes=size)
    _, target = allocation("LBHNC", padded=True)
    into = cache_pages(target, groups, num_blocks=kc.num_blocks)
    host.put_many([TierObject("pad", (bytes(size // 2),), size // 2)])  # "a" not at 0
    host.put_many([TierObject("a", (stage[:size].tobytes(),), size)])
    with host.lend(["a"]) as (lent,):
        assert lent is not None and lent[1] == size  # the second frame
        rest = [memoryview(stage[j * size : (j + 1) * size].tobytes()) for j in (1, 2)]
        calls = road(monkeypatch, which)
        into.place({"kv": (objs, [lent[0], *rest], [lent[1], None, None])}, host.buffer)
    assert calls[which] == 2 and sum(calls.values()) == 2  # from the arena, from the staging
    for name in groups[0].layers:
        for b in OWNED[0]:
            assert page(target[name], b) == page(caches[name], b)


def test_the_images_bytes_are_the_same_in_every_layout():
    payloads = {}
    for layout in ("LBHNC", "BLHNC", "BLNHC"):
        kc, caches = allocation(layout, padded=True)
        groups = classify(kc)
        pages = cache_pages(caches, groups, num_blocks=kc.num_blocks)
        payloads[layout] = []
        for g in groups:  # one group at a time: groups alias the same bytes
            fill({name: caches[name] for name in g.layers}, seed=7 + g.index)
            mine = [x for x in groups if x.kind == g.kind]
            size = pages.payload[g.kind]
            start = sum(x.block_bytes * len(x.layers) for x in mine[: mine.index(g)])
            part = g.block_bytes * len(g.layers)
            stage = pages.gather(g.kind, [[b] * len(mine) for b in range(BLOCKS)])[0].numpy()
            payloads[layout] += [
                bytes(stage[j * size + start : j * size + start + part]) for j in range(BLOCKS)
            ]
    assert payloads["LBHNC"] == payloads["BLHNC"] == payloads["BLNHC"]


def test_a_batched_gather_equals_block_by_block():
    kc, caches = allocation("BLHNC", padded=False, attn_layers=4)
    fill(caches, seed=3)
    pages = cache_pages(caches, classify(kc), num_blocks=kc.num_blocks)
    ids = [[5], [0], [11], [6]]
    rows = pages.gather("kv", ids)[0]
    assert rows.numel() == 4 * 4 * ATTN.page_size_bytes
    assert bytes(rows.numpy()) == b"".join(bytes(pages.gather("kv", [b])[0].numpy()) for b in ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_gather_lands_in_pinned_memory_off_the_compute_stream():
    """On CUDA a step's saves are read on a side stream into pinned host memory:
    the bytes equal the CPU gather's once the returned event has passed, and a
    write the compute stream queues next (the next forward) lands after the
    read, never in what is being saved."""
    kc, caches = allocation("BLHNC", padded=False, attn_layers=4)
    fill(caches, seed=4)
    pages = cache_pages(caches, classify(kc), num_blocks=kc.num_blocks)
    ids = [[5], [0], [11]]
    want = bytes(pages.gather("kv", ids)[0].numpy())
    # vLLM's allocations copied to the device, each layer viewed as on the host
    copies = {}
    for t in caches.values():
        ptr = t.untyped_storage().data_ptr()
        if ptr not in copies:
            copies[ptr] = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).to("cuda")
    on_cuda = {
        name: torch.empty(0, dtype=t.dtype, device="cuda").set_(
            copies[t.untyped_storage().data_ptr()].untyped_storage(),
            t.storage_offset(),
            t.shape,
            t.stride(),
        )
        for name, t in caches.items()
    }
    pages = cache_pages(on_cuda, classify(kc), num_blocks=kc.num_blocks)
    got, ready = pages.gather("kv", ids)
    for d in copies.values():
        d.fill_(0)  # the next forward, queued on the compute stream
    assert ready is not None and got.is_pinned()
    ready.synchronize()
    assert bytes(got.numpy()) == want


def _config(layout):
    extra = (
        {"tiers": ["host:1GiB"]} if layout is None else {"tiers": ["host:1GiB"], "layout": layout}
    )
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


def test_the_connector_asks_for_block_major_where_the_settings_say():
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    ask = KvarenaConnector.get_required_kvcache_layout
    assert ask(_config(None)) == (None if on_cpu else "BLHNC")  # auto
    assert ask(_config("block-major")) == "BLHNC"
    assert ask(_config("engine")) is None
    with pytest.raises(
        ConnectorConfigError, match=r"\['layout'\] must be one of auto, block-major"
    ):
        ask(_config("blocks"))
