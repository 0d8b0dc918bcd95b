"""One image format for every object kvarena keeps below the device.

A KV block and a state checkpoint image leave the device the same way: a
fixed 64-byte header, the prefix cache's namespace (the canonical JSON that is
also hashed into every key's root), then the payload. The header names what
the bytes are — kind, key, token span, payload length — and carries an xxh3-64
checksum of the header (checksum field zeroed), the namespace and the payload.

Why all of it: a tier outlives the process that wrote it and may be shared by
many. Another model, another layout, another dtype or another TP rank must
never be able to hand us its bytes (sglang #24758, #33268; LMCache #4385). The
key alone already differs across namespaces, but a file renamed, a store
shared under a wrong prefix, or a torn write would still be taken; so a load
checks every field against what the caller expects and any difference is a
miss, never a copy.

xxh3-64 (the ``xxhash`` package) is the checksum: it runs at memory bandwidth
on one core (``benchmarks/bench_tiers.py`` prints it beside CRC32), where a
load's other work — a file read, a network hop — is far slower.

A *sealed* image carries its checksum. One that stays in this process's own
memory (the host tier) needs none: nothing outside the process can change
those bytes, so the hot path — a put and a get of the host tier — is one copy,
not a copy and a checksum pass. ``encode(..., seal=False)`` leaves the
checksum for later; every tier whose bytes can be changed from outside (a
disk, a shared store) seals an object before it writes it (:func:`seal`), and
``decode`` refuses an unsealed image unless the caller read it from trusted
memory (``trusted=True``, which also skips the checksum there).

An *elided* image is the same header with the payload left out: what a cache
on torch's ``meta`` device (bookkeeping replays) writes, since it holds no
bytes. Its header still declares the payload's length, which is what tier
capacities count; a cache that holds bytes refuses it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ..checks import MAX_BYTES, check_bytes, check_int
from ..errors import Error, InvalidValueError
from .names import ImageKind, object_name

MAGIC = b"KVARENA\x89"
FORMAT_VERSION = 1
FLAG_ELIDED = 1
FLAG_UNSEALED = 2  # no checksum yet: only ever held in this process's memory
_FLAGS_AT = 11  # the flags byte: after magic (8), version (2) and kind (1)

KEY_BYTES = 16
"""A prefix key's length: the header's key field and every key chain's digest."""
_HEAD = struct.Struct(f"<8sHBBIQQQ{KEY_BYTES}sQ")
"""magic, version, kind, flags, namespace length, span start, span end,
payload length, key, checksum — 64 bytes, little-endian, no padding."""
HEAD_BYTES = _HEAD.size
_CHECKSUM_AT = HEAD_BYTES - 8
MAX_NAMESPACE_BYTES = 1 << 16
MAX_SPAN = (1 << 64) - 1
"""A token span's ends are unsigned 64-bit fields of the header."""


def object_bytes(namespace: bytes, payload_bytes: int) -> int:
    """A tier object's logical size (header, namespace, payload): what tiers
    count. (An image's ``image_bytes`` elsewhere is its payload alone.)"""
    return HEAD_BYTES + len(namespace) + payload_bytes


class ImageMismatch(Error, ValueError):
    """An object that is not what the caller asked for; ``reason`` is one word
    (``truncated``, ``magic``, ``version``, ``checksum``, ``kind``, ``namespace``,
    ``key``, ``span``, ``length``, ``elided``, ``unsealed``). The caller counts it as a miss."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")


def _nbytes(part: bytes | memoryview) -> int:
    return len(part) if type(part) is bytes else memoryview(part).nbytes


@dataclass(frozen=True, eq=False, slots=True)
class TierObject:
    """What a tier stores: a name, the bytes (in parts, written in order, never
    joined unless a tier must) and the logical size its capacity counts."""

    name: str
    parts: tuple[bytes | memoryview, ...]
    logical_bytes: int

    def __post_init__(self) -> None:
        # Checked where an object is made, so no tier ever sizes room from a
        # count that does not hold its bytes (an elided image stores less).
        if type(self.name) is not str or not self.name:
            raise InvalidValueError(f"TierObject: name must be a non-empty str, got {self.name!r}")
        try:
            stored = sum(map(_nbytes, self.parts)) if type(self.parts) is tuple else -1
        except TypeError:
            stored = -1
        if stored < 0:
            raise InvalidValueError("TierObject: parts must be a tuple of byte buffers")
        logical = self.logical_bytes
        if not (type(logical) is int and max(1, stored) <= logical <= MAX_BYTES):
            check_bytes(logical, "TierObject: logical_bytes", lo=max(1, stored))

    @classmethod
    def _checked(cls, name: str, parts: tuple[bytes | memoryview, ...], logical: int) -> TierObject:
        """An object whose fields its maker has already checked (``encode``, a
        tier reading back what it stored): the hot path skips re-checking them,
        and sets the slots through their descriptors (half the cost of
        ``object.__setattr__`` on a frozen class)."""
        obj = object.__new__(cls)
        _SET_NAME(obj, name)
        _SET_PARTS(obj, parts)
        _SET_LOGICAL(obj, logical)
        return obj

    @property
    def stored_bytes(self) -> int:
        return sum(map(_nbytes, self.parts))

    def to_bytes(self) -> bytes:
        return (
            self.parts[0]
            if len(self.parts) == 1 and isinstance(self.parts[0], bytes)
            else (b"".join(self.parts))
        )


_SET_NAME = TierObject.name.__set__  # type: ignore[attr-defined,misc]
_SET_PARTS = TierObject.parts.__set__  # type: ignore[attr-defined,misc]
_SET_LOGICAL = TierObject.logical_bytes.__set__  # type: ignore[attr-defined,misc]


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageHeader:
    version: int
    kind: int
    elided: bool
    sealed: bool
    namespace: bytes
    start: int
    end: int
    payload_bytes: int
    key: bytes
    checksum: int

    @property
    def head_bytes(self) -> int:
        return HEAD_BYTES + len(self.namespace)

    @property
    def stored_bytes(self) -> int:
        return self.head_bytes + (0 if self.elided else self.payload_bytes)

    @property
    def logical_bytes(self) -> int:
        return object_bytes(self.namespace, self.payload_bytes)


@dataclass(frozen=True, kw_only=True)
class Expected:
    """What a load must find, every field of it."""

    kind: ImageKind
    key: bytes
    namespace: bytes
    start: int
    end: int
    payload_bytes: int
    elided: bool  # True: the loading cache holds no bytes (meta); False: a payload is needed


def encode(
    *,
    kind: ImageKind,
    namespace: bytes,
    key: bytes,
    start: int,
    end: int,
    payload: Sequence[bytes | memoryview] | None,
    payload_bytes: int,
    seal: bool = True,
) -> TierObject:
    """An image of ``payload`` (its parts in order; None: elided) as a tier object;
    ``seal=False`` leaves the checksum to whoever writes it outside this process.

    Every header field is checked against what the header can hold before a
    byte is packed: a refusal names the field, never a raw ``struct.error``."""
    if not isinstance(kind, ImageKind):
        raise InvalidValueError(f"encode: kind must be an ImageKind, got {kind!r}")
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InvalidValueError(f"encode: key must be {KEY_BYTES} bytes, got {key!r:.60}")
    if not isinstance(namespace, bytes) or len(namespace) > MAX_NAMESPACE_BYTES:
        raise InvalidValueError(
            f"encode: namespace must be bytes, at most {MAX_NAMESPACE_BYTES:,} of them"
        )
    if not (  # the saver's hot path: plain ints in range, checked in one expression
        type(start) is int
        and type(end) is int
        and type(payload_bytes) is int
        and 0 <= start <= end <= MAX_SPAN
        and 0 <= payload_bytes <= MAX_BYTES
    ):
        start = check_int(start, "encode: start", lo=0, hi=MAX_SPAN)
        end = check_int(end, "encode: end", lo=start, hi=MAX_SPAN)
        payload_bytes = check_bytes(payload_bytes, "encode: payload_bytes")
    if payload is None:
        parts: tuple[bytes | memoryview, ...] = ()
        flags = FLAG_ELIDED
    else:
        parts = tuple(payload)
        given = 0
        for part in parts:  # inline: this loop runs for every part of every save
            given += len(part) if type(part) is bytes else _nbytes(part)
        if given != payload_bytes:
            raise ImageMismatch("length", f"payload parts do not add up to {payload_bytes} bytes")
        flags = 0
    if not seal:
        flags |= FLAG_UNSEALED
    packed = _HEAD.pack(
        MAGIC, FORMAT_VERSION, kind, flags, len(namespace), start, end, payload_bytes, key, 0
    )
    if seal:
        head = bytearray(packed)
        _stamp(head, namespace, parts)
        packed = bytes(head)
    # Every field was checked above; the payload's length matches its parts.
    return TierObject._checked(
        object_name(kind, key),
        (packed, namespace, *parts),  # apart: joining them would copy the namespace again
        HEAD_BYTES + len(namespace) + payload_bytes,  # object_bytes, inline
    )


def _stamp(
    head: bytearray, namespace: bytes | memoryview, parts: Sequence[bytes | memoryview]
) -> None:
    """Write the checksum of (header with checksum zero, namespace, payload) into ``head``."""
    h = xxhash.xxh3_64(bytes(head))
    h.update(namespace)
    for p in parts:
        h.update(p)
    struct.pack_into("<Q", head, _CHECKSUM_AT, h.intdigest())


def is_sealed(obj: TierObject) -> bool:
    """False only for an unsealed image; tiers store opaque objects, so anything
    that is not an image has nothing to seal."""
    first = memoryview(obj.parts[0]).cast("B") if obj.parts else memoryview(b"")
    if first.nbytes < HEAD_BYTES or first[:8] != MAGIC:
        return True
    return not first[_FLAGS_AT] & FLAG_UNSEALED


def seal(obj: TierObject) -> TierObject:
    """``obj`` with its checksum computed (itself if it has one): what a tier
    outside this process's memory writes. The object may have been read back
    from the host tier as one buffer (header, namespace and payload together)."""
    if is_sealed(obj):
        return obj
    first = memoryview(obj.parts[0]).cast("B")
    head = bytearray(first[:HEAD_BYTES])
    head[_FLAGS_AT] &= ~FLAG_UNSEALED & 0xFF
    struct.pack_into("<Q", head, _CHECKSUM_AT, 0)
    # What follows the header, namespace then payload, in order: parts of their
    # own (as encode makes them) or one buffer (as the host tier reads it back).
    rest = [p for p in (first[HEAD_BYTES:], *obj.parts[1:]) if _nbytes(p)]
    _stamp(head, b"", rest)
    return TierObject(obj.name, (bytes(head), *rest), obj.logical_bytes)


def _fields(view: memoryview) -> tuple:
    """The header's raw fields, after the checks every reader makes (length,
    magic, version, namespace in bounds)."""
    if view.nbytes < HEAD_BYTES:
        raise ImageMismatch("truncated", f"{view.nbytes} bytes, a header has {HEAD_BYTES}")
    fields = _HEAD.unpack_from(view)
    magic, version, _kind, _flags, ns_len = fields[:5]
    if magic != MAGIC:
        raise ImageMismatch("magic", "not a kvarena image")
    if version != FORMAT_VERSION:
        raise ImageMismatch("version", f"format {version}, this build reads {FORMAT_VERSION}")
    if ns_len > MAX_NAMESPACE_BYTES or view.nbytes < HEAD_BYTES + ns_len:
        raise ImageMismatch("truncated", "the namespace is cut short")
    return fields


def read_header(data: bytes | bytearray | memoryview) -> ImageHeader:
    """The header of an image (its first ``HEAD_BYTES`` + namespace bytes); the
    checksum is not checked here (a tier rebuilding its index reads headers only)."""
    view = memoryview(data)
    _magic, version, kind, flags, ns_len, start, end, payload, key, checksum = _fields(view)
    return ImageHeader(
        version=version,
        kind=kind,
        elided=bool(flags & FLAG_ELIDED),
        sealed=not flags & FLAG_UNSEALED,
        namespace=bytes(view[HEAD_BYTES : HEAD_BYTES + ns_len]),
        start=start,
        end=end,
        payload_bytes=payload,
        key=key,
        checksum=checksum,
    )


def logical_bytes(data: bytes | bytearray | memoryview) -> int:
    """What stored bytes weigh as a tier counts room: their length, or for an
    elided image (a bookkeeping replay's) the whole object its header declares."""
    view = memoryview(data)
    try:
        header = read_header(view)
    except ImageMismatch:
        return view.nbytes
    return object_bytes(header.namespace, header.payload_bytes) if header.elided else view.nbytes


def checksum_of(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of a stored image with its checksum field read as zero."""
    view = memoryview(data)
    h = xxhash.xxh3_64(bytes(view[:_CHECKSUM_AT]))
    h.update(b"\x00" * 8)
    h.update(view[HEAD_BYTES:])
    return h.intdigest()


def decode(
    data: bytes | bytearray | memoryview, expect: Expected, *, trusted: bool = False
) -> memoryview:
    """The payload of ``data`` if it is exactly the image ``expect`` describes,
    else :class:`ImageMismatch`. The checksum comes first: a flipped bit anywhere
    is named as such, not as whichever field it happened to land in.

    ``trusted``: ``data`` was read from this process's own memory (the host
    tier), which nothing else can change: the checksum is not recomputed and an
    unsealed image is taken; every other field is still checked."""
    view = memoryview(data).cast("B")
    _m, _v, kind, flags, ns_len, start, end, payload, key, checksum = _fields(view)
    head_bytes = HEAD_BYTES + ns_len
    stored = head_bytes + (0 if flags & FLAG_ELIDED else payload)
    if view.nbytes != stored:
        raise ImageMismatch(
            "truncated", f"{view.nbytes} bytes stored, the header declares {stored}"
        )
    if not trusted:
        if flags & FLAG_UNSEALED:
            raise ImageMismatch("unsealed", "no checksum: an image of another process's memory")
        if checksum_of(view) != checksum:
            raise ImageMismatch("checksum", "header or payload changed since it was written")
    if kind != expect.kind:
        raise ImageMismatch("kind", f"kind {kind}, expected {int(expect.kind)}")
    # As bytes: comparing a memoryview with bytes unpacks it item by item (~1 ns
    # a byte), and an engine's namespace runs to kilobytes.
    namespace = view[HEAD_BYTES:head_bytes].tobytes()
    if namespace != expect.namespace:
        raise ImageMismatch(
            "namespace",
            f"written by {namespace[:200]!r}, expected {expect.namespace[:200]!r}",
        )
    if key != expect.key:
        raise ImageMismatch("key", f"key {key.hex()}, expected {expect.key.hex()}")
    if start != expect.start or end != expect.end:
        raise ImageMismatch("span", f"tokens {start}..{end}, expected {expect.start}..{expect.end}")
    if payload != expect.payload_bytes:
        raise ImageMismatch("length", f"{payload} payload bytes, expected {expect.payload_bytes}")
    if flags & FLAG_ELIDED and not expect.elided:
        raise ImageMismatch("elided", "written by a cache with no bytes (meta device)")
    return view[head_bytes:]
