"""The prefix cache over tiers: write-back on eviction, lookups and hits across
tiers, byte-exact promotion, and every bad object refused (never copied)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import plan_for
from test_replay import SMALL, synthetic_lines

from kvarena import EntryField
from kvarena.pools import BlockAllocator
from kvarena.prefix import CheckpointPolicy, PrefixCache
from kvarena.replay import ReplayConfig, parse_trace, replay
from kvarena.tiers import DiskTier, HostTier, ImageKind, TierStack, object_name

PAGE = [EntryField("k", 2, (4, 8), torch.bfloat16)]
STATE = [
    EntryField("ssm", 2, (2, 16), torch.float32),
    EntryField("score", 1, (8,), torch.float32, fill=-math.inf, in_checkpoint=False),
]
BS = 4
POLICY = CheckpointPolicy.parse("end,interval:8,branch")


def make(tiers, budget=24 * 1024, state=STATE) -> PrefixCache:
    plan = plan_for(PAGE, state, budget, 2, block_size=BS)
    return PrefixCache(plan, "cpu", policy=POLICY, tiers=tiers)


def kv_pattern(key: bytes, n: int) -> np.ndarray:
    return np.resize(np.frombuffer(key, dtype=np.uint8), n)


def state_word(key: bytes) -> float:
    return float(int.from_bytes(key[:2], "little"))


def compute(pc: PrefixCache, request, tokens):
    """Admit, check what the hit restored, write the rest, keep images, finish."""
    adm = pc.admit(request, tokens)
    check_hit(pc, adm)
    h = adm.hit.tokens // BS
    for i in range(h, len(adm.keys)):
        pc.cache.block_bytes_of(adm.blocks[i]).numpy()[:] = kv_pattern(
            adm.keys[i], pc.cache.block_bytes
        )
    for b in adm.checkpoints:
        pc.cache.state_view("ssm")[:, adm.slots[0]].fill_(state_word(adm.keys[b - 1]))
        pc.checkpoint(request, b)
    pc.commit(request, len(tokens))
    pc.finish(request)
    pc.check_books()
    return adm


def check_hit(pc: PrefixCache, adm) -> None:
    h = adm.hit.tokens // BS
    for i in range(h):
        got = pc.cache.block_bytes_of(adm.blocks[i]).numpy()
        assert np.array_equal(got, kv_pattern(adm.keys[i], got.size)), (i, adm.hit.sources[i])
    if h:
        ssm = pc.cache.state_view("ssm")[:, adm.slots[0]]
        assert bool((ssm == state_word(adm.keys[h - 1])).all()), adm.hit.image_source


def prompts(n: int, length: int = 40, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, size=length) for _ in range(n)]


def test_evictions_write_back_and_hits_come_back_byte_exact(tmp_path):
    host = HostTier(16 * 1024, frame_bytes=512)
    disk = DiskTier(tmp_path, 1 << 20)
    pc = make(TierStack([host, disk]))
    ps = prompts(12)
    for i, p in enumerate(ps):
        compute(pc, i, p)
    m = pc.metrics
    assert m.evicted_blocks > 0 and m.tier_blocks_written >= m.evicted_blocks
    assert m.tier_images_written > 0 and len(disk) > 0
    # The first prompts left the device long ago: their hits come from the tiers.
    for i, p in enumerate(ps[:4]):
        lookup = pc.lookup(p)
        assert lookup.tokens == 32 and set(lookup.sources) - {"device"}  # images at 2,4,6,8
        compute(pc, 100 + i, p)  # checks every restored byte
    assert sum(m.tier_hit_tokens.values()) >= 3 * 32
    assert sum(m.tier_images_read.values()) >= 3 and m.tier_rejected == {}
    host.check_books()


def test_lookup_spans_tiers_without_taking_anything(tmp_path):
    pc = make(TierStack([DiskTier(tmp_path, 1 << 20)]))
    ps = prompts(8)
    for i, p in enumerate(ps):
        compute(pc, i, p)
    free, evictable = pc.cache.blocks.num_free, pc.cache.blocks.num_evictable
    hit = pc.lookup(ps[0])
    assert hit.tokens == 32 and hit.image_source == "disk"
    assert all(b == -1 for b, s in zip(hit.blocks, hit.sources, strict=True) if s == "disk")
    assert (pc.cache.blocks.num_free, pc.cache.blocks.num_evictable) == (free, evictable)


def _file(disk: Path, kind: ImageKind, key: bytes) -> Path:
    return disk / (object_name(kind, key) + ".kvi")


@pytest.mark.parametrize("fault", ["flip", "truncate", "other-model", "other-key"])
def test_a_bad_object_is_a_miss_deleted_and_never_copied(tmp_path, fault):
    disk_dir = tmp_path / "disk"
    pc = make(TierStack([DiskTier(disk_dir, 1 << 20)]))
    ps = prompts(8)
    for i, p in enumerate(ps):
        compute(pc, i, p)
    keys = pc.keys(ps[0])
    victim = _file(disk_dir, ImageKind.KV_BLOCK, keys[3])
    assert victim.exists() and pc.lookup(ps[0]).sources[3] == "disk"
    data = bytearray(victim.read_bytes())
    if fault == "flip":
        data[-5] ^= 0x10  # one bit of the payload
        victim.write_bytes(data)
        reason = "checksum"
    elif fault == "truncate":
        victim.write_bytes(data[:-100])
        reason = "truncated"
    elif fault == "other-key":
        victim.write_bytes(_file(disk_dir, ImageKind.KV_BLOCK, keys[4]).read_bytes())
        reason = "key"
    else:
        # The same tokens through a cache of another layout (a float16 state),
        # its file put where ours should be.
        other_state = [EntryField("ssm", 2, (2, 16), torch.float16), STATE[1]]
        other_dir = tmp_path / "other"
        other = make(TierStack([DiskTier(other_dir, 1 << 20)]), state=other_state)
        compute(other, 0, ps[0])
        other.drain()
        other_key = other.keys(ps[0])[3]
        victim.write_bytes(_file(other_dir, ImageKind.KV_BLOCK, other_key).read_bytes())
        reason = "namespace"
    assert pc.lookup(ps[0]).tokens == 32  # the lookup trusts the index; the load checks
    adm = compute(pc, "again", ps[0])  # check_hit: every byte that came back is right
    assert pc.metrics.tier_rejected == {reason: 1}
    assert not victim.exists()
    # Block 3 was refused, so the hit stops at the image before it (boundary 2).
    assert adm.hit.tokens == 2 * BS
    # What the request computed instead is cached again, and serves the next one: the
    # keys its first run had to evict are ghosts, so its known prefix ran through them
    # and it kept an image at their end too — the whole prompt resumes, up to the
    # contract's last block before the final token.
    assert pc.lookup(ps[0]).tokens == (len(ps[0]) - 1) // BS * BS == 36


def test_a_refused_write_down_refuses_the_whole_allocation():
    seen: list[list[int]] = []

    def hook(victims) -> None:
        seen.append([b for v in victims for b in v.blocks])
        raise RuntimeError("tier exploded")

    alloc = BlockAllocator(4)
    alloc.set_write_down(hook)
    blocks = alloc.allocate(4)
    for b in blocks:
        alloc.cache(b"k%d" % b, [b])
        alloc.release(b)
    with pytest.raises(RuntimeError, match="exploded"):
        alloc.allocate(2)
    assert seen == [[0, 1]]  # the LRU victims, together, before any change
    assert alloc.num_evictable == 4 and alloc.num_free == 0 and alloc.num_live == 0


def test_replay_over_tiers_is_byte_exact_and_a_second_run_hits_the_disk(tmp_path):
    trace = parse_trace(synthetic_lines(5, conversations=30))
    tiers = ("host:1MiB", f"disk:{tmp_path}/d:256MiB")
    base = dict(
        budget_bytes=2 << 20, max_seqs=2, policy=CheckpointPolicy.parse("end,end:512,branch")
    )
    plain = replay(SMALL, trace, ReplayConfig(**base, verify=True))
    first = replay(SMALL, trace, ReplayConfig(**base, verify=True, tiers=tiers))
    assert first.mismatches == 0 and plain.mismatches == 0
    assert first.hit_tokens > plain.hit_tokens  # what the device evicted came back
    by = first.verified_by_source
    assert by.get("host", 0) > 0 and by.get("disk", 0) > 0  # bytes from each tier checked
    assert sum(v for k, v in by.items() if "states" in k and "device" not in k) > 0
    assert {t["tier"] for t in first.tiers} == {"host", "disk"}
    # A second run over the same disk starts warm: the first request already hits.
    second = replay(SMALL, trace, ReplayConfig(**base, verify=True, tiers=(tiers[1],)))
    assert second.mismatches == 0 and second.hit_tokens > first.hit_tokens
    assert second.metrics["tier_hit_tokens"]["disk"] > 0


def test_bookkeeping_replays_tier_headers_only(tmp_path):
    trace = parse_trace(synthetic_lines(6, conversations=30))
    cfg = ReplayConfig(
        budget_bytes=2 << 20,
        max_seqs=2,
        tiers=(f"disk:{tmp_path}:64MiB",),
        policy=CheckpointPolicy.parse("end,end:512,branch"),
    )
    r = replay(SMALL, trace, cfg)
    disk = r.tiers[0]
    assert r.metrics["tier_hit_tokens"].get("disk", 0) > 0
    # Files hold headers only, while the capacity counts the payloads they stand for.
    on_disk = sum(p.stat().st_size for p in Path(tmp_path).iterdir())
    assert on_disk < disk["used_bytes"] / 4
    # A cache that holds bytes refuses those headers: a miss, counted, deleted.
    v = replay(SMALL, trace, dataclasses.replace(cfg, verify=True))
    assert v.mismatches == 0 and v.metrics["tier_rejected"].get("elided", 0) > 0


def test_a_kv_only_model_tiers_its_blocks(tmp_path):
    from kvarena import ModelCache

    kv_only = ModelCache.from_fields(SMALL.page_fields, [], block_size=16, name="kv-only")
    trace = parse_trace(synthetic_lines(5, conversations=20))
    cfg = ReplayConfig(
        budget_bytes=2 << 20,
        max_seqs=2,
        verify=True,
        tiers=("host:512KiB", f"disk:{tmp_path}:64MiB"),
    )
    r = replay(kv_only, trace, cfg)
    assert r.mismatches == 0 and r.metrics["tier_images_written"] == 0
    assert r.verified_by_source.get("host", 0) > 0 and r.verified_by_source.get("disk", 0) > 0


def test_a_miss_costs_one_small_probe_per_tier(tmp_path):
    class Counting(HostTier):
        probed = 0

        def contains_many(self, names):
            Counting.probed += len(names)
            return super().contains_many(names)

    pc = make(TierStack([Counting(16 * 1024, frame_bytes=512)]), budget=64 * 1024)
    long = np.arange(4 * 400)  # 400 blocks, none anywhere
    assert pc.lookup(long).tokens == 0
    assert Counting.probed == 32  # one window, not one name per block
    ps = prompts(12)
    for i, p in enumerate(ps):
        compute(pc, i, p)
    Counting.probed = 0
    hit = pc.lookup(ps[0])  # 9 blocks from the tier: one KV window, then the boundaries
    assert hit.tokens == 32 and Counting.probed <= 9 + 9


def test_the_tiers_example_hits_from_the_disk():
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[1] / "examples" / "tiers.py"
    out = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert "1536 of 2048 tokens hit; KV from ['disk'], state image from disk" in out


def test_drain_refuses_a_bad_batch(tmp_path):
    from kvarena.errors import InvalidValueError

    pc = make(TierStack([DiskTier(tmp_path, 1 << 20)]))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidValueError, match="drain: batch"):
            pc.drain(bad)
