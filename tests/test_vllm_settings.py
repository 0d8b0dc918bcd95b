"""The connector's pure parts and its doors, without an engine where none is
needed: settings refusals, the groups it serves and refuses, the namespace,
and block bytes in and out of vLLM-shaped tensors (by bytes, for random
shapes and dtypes). The last test starts a real engine with a bad config.
Runs in the ``.venv-vllm`` environment; skipped where vLLM is not installed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvarena.errors import Error
from kvarena.integrations.vllm.connector import _host_frame
from kvarena.integrations.vllm.groups import classify, namespace_json
from kvarena.integrations.vllm.settings import (
    ConnectorConfigError,
    ConnectorSettings,
)
from kvarena.integrations.vllm.tensors import (
    CachePages,
    LayerPages,
    payload_bytes,
)
from kvarena.tiers import HostTier, TierSpec
from kvarena.tiers.image import HEAD_BYTES

pytestmark = pytest.mark.usefixtures("vllm_in_process")


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (None, "'tiers'"),
        ({}, "'tiers'"),
        ({"tiers": "host:1GiB"}, "'tiers'"),
        ({"tiers": []}, "'tiers'"),
        ({"tiers": ["host:1GiB"], "tier": 1}, "'tier'"),
        ({"tiers": ["nowhere:1GiB"]}, "['tiers'][0]"),
        ({"tiers": ["host:1GiB", "host:2GiB"]}, "['tiers'][1]"),
        ({"tiers": ["host:1GiB", "mooncake://m:50051"]}, "['tiers'][1]"),
        (
            {"tiers": ["host:1GiB", "redis://:${KVARENA_UNSET_PW}@h:1"]},
            "['tiers'][1] = 'redis://:${KVARENA_UNSET_PW}@h:1': the environment has no "
            "KVARENA_UNSET_PW",
        ),
        ({"tiers": [3]}, "['tiers'][0]"),
        ({"tiers": ["host:1GiB"], "namespace": 7}, "'namespace'"),
        ({"tiers": ["host:1GiB"], "host_frame_bytes": 100}, "'host_frame_bytes'"),
        ({"tiers": ["host:1GiB"], "host_frame_bytes": True}, "'host_frame_bytes'"),
        ({"tiers": ["host:1GiB"], "host_unit_bytes": 4096}, "is now 'host_frame_bytes'"),
        ({"tiers": ["host:1GiB"], "load_timeout": 0}, "'load_timeout'"),
        ({"tiers": ["host:1GiB"], "load_timeout": True}, "'load_timeout'"),
        ({"tiers": ["host:1GiB"], "load_timeout": "30s"}, "'load_timeout'"),
        ({"tiers": ["host:1GiB"], "layout": "BLHNC"}, "'layout'"),
        ({"tiers": ["host:1GiB"], "layout": None}, "'layout'"),
        ({"tiers": ["host:1GiB"], "store_feed": "on"}, "'store_feed'"),
        ({"tiers": ["host:1GiB"], "store_feed": False}, "'store_feed'"),
        ({"tiers": ["host:1GiB"], "save_backlog": 0}, "'save_backlog'"),
        ({"tiers": ["host:1GiB"], "save_backlog": "lots"}, "'save_backlog'"),
        ({"tiers": ["host:1GiB"], "save_backlog": True}, "'save_backlog'"),
        ({"tiers": ["host:1GiB"], "save_backlog": 1.5}, "'save_backlog'"),
        ([("tiers", "x")], "mapping"),
        ({"tiers": ["host:1GiB"], "pd_port": 70000}, "'pd_port'"),
        ({"tiers": ["host:1GiB"], "pd_port": "5600"}, "'pd_port'"),
        ({"tiers": ["host:1GiB"], "pd_host": "0.0.0.0"}, "'pd_host'"),
        ({"tiers": ["host:1GiB"], "pd_host": ""}, "'pd_host'"),
        ({"tiers": ["host:1GiB"], "pd_expiry": 0}, "'pd_expiry'"),
        ({"tiers": ["host:1GiB"], "pd_expiry": True}, "'pd_expiry'"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(extra, names):
    with pytest.raises(ConnectorConfigError) as err:
        ConnectorSettings.parse(extra)
    assert names in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, Error)


@pytest.mark.parametrize(
    "tiers",
    [
        ["redis://:s3cret@h:1", "redis://:s3cret@h:2/1"],  # a second store
        ["host:1GiB", "redis://:s3cret@h:1", "rediss://u:s3cret@h:2"],
        "redis://:s3cret@h:1",  # a string, not a list
    ],
)
def test_a_refused_store_is_named_without_its_password(tiers):
    with pytest.raises(ConnectorConfigError) as err:
        ConnectorSettings.parse({"tiers": tiers})
    assert "s3cret" not in str(err.value) and ":***@h:" in str(err.value)


def test_roles_take_disaggregation_and_tiers_as_they_need():
    for role in ("kv_producer", "kv_consumer"):
        s = ConnectorSettings.parse({}, role=role)  # nothing but the role is required
        assert s.disaggregated and s.tiers == () and (s.pd_host, s.pd_port) == ("127.0.0.1", 0)
        s = ConnectorSettings.parse({"tiers": ["host:1GiB"], "pd_port": 5600}, role=role)
        assert s.tiers and s.pd_port == 5600
    assert not ConnectorSettings.parse({"tiers": ["host:1GiB"]}).disaggregated
    both = ConnectorSettings.parse({"tiers": ["host:1GiB"], "pd_host": "10.0.0.2"})
    assert both.disaggregated and both.pd_host == "10.0.0.2"
    with pytest.raises(ConnectorConfigError, match=r"\['tiers'\].*kv_producer and kv_consumer"):
        ConnectorSettings.parse({"tiers": []}, role="kv_both")
    with pytest.raises(ConnectorConfigError, match=r"kv_role='kv_middle': .*kv_producer"):
        ConnectorSettings.parse({}, role="kv_middle")


def test_good_settings_parse():
    s = ConnectorSettings.parse(
        {"tiers": [" host:1GiB", "disk:/tmp/x:2GiB", "redis://h:1"], "namespace": "fleet-a"}
    )
    assert s.tiers == (
        TierSpec(kind="host", size=1 << 30),
        TierSpec(kind="disk", size=2 << 30, directory="/tmp/x"),
        TierSpec(kind="redis", url="redis://h:1"),
    )
    assert s.namespace == "fleet-a"
    assert s.layout == "auto" and s.save_backlog == 1 << 30
    for backlog, want in (("512MiB", 512 << 20), (4096, 4096), ("1", 1)):
        t = ConnectorSettings.parse({"tiers": ["host:1GiB"], "save_backlog": backlog})
        assert t.save_backlog == want
    assert s.preferred_layout(cpu=True) is None and s.preferred_layout(cpu=False) == "BLHNC"
    for layout, cpu, gpu in (("block-major", "BLHNC", "BLHNC"), ("engine", None, None)):
        t = ConnectorSettings.parse({"tiers": ["host:1GiB"], "layout": layout})
        assert (t.preferred_layout(cpu=True), t.preferred_layout(cpu=False)) == (cpu, gpu)


def attention(bs=32, heads=2, size=64, dtype=torch.bfloat16):
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=size, dtype=dtype)


def mamba(bs=32, mode="align"):
    return MambaSpec(
        block_size=bs,
        shapes=((3, 256), (4, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
    )


def config(*specs):
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=s)
            for i, s in enumerate(specs)
        ],
    )


def test_the_host_frame_is_one_kv_block_image_unless_given():
    """By default a KV block's object takes exactly one host frame (no frame wasted
    on the header and namespace's few bytes past a round size); a state object a
    run of them; the settings' value wins; no attention layer: the tier's default."""
    cfg = config(mamba(), attention(), attention())
    groups = classify(cfg)
    kv = [g for g in groups if g.kind == "kv"]
    ns = b'{"rank":0}' * 30
    block = 2 * (32 * 2 * 2 * 64 * 2)  # two attention layers' blocks
    assert payload_bytes(kv) == block
    frame = _host_frame(ConnectorSettings.parse({"tiers": ["host:1MiB"]}), groups, ns)
    assert frame == HEAD_BYTES + len(ns) + block
    tier = HostTier(10 * frame, frame_bytes=frame)
    assert tier._frames_for(frame) == 1 and tier._frames_for(frame + 1) == 2
    given = ConnectorSettings.parse({"tiers": ["host:1MiB"], "host_frame_bytes": 4096})
    assert _host_frame(given, groups, ns) == 4096
    states = classify(config(mamba()))
    assert _host_frame(ConnectorSettings.parse({"tiers": ["host:1MiB"]}), states, ns) == 64 << 10


def test_groups_are_kv_or_state_and_others_are_refused_by_name():
    groups = classify(config(mamba(), attention()))
    assert [g.kind for g in groups] == ["state", "kv"]
    assert groups[1].block_bytes == 32 * 2 * 2 * 64 * 2  # K and V of 32 tokens, 2 heads
    assert groups[0].block_bytes == 3 * 256 * 2 + 4 * 16 * 16 * 4  # conv and SSM states
    swa = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )
    with pytest.raises(ConnectorConfigError, match="SlidingWindowSpec"):
        classify(config(attention(), swa))
    with pytest.raises(ConnectorConfigError, match="mamba_cache_mode='all'"):
        classify(config(attention(), mamba(mode="all")))
    with pytest.raises(ConnectorConfigError, match="block sizes"):
        classify(config(attention(32), mamba(64)))


def test_the_namespace_changes_with_every_field():
    groups = classify(config(mamba(), attention()))
    base = dict(
        model="m",
        revision=None,
        word="",
        groups=groups,
        layout="NHD",
        tp_rank=0,
        tp_size=1,
        pp_size=1,
    )
    seen = {namespace_json(**base)}
    for key, value in [
        ("model", "m2"),
        ("revision", "abc"),
        ("word", "fleet"),
        ("groups", classify(config(mamba(), attention(dtype=torch.float16)))),
        ("groups", classify(config(mamba(), attention(heads=4)))),
        ("layout", "HND"),
        ("tp_rank", 1),
        ("tp_size", 2),
        ("pp_size", 2),
    ]:
        seen.add(namespace_json(**{**base, key: value}))
    assert len(seen) == 10


DTYPES = [torch.bfloat16, torch.float32, torch.int8, torch.float16]


@given(
    kv_first=st.booleans(),
    blocks=st.integers(3, 9),  # vLLM's block counts are never 2 (K/V's dimension)
    inner=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_block_bytes_round_trip_exactly(kv_first, blocks, inner, dtype, data):
    shape = ([2, blocks] if kv_first else [blocks]) + inner
    src = torch.randint(-100, 100, shape).to(dtype)
    per_block = (2 if kv_first else 1) * int(torch.tensor(inner).prod()) * dtype.itemsize
    group = classify(config(attention()))[0]
    group = type(group)(
        index=0,
        kind="state",
        layers=("l",),
        spec={"class": "MambaSpec", "shapes": [[per_block]], "dtypes": ["torch.int8"]},
        block_bytes=per_block,
    )
    layer = CachePages({"state": [[LayerPages.of("l", src, num_blocks=blocks, group=group)]]})
    ids = data.draw(st.lists(st.integers(0, blocks - 1), min_size=1, max_size=blocks, unique=True))
    rows = layer.gather("state", [[b] for b in ids])[0].numpy().reshape(len(ids), per_block)
    raw = src.view(torch.uint8)
    for row, b in zip(rows, ids, strict=True):
        want = (raw[:, b] if kv_first else raw[b]).contiguous().reshape(-1).numpy()
        assert bytes(row) == bytes(want)
    dst = torch.zeros_like(src)
    out = CachePages({"state": [[LayerPages.of("l", dst, num_blocks=blocks, group=group)]]})
    out.place(
        {"state": ([[b] for b in ids], [memoryview(row) for row in rows], [None] * len(ids))}, None
    )
    for b in range(blocks):
        got, want = (dst[:, b], src[:, b]) if kv_first else (dst[b], src[b])
        expect = want if b in ids else torch.zeros_like(want)
        assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))  # nothing else written


def test_unknown_tensor_layouts_are_refused_with_the_shapes():
    group = classify(config(attention()))[0]
    with pytest.raises(ConnectorConfigError, match=r"\[32, 8, 2, 128\]"):
        LayerPages.of(
            "l", torch.zeros(32, 8, 2, 128, dtype=torch.bfloat16), num_blocks=8, group=group
        )
    with pytest.raises(ConnectorConfigError, match="holds"):
        LayerPages.of(
            "l", torch.zeros(8, 2, 32, 64, dtype=torch.bfloat16), num_blocks=8, group=group
        )
    with pytest.raises(ConnectorConfigError, match="contiguous"):
        t = torch.zeros(8, 2, 128, 32, dtype=torch.bfloat16).transpose(2, 3)
        LayerPages.of("l", t, num_blocks=8, group=group)


def test_an_engine_with_a_bad_config_is_refused_at_start(tmp_path):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvarena.integrations.transformers.tiny import save_tiny
    from kvarena.integrations.vllm import kv_transfer_config

    with pytest.raises(ConnectorConfigError, match=r"\['tiers'\]\[0\]"):
        kv_transfer_config(["host:lots"])  # the helper refuses before any engine exists
    model = save_tiny("llama", tmp_path)

    def start(config: KVTransferConfig) -> None:
        LLM(
            model=str(model),
            skip_tokenizer_init=True,
            enforce_eager=True,
            kv_cache_memory_bytes=64 << 20,
            enable_prefix_caching=True,
            distributed_executor_backend="uni",
            block_size=32,
            kv_transfer_config=config,
        )

    bad = KVTransferConfig(
        kv_connector="KvarenaConnector",
        kv_connector_module_path="kvarena.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"tiers": ["host:lots"]},
    )
    with pytest.raises(Exception, match=r"\['tiers'\]\[0\] = 'host:lots'"):
        start(bad)
    # Good tiers, but vLLM's default load-failure policy ("fail"): refused at start,
    # naming the key, before a lost object could fail a request.
    raw = KVTransferConfig(
        kv_connector="KvarenaConnector",
        kv_connector_module_path="kvarena.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"tiers": ["host:64MiB"]},
    )
    with pytest.raises(Exception, match="kv_load_failure_policy='fail'"):
        start(raw)
    with pytest.raises(ConnectorConfigError, match="kv_load_failure_policy"):
        kv_transfer_config(["host:64MiB"], load_failure_policy="fail")
