"""Engines sharing a Redis Cluster with replicas, through the real vLLM engine.

Three primaries and three replicas on loopback (a silent primary's replica is
promoted after one second). One engine computes prompts into the cluster;
another, sharing nothing else, hits every block and state the first wrote
(its tokens equal vLLM alone's). Then a primary is killed while the second
engine serves: its loads wait for the replica (redis-py retries) or miss
(vLLM recomputes), the tokens never change, and once the replica is
promoted every prompt hits again. Last, a shard is lost whole (the promoted
primary killed, no replica left): its loads fail, vLLM recomputes, same
tokens. The engines run in this process (see
``test_vllm_connector.py``). Runs in ``.venv-vllm``; skipped where vLLM or
redis-server is missing.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from vllm_offline import (  # noqa: E402
    PROMPT_BLOCKS,
    close,
    engine,
    one_by_one,
    prompts_for,
    saved,
    worker_connector,
)

from kvarena.integrations.transformers.tiny import save_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_in_process")

# the hybrid: KV blocks and states both (the attention-only path is the same
# shared-store code, run over one Redis in test_vllm_connector.py)
CASES = [("qwen3_next", None)]


@pytest.fixture
def cluster(tmp_path):
    from conftest import redis_binary

    from kvarena.testing.redis_server import RedisCluster

    c = RedisCluster(
        str(tmp_path / "cluster"), replicas=1, binary=redis_binary(), node_timeout_ms=1000
    )
    try:
        yield c
    finally:
        c.stop()


def _holds_kv_block(server) -> bool:
    """Whether a cluster node holds a KV block object (under the Redis tier's prefix)."""
    import redis

    from kvarena.tiers.names import ImageKind
    from kvarena.tiers.redis_tier import DEFAULT_PREFIX

    match = f"{DEFAULT_PREFIX}{ImageKind.KV_BLOCK.prefix}-*"
    client = redis.Redis(port=server.port)
    try:
        return next(client.scan_iter(match=match, count=1000), None) is not None
    finally:
        client.close()


@pytest.mark.parametrize(("kind", "block_size"), CASES)
def test_engines_share_a_cluster_and_a_killed_primary_costs_only_misses(
    cluster, tmp_path, kind, block_size
):
    model = save_tiny(kind, tmp_path)
    alone = engine(model, block_size=block_size)
    block = alone.llm_engine.vllm_config.cache_config.block_size
    prompts = prompts_for(block, seed=7)
    reference, _ = one_by_one(alone, prompts)
    close(alone)
    # an attention-only model resumes at its last token, a hybrid at its last full block
    hits = [
        len(p) - 1 if kind == "llama" else n * block
        for p, n in zip(prompts, PROMPT_BLOCKS, strict=True)
    ]

    first = engine(model, block_size=block_size, tiers=[cluster.url])
    tokens, _ = one_by_one(first, prompts)
    assert tokens == reference
    saved(first)
    close(first)

    second = engine(model, block_size=block_size, tiers=[cluster.url])
    try:
        tokens, cached = one_by_one(second, prompts)
        assert tokens == reference and cached == hits  # all of it from the cluster
        # a primary dies while the engine serves: the loads wait for its replica
        # (redis-py retries) or miss; never another token
        ports = {p.port for p in cluster.primaries()}  # the primaries as made
        # the first one killed holds a KV block of the prompts (each is one the
        # longest prompt's hit loads), so its shard, lost whole below, is needed:
        # slots are spread by names, and ~8 objects may all miss a given shard
        next(p for p in cluster.primaries() if _holds_kv_block(p)).stop()
        second.reset_prefix_cache()
        tokens, _ = one_by_one(second, prompts)
        assert tokens == reference
        # its replica promoted, every prompt hits again
        cluster.wait_ok()
        assert len(cluster.primaries()) == 3
        second.reset_prefix_cache()
        tokens, cached = one_by_one(second, prompts)
        assert tokens == reference and cached == hits
        # a shard lost whole (the promoted primary, which has no replica left):
        # the cluster refuses its slots, the loads fail, vLLM recomputes
        worker = worker_connector()._worker
        failures = worker.load_failures
        (promoted,) = [p for p in cluster.primaries() if p.port not in ports]
        promoted.stop()
        second.reset_prefix_cache()
        tokens, cached = one_by_one(second, prompts)
        assert tokens == reference
        assert worker.load_failures > failures or cached == [0] * len(prompts)
    finally:
        close(second)
