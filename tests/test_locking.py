"""Several threads, one prefix cache and its tiers: every call is whole (a lock per
object), so the books hold, every hit's bytes are right and nothing is left live."""

from __future__ import annotations

import random
import sys
import threading

import numpy as np
import pytest
from test_tier_prefix import check_hit, compute, make, prompts
from test_tiers import object_files

from kvarena.pools import BlockAllocationError, StateAllocationError
from kvarena.tiers import DiskTier, HostTier, TierStack


@pytest.fixture
def fine_switching():
    """Switch threads every microsecond: interleavings a default interval rarely shows."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_threads_share_one_prefix_cache_and_its_tiers(tmp_path, fine_switching):
    host = HostTier(8 * 1024, frame_bytes=512)
    disk = DiskTier(tmp_path, 48 * 1024)
    pc = make(TierStack([host, disk]), budget=40 * 1024)
    base = prompts(4, length=24, seed=3)
    pool = [np.concatenate([base[i % 4], tail]) for i, tail in enumerate(prompts(8, 16, 4))]
    errors: list[BaseException] = []
    done = {"computed": 0, "refused": 0, "looked": 0}
    count_lock = threading.Lock()  # += on a shared dict is not atomic across threads

    def count(what: str) -> None:
        with count_lock:
            done[what] += 1

    start = threading.Barrier(5)

    def worker(wid: int) -> None:
        rng = random.Random(wid)
        start.wait()
        for i in range(40):
            tokens = pool[rng.randrange(len(pool))]
            try:
                compute(pc, (wid, i), tokens)  # admit, check the hit's bytes, write, finish
                count("computed")
            except (BlockAllocationError, StateAllocationError):
                count("refused")  # the pools are full right now: a clean refusal
            except BaseException as exc:
                errors.append(exc)
                return

    def reader() -> None:
        rng = random.Random(99)
        start.wait()
        for _ in range(150):
            try:
                pc.lookup(pool[rng.randrange(len(pool))])
                if rng.random() < 0.1:
                    pc.drain()
                count("looked")
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert errors == [], errors[:3]
    assert done["computed"] + done["refused"] == 4 * 40 and done["computed"] >= 10
    assert done["looked"] == 150
    pc.check_books()
    assert pc.cache.blocks.num_live == 0 and pc.cache.slots.num_live == 0
    host.check_books()
    assert host.used_bytes <= host.capacity_bytes
    assert sorted(n + ".kvi" for n in disk.names()) == object_files(tmp_path)
    assert disk.used_bytes <= disk.capacity_bytes
    # And what the tiers hold is still right: a last request hits byte-exact.
    adm = pc.admit("last", pool[0])
    check_hit(pc, adm)
    pc.finish("last")
