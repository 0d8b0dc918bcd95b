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

import pytest

pytest.importorskip("vllm")

from kvarena.integrations.vllm.connector import KvarenaConnector
from kvarena.integrations.vllm.groups import classify
from kvarena.integrations.vllm.settings import ConnectorConfigError
from kvarena.integrations.vllm.tensors import layer_blocks
from kvarena.testing.vllm_tensors import ATTN, BLOCKS, allocation, fill, page

# Block ids owned by one group each, as vLLM's block pool hands them out (block-major
# groups alias the same bytes from byte 0, so a block belongs to one group at a time).
OWNED = {0: [1, 4, 7], 1: [2, 5], 2: [3, 9, 11]}


@pytest.mark.parametrize(
    ("layout", "padded", "runs"),
    [
        ("LBHNC", True, [3, 3, 3]),  # one layer per run
        ("BLHNC", True, [1, 3, 3]),  # a block of the attention group is one range
        ("BLHNC", False, [1, 1, 1]),  # unpadded state pages too
        ("BLNHC", False, [3, 1, 1]),  # token-major pages are no contiguous [H, N, C] view
    ],
)
def test_runs_gather_each_layers_page_in_group_order_and_scatter_exactly(layout, padded, runs):
    kc, caches = allocation(layout, padded=padded)
    groups = classify(kc)
    fill(caches, seed=1)
    by_group = layer_blocks(caches, groups, num_blocks=kc.num_blocks)
    assert [len(by_group[g.index]) for g in groups] == runs
    _, target = allocation(layout, padded=padded)
    target_runs = layer_blocks(target, groups, num_blocks=kc.num_blocks)
    for g in groups:
        ids = OWNED[g.index]
        rows = [r.gather(ids) for r in by_group[g.index]]  # one batched gather per run
        payloads = [b"".join(bytes(r[j]) for r in rows) for j in range(len(ids))]
        for b, payload in zip(ids, payloads, strict=True):
            assert payload == b"".join(page(caches[name], b) for name in g.layers)
            pos = 0
            for r in target_runs[g.index]:
                r.scatter(b, memoryview(payload)[pos : pos + r.block_bytes])
                pos += r.block_bytes
            assert pos == len(payload)
    # Groups alias one allocation (a block's bytes are whichever group owns it), so a
    # layer is checked at its own group's blocks and at the blocks nobody owns.
    owned = {b for ids in OWNED.values() for b in ids}
    for g in groups:
        for name in g.layers:
            for b in range(kc.num_blocks):
                if b in OWNED[g.index]:
                    assert page(target[name], b) == page(caches[name], b), (layout, name, b)
                elif b not in owned:
                    assert not any(page(target[name], b)), (layout, name, b)  # untouched


def test_the_images_bytes_are_the_same_in_every_layout():
    payloads = {}
    for layout in ("LBHNC", "BLHNC", "BLNHC"):
        kc, caches = allocation(layout, padded=True)
        groups = classify(kc)
        runs = layer_blocks(caches, groups, num_blocks=kc.num_blocks)
        payloads[layout] = []
        for g in groups:  # one group at a time: groups alias the same bytes
            fill({name: caches[name] for name in g.layers}, seed=7 + g.index)
            payloads[layout] += [
                b"".join(bytes(r.gather([b])[0]) for r in runs[g.index]) for b in range(BLOCKS)
            ]
    assert payloads["LBHNC"] == payloads["BLHNC"] == payloads["BLNHC"]


def test_a_batched_gather_equals_block_by_block():
    kc, caches = allocation("BLHNC", padded=False, attn_layers=4)
    fill(caches, seed=3)
    run = layer_blocks(caches, classify(kc), num_blocks=kc.num_blocks)[0][0]
    ids = [5, 0, 11, 6]
    rows = run.gather(ids)
    assert rows.shape == (4, 4 * ATTN.page_size_bytes)
    assert [bytes(r) for r in rows] == [bytes(run.gather([b])[0]) for b in ids]


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
