"""The Mooncake Store tier: the field's clustered store, one master and a pool of
segments every client contributes.

Mooncake Store (kvcache-ai/Mooncake, the store behind vLLM's, SGLang's and
LMCache's Mooncake backends) places objects in segments of host memory that
its clients mount into one pool, behind a master that knows where each
object lives; a client reads and writes through its transfer engine (TCP
here, RDMA where the hardware has it). Its non-CUDA wheel
(``mooncake-transfer-engine-non-cuda``) runs on a CPU machine.

Objects are kvarena's sealed images, as in every shared tier, checked on load
by the same code. The transfer engine moves bytes between registered memory
alone, so the tier registers one staging buffer at start and every batch is
one call into it and out of it (``batch_put_from``, ``batch_get_into``): no
allocation per object on either side, one copy between the buffer and the
caller. Capacity and eviction are the store's (the pool is shared): like
Redis it belongs at the bottom of a stack (``cascades`` is False). A store
that goes away costs misses and dropped writes, with one warning.

Spec: ``mooncake://HOST:PORT[/SEGMENT]`` — the master's RPC address, and the
host memory this process contributes to the pool (1 GiB by default; each
tensor-parallel rank its share).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..checks import check_bytes
from ..errors import InvalidValueError
from ..locking import synchronized
from .base import Put, Tier, TierError
from .image import TierObject, logical_bytes

DEFAULT_SEGMENT_BYTES = 1 << 30
STAGING_BYTES = 64 << 20
"""The registered buffer every batch passes through: large enough for a batch
of blocks, small enough to register once per process."""
_TOO_SMALL = -600  # the buffer given for an object is smaller than it
_OBJECT_CODES = (_TOO_SMALL, -704, -706)  # too large for its share, not found, leased
"""Codes about one object; any other negative code says the store failed (an
unreachable master answers -900 for every key), which is warned of once."""


def _mooncake() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise TierError(
            "mooncake tier: the Mooncake client is not installed (pip install "
            f"'kvarena[mooncake]': mooncake-transfer-engine-non-cuda): {exc}"
        ) from None
    return MooncakeDistributedStore


class MooncakeTier(Tier):
    kind = "mooncake"

    def __init__(
        self,
        master: str,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        staging_bytes: int = STAGING_BYTES,
        local_host: str = "127.0.0.1",
        protocol: str = "tcp",
    ) -> None:
        super().__init__()
        if not isinstance(master, str) or master.count(":") != 1:
            raise InvalidValueError(f"mooncake tier: master must be HOST:PORT, got {master!r}")
        self.master = master
        self.segment_bytes = check_bytes(segment_bytes, "mooncake tier: segment_bytes", lo=1 << 20)
        staging = check_bytes(staging_bytes, "mooncake tier: staging_bytes", lo=1 << 20)
        self._store = _mooncake()()
        rc = self._store.setup(
            local_host, "P2PHANDSHAKE", self.segment_bytes, staging, protocol, "", master
        )
        if rc != 0:
            raise TierError(f"mooncake tier: no master at {master} (setup returned {rc})")
        self._buf = np.zeros(staging, dtype=np.uint8)
        self._ptr = int(self._buf.ctypes.data)
        if self._store.register_buffer(self._ptr, staging) != 0:
            self._store.close()
            raise TierError("mooncake tier: the transfer engine refused the staging buffer")
        self._count = 0  # objects this client wrote and has not seen go (an estimate)
        self._used = 0
        self._largest = 0  # the largest object put or got: how many a read takes at once

    def describe(self) -> str:
        return f"mooncake {self.master} ({self.segment_bytes:,} B contributed)"

    @property
    def cascades(self) -> bool:
        return False

    @property
    def capacity_bytes(self) -> int:
        return 0  # the pool's, shared with every client

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return self._count

    def _batches(self, sizes: Sequence[int]) -> list[range]:
        """Consecutive runs of items whose sizes fit the staging buffer together
        (an item larger than the buffer alone: a run of its own, refused)."""
        out, start, total = [], 0, 0
        for i, n in enumerate(sizes):
            if i > start and total + n > self._buf.nbytes:
                out.append(range(start, i))
                start, total = i, 0
            total += n
        if start < len(sizes):
            out.append(range(start, len(sizes)))
        return out

    @synchronized
    def put_many(self, objects: Sequence[TierObject], *, want_evicted: bool = True) -> Put:
        objects = self.stored(objects)
        refused: list[str] = []
        for run in self._batches([o.stored_bytes for o in objects]):
            chunk = [objects[i] for i in run]
            if chunk[0].stored_bytes > self._buf.nbytes:
                self.metrics.skipped += 1
                refused.append(chunk[0].name)
                continue
            ptrs, at = [], 0
            for obj in chunk:
                ptrs.append(self._ptr + at)
                for part in obj.parts:
                    view = np.frombuffer(part, dtype=np.uint8)
                    self._buf[at : at + view.size] = view
                    at += view.size
            try:
                codes = self._store.batch_put_from(
                    [o.name for o in chunk], ptrs, [o.stored_bytes for o in chunk]
                )
            except Exception as exc:  # the client's own errors: a miss, never a crash
                self._failed("put", exc)
                refused.extend(o.name for o in chunk)
                continue
            if self._store_failed("put", codes):
                self.metrics.skipped += len(chunk)
                refused.extend(o.name for o in chunk)
                continue
            for obj, rc in zip(chunk, codes, strict=True):
                if rc == 0:
                    self._largest = max(self._largest, obj.stored_bytes)
                    self.metrics.puts += 1
                    self.metrics.put_bytes += obj.logical_bytes
                    self._count += 1
                    self._used += obj.logical_bytes
                else:
                    self.metrics.skipped += 1
                    refused.append(obj.name)
            self._worked()
        return Put(refused=refused)

    @synchronized
    def get_many(self, names: Sequence[str]) -> list[bytes | bytearray | memoryview | None]:
        """Each object read into its share of the staging buffer, as many at a
        time as the largest object seen so far lets; one found larger than its
        share is read again alone (the rest miss)."""
        out: list[bytes | bytearray | memoryview | None] = [None] * len(names)
        failures = self.metrics.failures
        try:
            per_run = max(1, self._buf.nbytes // max(self._largest, 4096))
            big = self._read(list(range(len(names))), names, out, per_run)
            sizes = [self._store.get_size(names[i]) for i in big]
            alone = [i for i, n in zip(big, sizes, strict=True) if 0 < n <= self._buf.nbytes]
            self._largest = max([self._largest, *sizes])
            self._read(alone, names, out, 1)
        except Exception as exc:  # the client's own errors: a miss, never a crash
            self._failed("get", exc)
            return [None] * len(names)
        for data in out:
            self.metrics.gets += 1
            if data is None:
                self.metrics.misses += 1
            else:
                self.metrics.hits += 1
                self.metrics.get_bytes += logical_bytes(data)
        if self.metrics.failures == failures:
            self._worked()
        return out

    def _read(
        self, items: list[int], names: Sequence[str], out: list[Any], per_run: int
    ) -> list[int]:
        """Read ``items`` in runs of ``per_run``, each with an equal share of the
        buffer, into ``out``; those larger than their share."""
        larger = []
        for k in range(0, len(items), per_run):
            run = items[k : k + per_run]
            share = self._buf.nbytes // len(run)
            offsets = [j * share for j in range(len(run))]
            codes = self._store.batch_get_into(
                [names[i] for i in run], [self._ptr + o for o in offsets], [share] * len(run)
            )
            if self._store_failed("get", codes):
                continue
            for i, at, rc in zip(run, offsets, codes, strict=True):
                if rc >= 0:
                    out[i] = bytes(self._buf[at : at + rc])
                elif rc == _TOO_SMALL:
                    larger.append(i)
        return larger

    @synchronized
    def contains_many(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        try:
            codes = self._store.batch_is_exist(list(names))
        except Exception as exc:
            self._failed("exists", exc)
            return [False] * len(names)
        if self._store_failed("exists", codes, ok=(0, 1)):
            return [False] * len(names)
        self._worked()
        return [rc == 1 for rc in codes]

    @synchronized
    def delete_many(self, names: Sequence[str]) -> int:
        if not names:
            return 0
        try:
            codes = self._store.batch_remove(list(names), True)  # a read's lease does not hold it
        except Exception as exc:
            self._failed("delete", exc)
            return 0
        if self._store_failed("delete", codes):
            return 0
        n = sum(rc == 0 for rc in codes)
        self.metrics.deletes += n
        self._count = max(0, self._count - n)
        return n

    def _store_failed(self, op: str, codes: Sequence[int], ok: Sequence[int] = ()) -> bool:
        """Whether ``codes`` say the store itself failed (counted, warned of once)."""
        bad = next(
            (rc for rc in codes if rc < 0 and rc not in _OBJECT_CODES and rc not in ok), None
        )
        if bad is None:
            return False
        self._failed(op, TierError(f"Mooncake error code {bad} from {self.master}"))
        return True

    @synchronized
    def close(self) -> None:
        try:
            self._store.close()
        except Exception:
            pass
