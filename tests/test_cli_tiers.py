"""``kvarena tiers`` through the real command, on disk directories written by a
real disk tier and on a real ``redis-server``: ``stat`` counts what each
namespace holds, ``verify`` finds every object that fails (exit 1) and
``--fix`` removes exactly those, ``prune`` removes by namespace, age and size,
and a directory a live disk tier owns is read but never changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvarena.tiers import DiskTier, TierStack
from kvarena.tiers.checked import Expectations
from kvarena.tiers.inventory import namespace_id
from kvarena.tiers.names import ImageKind

BS = 16
VLLM_NS = json.dumps(
    {
        "format": "kvarena-vllm/1",
        "model": "Qwen/Qwen3-Next",
        "revision": "r1",
        "layout": "LBHNC",
        "tp": [0, 2],
    },
    sort_keys=True,
).encode()
PREFIX_NS = json.dumps(
    {"format": "kvarena-prefix/1", "model": "llama", "block_size": 16, "tp": [0, 1]}
).encode()


def objects(namespace: bytes, n_kv: int, n_state: int, seed: int):
    e = Expectations(namespace=namespace, block_size=BS, kv_bytes=256, state_bytes=512)
    out = []
    for i in range(n_kv):
        key = bytes([seed, i]) * 8
        out.append(e.encode(ImageKind.KV_BLOCK, key, i, [memoryview(bytes([i]) * 256)]))
    for i in range(n_state):
        key = bytes([seed, 100 + i]) * 8
        out.append(e.encode(ImageKind.STATE, key, i + 1, [memoryview(bytes([i]) * 512)]))
    return out


def kvarena(*args: str):
    return subprocess.run(
        [sys.executable, "-m", "kvarena", "tiers", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def filled(tmp_path):
    """A disk directory holding 5 KV blocks and 2 states of a vLLM engine and 3 KV
    blocks of kvarena's own prefix cache, written by a disk tier (then closed)."""
    d = tmp_path / "disk"
    tier = DiskTier(d, 1 << 20)
    TierStack([tier]).write_through(objects(VLLM_NS, 5, 2, 1) + objects(PREFIX_NS, 3, 0, 2))
    tier.close()
    return d


def test_stat_counts_each_namespaces_objects_bytes_and_ages(filled):
    r = kvarena("stat", str(filled), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    files = {p.name: p.stat().st_size for p in filled.glob("*.kvi")}
    assert doc["objects"] == len(files) == 10 and doc["bytes"] == sum(files.values())
    rows = {row["namespace"]: row for row in doc["namespaces"]}
    vllm, prefix = rows[namespace_id(VLLM_NS)], rows[namespace_id(PREFIX_NS)]
    assert (vllm["model"], vllm["revision"], vllm["layout"], vllm["rank"]) == (
        "Qwen/Qwen3-Next",
        "r1",
        "LBHNC",
        "0/2",
    )
    assert (vllm["kv_blocks"], vllm["states"]) == (5, 2)
    assert (prefix["model"], prefix["layout"], prefix["kv_blocks"]) == (
        "llama",
        "16-token blocks",
        3,
    )
    assert vllm["bytes"] + prefix["bytes"] == doc["bytes"]
    assert 0 <= vllm["newest_s"] <= vllm["oldest_s"] < 600
    table = kvarena("stat", f"disk:{filled}:1GiB")  # a tier spec names it too
    assert (
        table.returncode == 0 and "Qwen/Qwen3-Next" in table.stdout and "10 objects" in table.stdout
    )


def test_verify_lists_what_fails_and_fix_removes_exactly_those(filled):
    files = sorted(filled.glob("*.kvi"))
    flipped, cut, renamed = files[0], files[1], files[2]
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-10])
    renamed.rename(filled / "kv-0000000000000000000000000000dead.kvi")  # its header names another
    (filled / "kv-junk.kvi").write_bytes(b"not an image at all")  # 19 bytes
    r = kvarena("verify", str(filled), "--json")
    assert r.returncode == 1, r.stderr  # a verification that failed
    doc = json.loads(r.stdout)
    reasons = {os.path.basename(b["where"]): b["reason"] for b in doc["failed"]}
    assert reasons == {
        flipped.name: "checksum",
        cut.name: "truncated",
        "kv-0000000000000000000000000000dead.kvi": "key",
        "kv-junk.kvi": "truncated",  # shorter than any header
    }
    assert doc["checked"] == 11 and doc["removed"] == 0
    fixed = kvarena("verify", str(filled), "--fix", "--json")
    assert fixed.returncode == 0 and json.loads(fixed.stdout)["removed"] == 4
    assert len(list(filled.glob("*.kvi"))) == 7
    again = kvarena("verify", str(filled))
    assert again.returncode == 0 and "7 objects checked, 0 failed" in again.stdout


def test_prune_by_namespace_age_and_size(filled):
    files = {p: p.stat().st_size for p in filled.glob("*.kvi")}
    old = time.time() - 3 * 86400
    aged = sorted(files)[:4]
    for p in aged:
        os.utime(p, (old, old))
    dry = json.loads(
        kvarena("prune", str(filled), "--older-than", "2d", "--dry-run", "--json").stdout
    )
    assert dry["selected"] == 4 and dry["removed"] == 0 and len(list(filled.glob("*.kvi"))) == 10
    r = kvarena("prune", str(filled), "--older-than", "2d", "--json")
    assert json.loads(r.stdout)["removed"] == 4 and not any(p.exists() for p in aged)
    rows = {
        r["namespace"]: r
        for r in json.loads(kvarena("stat", str(filled), "--json").stdout)["namespaces"]
    }
    held_by_prefix = rows[namespace_id(PREFIX_NS)]["objects"]
    r = kvarena("prune", str(filled), "--namespace", namespace_id(PREFIX_NS), "--json")
    assert json.loads(r.stdout)["removed"] == held_by_prefix
    after = json.loads(kvarena("stat", str(filled), "--json").stdout)
    assert [row["namespace"] for row in after["namespaces"]] == [namespace_id(VLLM_NS)]
    left = sorted(filled.glob("*.kvi"), key=lambda p: p.stat().st_mtime_ns)
    cap = sum(p.stat().st_size for p in left) - 1  # one byte too many: the oldest goes
    r = json.loads(kvarena("prune", str(filled), "--to-size", str(cap), "--json").stdout)
    assert r["removed"] == 1 and r["left_bytes"] <= cap and not left[0].exists()


def test_a_directory_a_live_engine_owns_is_read_never_changed(filled):
    owner = DiskTier(filled, 1 << 20)  # this process holds the directory, as an engine would
    try:
        assert kvarena("stat", str(filled), "--json").returncode == 0
        r = kvarena("prune", str(filled), "--older-than", "0s")
        assert r.returncode == 2 and f"in use by process {os.getpid()}" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert len(list(filled.glob("*.kvi"))) == 10  # nothing removed
    finally:
        owner.close()
    assert kvarena("prune", str(filled), "--older-than", "0s").returncode == 0
    assert list(filled.glob("*.kvi")) == []


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["stat", "/nonexistent/kv"], "not a directory"),
        (["prune", "{d}"], "name what to remove"),
        (["prune", "{d}", "--older-than", "3x"], "not a duration"),
        (["prune", "{d}", "--to-size", "lots"], "not a size"),
        (["prune", "{d}", "--namespace", "ffffffffffff"], "names no namespace here"),
        (["stat", "host:1GiB"], "host tier lives in an engine's memory"),
        (["stat", "redis://127.0.0.1:1"], "cannot reach the store"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(filled, args, words):
    r = kvarena(*[a.format(d=filled) for a in args])
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def _stat_verify_prune(url: str, store) -> None:
    """``kvarena tiers`` over a Redis store ``url`` (``store``: a client of it)."""
    from kvarena.tiers.spec import TierSpec

    tier = TierSpec.parse(url).open()
    objs = objects(VLLM_NS, 4, 1, 3) + objects(PREFIX_NS, 2, 0, 4)
    TierStack([tier]).write_through(objs)
    doc = json.loads(kvarena("stat", url, "--json").stdout)
    assert doc["objects"] == 7
    rows = {r["namespace"]: r for r in doc["namespaces"]}
    assert (rows[namespace_id(VLLM_NS)]["kv_blocks"], rows[namespace_id(VLLM_NS)]["states"]) == (
        4,
        1,
    )
    key = tier.prefix + objs[0].name
    value = bytearray(store.get(key))
    value[-1] ^= 1
    store.set(key, bytes(value))
    r = kvarena("verify", url, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["failed"][0]["reason"] == "checksum"
    r = kvarena("verify", url, "--fix", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["failed"][0]["reason"] == "checksum"
    assert store.exists(key) == 0
    r = kvarena("prune", url, "--namespace", namespace_id(PREFIX_NS), "--json")
    assert json.loads(r.stdout)["removed"] == 2
    assert json.loads(kvarena("stat", url, "--json").stdout)["objects"] == 4
    tier.close()


def test_a_redis_store_stat_verify_prune(redis_server):
    import redis

    _stat_verify_prune(
        f"redis://127.0.0.1:{redis_server.port}",
        redis.Redis(host="127.0.0.1", port=redis_server.port),
    )


def test_a_redis_cluster_stat_verify_prune(tmp_path):
    """The same over a Redis Cluster of three primaries: every object read and
    every removal goes to the node holding its key (a multi-key command over
    slots would be refused by the cluster)."""
    import redis
    from conftest import redis_binary

    from kvarena.testing.redis_server import RedisCluster

    with RedisCluster(str(tmp_path), binary=redis_binary()) as cluster:
        port = cluster.servers[0].port
        _stat_verify_prune(cluster.url, redis.RedisCluster(host="127.0.0.1", port=port))
