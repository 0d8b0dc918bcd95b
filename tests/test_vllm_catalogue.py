"""The scheduler's book of the tiers: a lookup is answered from memory, never
by a disk or a network on the scheduler's thread. The disk directories are read
once at start, the shared store listed at start and again in the background,
and the workers' reports keep both between; what it lists stale costs a failed
load (vLLM recomputes), which the scheduler tests cover.

Runs in the ``.venv-vllm`` environment; skipped where vLLM is not installed.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from kvarena.integrations.vllm.catalogue import Catalogue
from kvarena.integrations.vllm.settings import ConnectorSettings
from kvarena.tiers.image import ImageKind, object_name

NAMES = [object_name(ImageKind.KV_BLOCK, bytes([i]) * 16) for i in range(6)]


def test_the_disk_is_read_at_start_and_kept_by_reports_without_io(tmp_path, monkeypatch):
    disk = tmp_path / "kv"
    for r, names in ((0, NAMES[:2]), (1, NAMES[2:3])):
        (disk / f"tp{r}").mkdir(parents=True)
        for n in names:
            (disk / f"tp{r}" / f"{n}.kvi").write_bytes(b"x")
    (disk / "tp0" / ".kv-partial.123.ab.tmp").write_bytes(b"x")  # a temporary: not an object
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", f"disk:{disk}:1GiB"]})
    catalogue = Catalogue(settings, ranks=2)

    def no_io(*_a, **_k):
        raise AssertionError("a lookup touched the filesystem")

    monkeypatch.setattr(os, "scandir", no_io)
    monkeypatch.setattr(os, "stat", no_io)
    monkeypatch.setattr(os.path, "isfile", no_io)
    assert catalogue.locate(NAMES[:4]) == [1, 1, 1, None]
    catalogue.hosted([NAMES[0]], [])
    catalogue.written([NAMES[3]])  # written through by a worker
    catalogue.reported("disk", [], [NAMES[1]])  # evicted by the disk tier
    assert catalogue.locate(NAMES[:5]) == [0, None, 1, 1, None]
    catalogue.close()


def test_the_store_is_listed_at_start_and_again_and_never_asked_by_a_lookup(redis_server):
    from kvarena.tiers.spec import TierSpec

    url = f"redis://127.0.0.1:{redis_server.port}"
    other = TierSpec.parse(url).open()  # another engine's writes
    from kvarena.tiers import TierObject

    other.put_many([TierObject(n, (b"x",), 1) for n in NAMES[:2]])
    settings = ConnectorSettings.parse({"tiers": ["host:1GiB", url]})
    catalogue = Catalogue(settings, rescan_s=3600)  # listings only where the test asks
    try:
        assert catalogue.locate(NAMES[:3]) == [1, 1, None]  # listed at start
        other.put_many([TierObject(NAMES[2], (b"x",), 1)])
        other.delete_many([NAMES[0]])  # its server evicted one
        catalogue.written([NAMES[4]])  # this engine's own write: known at once
        assert catalogue.locate([NAMES[0], NAMES[2], NAMES[4]]) == [1, None, 1]  # stale until...
        catalogue._relist()  # ...the next listing: the store's truth
        assert catalogue.locate([NAMES[0], NAMES[2], NAMES[4]]) == [None, 1, None]
        other.put_many([TierObject(NAMES[4], (b"x",), 1)])
        catalogue._relist()
        assert catalogue.locate([NAMES[0], NAMES[2], NAMES[4]]) == [None, 1, 1]
        redis_server.stop()  # the store gone: lookups still answer, at once, from memory
        assert catalogue.locate([NAMES[2]]) == [1]
        catalogue._relist()  # a failed listing keeps what is known
        assert catalogue.locate([NAMES[2]]) == [1]
    finally:
        catalogue.close()
        other.close()
