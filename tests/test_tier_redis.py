"""The shared tier against a real redis-server: round trips, the prefix cache
over it, two servers sharing one store, and the store going away mid-run."""

from __future__ import annotations

import warnings

import pytest
from test_replay import SMALL, synthetic_lines
from test_tier_prefix import compute, make, prompts

from kvarena.errors import InvalidValueError
from kvarena.prefix import CheckpointPolicy
from kvarena.replay import ReplayConfig, parse_trace, replay
from kvarena.tiers import ImageKind, Put, RedisTier, TierStack, TierWarning, encode, parse_tier


def images(n: int) -> list:
    """``n`` KV images whose payloads have a small part and (from 8 on) a large one."""
    return [
        encode(
            kind=ImageKind.KV_BLOCK,
            namespace=b"ns",
            key=bytes([i]) * 16,
            start=0,
            end=16,
            payload=[bytes([i]) * (1000 + i), bytes([i]) * (i << 13)],
            payload_bytes=1000 + i + (i << 13),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("direct", [True, False])  # straight to the socket / a pipeline
def test_redis_tier_round_trip(redis_server, direct):
    tier = RedisTier(redis_server.url, direct_writes=direct)
    assert tier.capacity_bytes == 256 << 20 and isinstance(parse_tier(redis_server.url), RedisTier)
    objs = images(20)
    assert tier.put_many(objs) == Put()  # the server evicts, nothing comes back
    names = [o.name for o in objs]
    assert tier.contains_many([*names, "kv-none"]) == [True] * 20 + [False]
    got = tier.get_many([*names, "kv-none"])
    assert [bytes(g) for g in got[:-1]] == [o.to_bytes() for o in objs] and got[-1] is None
    assert tier.delete_many(names[:5]) == 5
    assert tier.contains_many(names[:6]) == [False] * 5 + [True]
    tier.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_store_out_of_memory_names_the_writes_it_refused(redis_server, direct):
    """A server at its ``maxmemory`` under ``noeviction`` answers SETs with an
    error: a put names those objects refused (a batch, whole: here one object
    a put, each SET its own batch), and no name outside the refused is missing
    from the store."""
    import redis

    admin = redis.Redis(port=redis_server.port)
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", used + (256 << 10))
    admin.config_set("maxmemory-policy", "noeviction")
    tier = RedisTier(redis_server.url, direct_writes=direct)
    objs = images(40)  # 6.4 MB: past the room
    with pytest.warns(TierWarning, match="maxmemory"):
        puts = [tier.put_many([o]) for o in objs]
    names = [o.name for o in objs]
    refused = [n for p in puts for n in p.refused]
    assert all(p.evicted == [] for p in puts) and 0 < len(refused) < len(names)
    held = tier.contains_many(names)
    assert [n for n, h in zip(names, held, strict=True) if not h] == refused
    admin.close()
    tier.close()


def test_two_servers_share_one_store(redis_server):
    """What one server evicted into the store, another (a fresh cache) hits."""
    ps = prompts(8)
    first = make(TierStack([parse_tier(redis_server.url)]))
    for i, p in enumerate(ps):
        compute(first, i, p)
    first.drain()
    second = make(TierStack([parse_tier(redis_server.url)]))
    for i, p in enumerate(ps):
        adm = compute(second, i, p)  # compute checks every restored byte
        assert adm.hit.tokens == 32 and set(adm.hit.sources) == {"redis"}
    assert second.metrics.tier_hit_tokens["redis"] == 8 * 32
    assert second.metrics.tier_rejected == {}


def test_the_store_going_away_costs_misses_and_one_warning(redis_server):
    pc = make(TierStack([RedisTier(redis_server.url, timeout_s=0.5)]))
    ps = prompts(10)
    for i, p in enumerate(ps):
        compute(pc, i, p)
    tier = pc.tiers.tiers[0]
    assert len(tier) > 0 and "redis" in pc.lookup(ps[0]).sources
    redis_server.stop()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i, p in enumerate(ps):
            adm = compute(pc, f"down{i}", p)  # serving goes on, every hit still right
            assert "redis" not in adm.hit.sources
    ours = [w for w in seen if issubclass(w.category, TierWarning)]
    assert len(ours) == 1 and "redis" in str(ours[0].message)
    assert tier.metrics.failures > 1
    # The store comes back (empty: it kept nothing): writes and hits work again.
    redis_server.start()
    puts = tier.metrics.puts
    fresh = prompts(10, seed=1)
    for i, p in enumerate(fresh):
        compute(pc, f"up{i}", p)
    assert tier.metrics.puts > puts
    hit = pc.lookup(fresh[0])
    assert hit.tokens == 32 and "redis" in hit.sources


def test_replay_over_redis_verifies_and_a_second_run_hits(redis_server):
    trace = parse_trace(synthetic_lines(7, conversations=30))
    cfg = ReplayConfig(
        budget_bytes=2 << 20,
        max_seqs=2,
        verify=True,
        tiers=(redis_server.url,),
        policy=CheckpointPolicy.parse("end,end:512,branch"),
    )
    first = replay(SMALL, trace, cfg)
    assert first.mismatches == 0 and first.metrics["tier_hit_tokens"].get("redis", 0) > 0
    assert first.verified_by_source.get("redis", 0) > 0
    second = replay(SMALL, trace, cfg)
    assert second.mismatches == 0 and second.hit_tokens > first.hit_tokens


def test_the_same_code_runs_on_a_redis_cluster(tmp_path):
    from conftest import redis_binary

    from kvarena.testing.redis_server import RedisCluster

    with RedisCluster(str(tmp_path), binary=redis_binary()) as cluster:
        tier = parse_tier(cluster.url)
        objs = images(24)
        tier.put_many(objs)
        names = [o.name for o in objs]
        assert tier.metrics.failures == 0 and tier.contains_many(names) == [True] * 24
        got = tier.get_many(names)
        assert [bytes(g) for g in got] == [o.to_bytes() for o in objs]
        assert tier.delete_many(names[:5]) == 5
        # The keys really spread over the nodes (one store, three servers).
        import redis

        counts = [redis.Redis(port=s.port).dbsize() for s in cluster.servers]
        assert sum(counts) == 19 and sum(1 for c in counts if c) >= 2
        # listed whole, every node's keys (what an engine's catalogue lists)
        assert sorted(tier.names() or []) == sorted(names[5:])
        assert sorted(tier.names(0.25) or []) == sorted(names[5:])  # resting between batches
        # Two caches over the cluster: what one drained, the other hits.
        ps = prompts(6)
        first = make(TierStack([parse_tier(cluster.url)]))
        for i, p in enumerate(ps):
            compute(first, i, p)
        first.drain()
        second = make(TierStack([parse_tier(cluster.url)]))
        adm = compute(second, 0, ps[0])
        assert adm.hit.tokens == 32 and set(adm.hit.sources) == {"redis"}


def test_a_cluster_resharded_while_serving_costs_at_most_misses(tmp_path):
    """Slots moved from one primary to another (``redis-cli --cluster reshard``)
    while the tier reads and writes: a read during the move is a hit with the
    right bytes or a miss, never other bytes; once moved, every object is
    where the cluster says and every read hits."""
    import shutil
    import subprocess

    import redis
    from conftest import redis_binary

    from kvarena.testing.redis_server import RedisCluster

    with RedisCluster(str(tmp_path), binary=redis_binary()) as cluster:
        tier = parse_tier(cluster.url)
        objs = images(40)
        tier.put_many(objs)
        names = [o.name for o in objs]
        want = {o.name: o.to_bytes() for o in objs}
        ids = [redis.Redis(port=s.port).cluster("myid") for s in cluster.servers]
        ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
        before = [redis.Redis(port=s.port).dbsize() for s in cluster.servers]
        move = subprocess.Popen(
            [
                shutil.which("redis-cli"),
                "--cluster",
                "reshard",
                f"127.0.0.1:{cluster.servers[0].port}",
                "--cluster-from",
                ids[0],
                "--cluster-to",
                ids[1],
                "--cluster-slots",
                "5461",
                "--cluster-yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        reads = hits = 0
        while move.poll() is None or reads < 20:
            got = tier.get_many(names)
            reads += 1
            for name, data in zip(names, got, strict=True):
                if data is not None:
                    hits += 1
                    assert bytes(data) == want[name]
            tier.put_many(images(2))  # writes go on during the move
        assert move.wait() == 0
        cluster.wait_ok()
        after = [redis.Redis(port=s.port).dbsize() for s in cluster.servers]
        # every key of the first primary's slots now on the second (an emptied
        # primary becomes its replica: Redis's replica migration)
        assert before[0] > 0 and after[1] == before[0] + before[1]
        got = tier.get_many(names)
        assert [bytes(g) for g in got] == [want[n] for n in names]
        assert hits > 0
        tier.close()


def test_a_listing_that_rests_between_batches_lists_every_name(redis_server, monkeypatch):
    """``names(duty)``: the same names, over many ``SCAN`` batches, with a rest
    after each batch of them (counted, not timed)."""
    from kvarena.tiers import duty

    tier = parse_tier(f"redis://127.0.0.1:{redis_server.port}")
    tier.client.mset({f"{tier.prefix}kv-{i:05d}": b"x" for i in range(2500)})
    tier.client.set("other:kv-x", b"x")  # another prefix: not this tier's
    rests = []
    monkeypatch.setattr(duty.time, "sleep", rests.append)
    assert sorted(tier.names(0.25) or []) == [f"kv-{i:05d}" for i in range(2500)]
    assert len(rests) == 2  # after the 1,000th and the 2,000th name
    assert tier.names() is not None and len(rests) == 4
    with pytest.raises(InvalidValueError, match="duty"):
        tier.names(2.0)
