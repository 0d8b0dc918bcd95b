"""The shared tier: a Redis (or Valkey, or Redis Cluster) store many servers use.

Objects are plain string values under ``PREFIX + name``; every batch is one
pipeline (one round trip), and only single-key commands are used (SET, GET,
EXISTS, UNLINK), so the same code runs against one server, Valkey, or a
Redis Cluster, where redis-py routes each key to its node and splits the
pipeline by node.

Capacity and LRU are the server's: the store is shared, so no one client can
know what the others wrote. Run the server with ``maxmemory`` and
``maxmemory-policy allkeys-lru``; this tier reads the limit back for its
report. Its evictions happen on the server and are not handed to a lower tier
(``cascades`` is False), so it belongs at the bottom of the stack.

A store that goes away mid-run costs misses and dropped writes, with one
warning; redis-py reconnects on the next command, so the tier serves again as
soon as the store is back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import Tier, TierError
from .image import TierObject

DEFAULT_PREFIX = "kvarena:"
BATCH_BYTES = 64 << 20
"""Bytes per put pipeline: large enough to amortise the round trip, small
enough that the reused scratch buffer stays modest."""


def _redis() -> Any:
    try:
        import redis
    except ImportError:
        raise TierError("the redis tier needs redis-py: pip install 'kvarena[redis]'") from None
    return redis


class RedisTier(Tier):
    kind = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = 2.0,
        cluster: bool = False,
    ) -> None:
        super().__init__()
        redis = _redis()
        self.url = url
        self.prefix = prefix
        self._errors = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.RedisError,
            OSError,
        )
        try:
            factory = redis.RedisCluster if cluster else redis.Redis
            self._client = factory.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
        except (ValueError, *self._errors) as exc:
            raise TierError(f"redis tier {url}: {exc}") from None
        self._capacity = 0
        try:
            info = self._client.info("memory")
            self._capacity = int(info.get("maxmemory", 0))
        except self._errors as exc:
            self._failed("connect", exc)
        self._scratch = bytearray()
        self._count = 0  # objects this client wrote and has not seen go (an estimate)

    def describe(self) -> str:
        return f"redis {self.url}"

    @property
    def cascades(self) -> bool:
        return False

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        try:
            used = int(self._client.info("memory").get("used_memory", 0))
        except self._errors as exc:
            self._failed("info", exc)
            return 0
        self._worked()
        return used

    def __len__(self) -> int:
        return self._count

    def _keys(self, names: Sequence[str]) -> list[str]:
        return [self.prefix + n for n in names]

    def _pipeline(self, op: str, build: Any) -> list[Any] | None:
        try:
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            result = pipe.execute()
        except self._errors as exc:
            self._failed(op, exc)
            return None
        self._worked()
        return list(result)

    def put_many(
        self, objects: Sequence[TierObject], *, want_evicted: bool = True
    ) -> list[TierObject]:
        """SETs in pipelines of about ``BATCH_BYTES``; each value is its object's
        parts laid end to end in one reused scratch buffer (a SET takes one value,
        and fresh buffers per object cost more in page faults than the copy)."""
        i = 0
        while i < len(objects):
            chunk: list[TierObject] = []
            total = 0
            while i < len(objects) and (
                not chunk or total + objects[i].stored_bytes <= BATCH_BYTES
            ):
                chunk.append(objects[i])
                total += objects[i].stored_bytes
                i += 1
            if len(self._scratch) < total:
                self._scratch = bytearray(total)
            mv = memoryview(self._scratch)
            values, pos = [], 0
            for obj in chunk:
                start = pos
                for part in obj.parts:
                    n = memoryview(part).nbytes
                    mv[pos : pos + n] = memoryview(part).cast("B")
                    pos += n
                values.append(mv[start:pos])
            keys = self._keys([o.name for o in chunk])

            def build(pipe: Any, keys: list[str] = keys, values: list[memoryview] = values) -> None:
                for key, value in zip(keys, values, strict=True):
                    pipe.set(key, value)

            if self._pipeline("put", build) is not None:
                self.metrics.puts += len(chunk)
                self.metrics.put_bytes += sum(o.logical_bytes for o in chunk)
                self._count += len(chunk)
        return []

    def get_many(self, names: Sequence[str]) -> list[bytes | bytearray | memoryview | None]:
        if not names:
            return []
        self.metrics.gets += len(names)
        keys = self._keys(names)

        def build(pipe: Any) -> None:
            for k in keys:
                pipe.get(k)

        got = self._pipeline("get", build)
        out: list[bytes | bytearray | memoryview | None] = (
            list(got) if got is not None else [None] * len(names)
        )
        for v in out:
            if v is None:
                self.metrics.misses += 1
            else:
                self.metrics.hits += 1
                self.metrics.get_bytes += len(v)
        return out

    def contains_many(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        keys = self._keys(names)

        def build(pipe: Any) -> None:
            for k in keys:
                pipe.exists(k)

        got = self._pipeline("exists", build)
        return [bool(v) for v in got] if got is not None else [False] * len(names)

    def delete_many(self, names: Sequence[str]) -> int:
        if not names:
            return 0
        keys = self._keys(names)

        def build(pipe: Any) -> None:
            for k in keys:
                pipe.unlink(k)

        got = self._pipeline("delete", build)
        n = sum(int(v) for v in got) if got is not None else 0
        self.metrics.deletes += n
        self._count = max(0, self._count - n)
        return n

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass
