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

from ..checks import check_timeout
from ..errors import InvalidValueError
from ..locking import synchronized
from .base import Put, Tier, TierError
from .duty import DutyCycle
from .image import TierObject, logical_bytes
from .redact import redacted

DEFAULT_PREFIX = "kvarena:"
INLINE_BYTES = 64 << 10
"""Payload parts below this are gathered into the command bytes; larger ones
are sent from where they lie."""
_OK = (b"OK", "OK", True)
_NONE = object()
_SCAN_COUNT = 1000  # keys a SCAN asks for a round trip
BATCH_BYTES = 64 << 20
"""Bytes per put pipeline: large enough to amortise the round trip, small
enough that the reused scratch buffer stays modest."""


class MalformedReply(TierError):
    """The server answered, in Redis's protocol, with a reply of the wrong kind."""


def _memory_field(info: Any, field: str) -> int:
    """An integer field of ``INFO memory``'s reply, or :class:`MalformedReply`."""
    value = info.get(field, 0) if isinstance(info, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedReply(f"INFO memory gave {field} = {value!r:.80}")
    return value


def _zero_or_one(v: Any) -> bool:
    """What EXISTS and UNLINK of one key answer."""
    return isinstance(v, int) and not isinstance(v, bool) and v in (0, 1)


def decoded(value: Any) -> str:
    """A key, channel or reply field as text (redis-py hands back bytes unless
    its client decodes; a byte that is not UTF-8 is replaced, not refused)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


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
        direct_writes: bool | None = None,
    ) -> None:
        super().__init__()
        if cluster and direct_writes:
            raise InvalidValueError(
                "redis tier: direct writes need one server; a cluster routes keys itself"
            )
        if not isinstance(url, str) or not url:
            raise InvalidValueError(f"redis tier: url must be a redis:// URL, got {url!r}")
        timeout_s = check_timeout(timeout_s, "redis tier: timeout_s")
        redis = _redis()
        self.url = url
        self.prefix = prefix
        self._errors = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.RedisError,
            OSError,
            MalformedReply,
            # What redis-py's reply parsers raise on a reply of a kind they did not
            # expect (INFO answered with an integer, say): a malformed reply too.
            AttributeError,
            TypeError,
            ValueError,
            IndexError,
            KeyError,
        )
        try:
            factory = redis.RedisCluster if cluster else redis.Redis
            self._client = factory.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
        except (ValueError, *self._errors) as exc:
            raise TierError(f"redis tier {redacted(url)}: {exc}") from None
        self._capacity = 0
        try:
            self._capacity = _memory_field(self._client.info("memory"), "maxmemory")
        except self._errors as exc:
            self._failed("connect", exc)
        self._scratch = bytearray()
        # Writes go straight to the connection on one server; a cluster's client
        # routes keys, so its writes go through its pipeline.
        self._direct = (not cluster) if direct_writes is None else bool(direct_writes)
        self._count = 0  # objects this client wrote and has not seen go (an estimate)

    def describe(self) -> str:
        return f"redis {redacted(self.url)}"

    @property
    def cascades(self) -> bool:
        return False

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    @synchronized
    def used_bytes(self) -> int:
        try:
            used = _memory_field(self._client.info("memory"), "used_memory")
        except self._errors as exc:
            self._failed("info", exc)
            return 0
        self._worked()
        return used

    @synchronized
    def __len__(self) -> int:
        return self._count

    def _keys(self, names: Sequence[str]) -> list[str]:
        return [self.prefix + n for n in names]

    def _pipeline(self, op: str, build: Any, count: int, valid: Any) -> list[Any] | None:
        """One round trip: ``count`` replies, each passing ``valid``; a reply of the
        wrong kind (or count) fails the whole batch as a miss, with one warning."""
        try:
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            result = pipe.execute()
            if not isinstance(result, list) or len(result) != count:
                raise MalformedReply(f"{op}: {count} replies wanted, got {result!r:.80}")
            bad = next((v for v in result if not valid(v)), _NONE)
            if bad is not _NONE:
                raise MalformedReply(f"{op}: a reply of the wrong kind: {bad!r:.80}")
        except self._errors as exc:
            self._failed(op, exc)
            return None
        self._worked()
        return result

    @synchronized
    def put_many(self, objects: Sequence[TierObject], *, want_evicted: bool = True) -> Put:
        """SETs in batches of about ``BATCH_BYTES``, each batch one round trip;
        objects are sealed first (a shared store can be changed by anyone). A
        batch the server refused (unreachable, out of memory) is refused whole:
        some of its SETs may have landed, and a book that misses those costs a
        miss, where one that counted a refused SET would cost a failed load."""
        objects = self.stored(objects)
        refused: list[str] = []
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
            try:
                if self._direct:
                    self._send_sets(chunk)
                else:
                    self._pipeline_sets(chunk, total)
            except self._errors as exc:
                self._failed("put", exc)
                refused.extend(o.name for o in chunk)
                continue
            self._worked()
            self.metrics.puts += len(chunk)
            self.metrics.put_bytes += sum(o.logical_bytes for o in chunk)
            self._count += len(chunk)
        return Put(refused=refused)

    def _send_sets(self, chunk: list[TierObject]) -> None:
        """One server: the SET commands written straight to the connection, each
        object's header and payload sent from where they lie (scatter, no join);
        small pieces are gathered so a batch of small objects is few sends."""
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            pieces: list[bytes | memoryview] = []
            group: list[bytes | memoryview] = []  # small pieces, joined about 1 MiB at a time
            grouped = 0

            def flush() -> None:
                nonlocal group, grouped
                if group:
                    pieces.append(b"".join(group))
                    group, grouped = [], 0

            for obj in chunk:
                key = (self.prefix + obj.name).encode()
                group.append(
                    b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
                    % (
                        len(key),
                        key,
                        obj.stored_bytes,
                    )
                )
                for part in obj.parts:
                    view = memoryview(part).cast("B")
                    if view.nbytes < INLINE_BYTES:
                        group.append(view)
                        grouped += view.nbytes
                    else:
                        flush()
                        pieces.append(view)
                group.append(b"\r\n")
                if grouped >= 1 << 20:
                    flush()
            flush()
            conn.send_packed_command(pieces)
            for _ in chunk:
                reply = conn.read_response()  # "OK", or raises (an OOM under noeviction, say)
                if reply not in _OK:
                    raise MalformedReply(f"SET answered {reply!r:.80}")
        except BaseException:
            conn.disconnect()  # a half-read reply stream cannot be reused
            raise
        finally:
            pool.release(conn)

    def _pipeline_sets(self, chunk: list[TierObject], total: int) -> None:
        """A cluster: redis-py routes each key to its node, so each value is one
        buffer, laid end to end in a reused scratch (fresh buffers per object cost
        more in page faults than the copy)."""
        if len(self._scratch) < total:
            self._scratch = bytearray(total)
        mv = memoryview(self._scratch)
        pipe = self._client.pipeline(transaction=False)
        pos = 0
        for obj in chunk:
            start = pos
            for part in obj.parts:
                n = memoryview(part).nbytes
                mv[pos : pos + n] = memoryview(part).cast("B")
                pos += n
            pipe.set(self.prefix + obj.name, mv[start:pos])
        replies = pipe.execute()
        if not isinstance(replies, list) or len(replies) != len(chunk):
            raise MalformedReply(f"SET pipeline answered {replies!r:.80}")
        for reply in replies:
            if reply not in _OK:
                raise MalformedReply(f"SET answered {reply!r:.80}")

    @synchronized
    def get_many(self, names: Sequence[str]) -> list[bytes | bytearray | memoryview | None]:
        if not names:
            return []
        self.metrics.gets += len(names)
        keys = self._keys(names)

        def build(pipe: Any) -> None:
            for k in keys:
                pipe.get(k)

        got = self._pipeline(
            "get", build, len(keys), lambda v: v is None or isinstance(v, (bytes, bytearray))
        )
        out: list[bytes | bytearray | memoryview | None] = (
            list(got) if got is not None else [None] * len(names)
        )
        for v in out:
            if v is None:
                self.metrics.misses += 1
            else:
                self.metrics.hits += 1
                self.metrics.get_bytes += logical_bytes(v)
        return out

    @synchronized
    def contains_many(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        keys = self._keys(names)

        def build(pipe: Any) -> None:
            for k in keys:
                pipe.exists(k)

        got = self._pipeline("exists", build, len(keys), _zero_or_one)
        return [bool(v) for v in got] if got is not None else [False] * len(names)

    @property
    def client(self) -> Any:
        """The redis-py client, for tools that read the store outside a stack
        (``kvarena tiers``: headers, sizes and idle times in one pipeline)."""
        return self._client

    @synchronized
    def names(self, duty: float | None = None) -> list[str] | None:
        """Every object name the store holds under this tier's prefix (``SCAN``, in
        batches: a store many engines share is listed whole), or None when it
        cannot be reached. Each batch is decoded as it arrives, so a caller on a
        thread of its own hands the interpreter back at every round trip;
        ``duty``: the share of the time the listing works, resting after every
        1,000 names, a ``SCAN`` batch's worth (:class:`~kvarena.tiers.duty.DutyCycle`)."""
        cut = len(self.prefix)
        cycle = DutyCycle(duty)
        names: list[str] = []
        try:
            for k in self._client.scan_iter(match=self.prefix + "*", count=_SCAN_COUNT):
                names.append(decoded(k)[cut:])
                if len(names) % _SCAN_COUNT == 0:
                    cycle.rest()
        except self._errors as exc:
            self._failed("scan", exc)
            return None
        self._worked()
        return names

    @synchronized
    def delete_many(self, names: Sequence[str]) -> int:
        if not names:
            return 0
        keys = self._keys(names)

        def build(pipe: Any) -> None:
            for k in keys:
                pipe.unlink(k)

        got = self._pipeline("delete", build, len(keys), _zero_or_one)
        n = sum(int(v) for v in got) if got is not None else 0
        self.metrics.deletes += n
        self._count = max(0, self._count - n)
        return n

    @synchronized
    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass
