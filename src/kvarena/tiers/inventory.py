"""What a durable tier holds, read from outside any engine: ``kvarena tiers``.

A disk directory or a Redis database fills with the objects of many models,
revisions, layouts and ranks. An inventory lists them from the objects
themselves (each header names its namespace, kind and size), checks each
whole object on its own — its header, its size, its seal and checksum, and
that its name is the one its kind and key give — and deletes what an
operator no longer wants. It never needs to know which engine wrote what.

A disk directory owned by a live engine (its disk tier holds the
directory's lock) may be read, never changed: deleting behind a tier's index
would leave it promising objects that are gone. :meth:`DiskInventory.claim`
takes the lock for the time of a deletion, refused with the owner's pid.
A Redis store is shared by design; engines treat a vanished object as a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .base import TierError
from .disk import _OPEN, LOCK_NAME, SUFFIX, object_entries, take_directory
from .image import (
    HEAD_BYTES,
    MAX_NAMESPACE_BYTES,
    ImageHeader,
    ImageMismatch,
    checksum_of,
    read_header,
)
from .names import ImageKind, object_name
from .redact import redacted


def namespace_id(namespace: bytes) -> str:
    """A short stable id for a namespace, as tables and ``--namespace`` name it."""
    return hashlib.blake2b(namespace, digest_size=6).hexdigest()


def describe_namespace(namespace: bytes) -> dict[str, Any]:
    """What an operator reads of a namespace: the model, revision, layout and
    rank an engine wrote into it (vLLM's connector), or the model, block size
    and rank of kvarena's own prefix cache; what is absent is None."""
    try:
        doc = json.loads(namespace)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict):
        return {"format": None, "model": None, "revision": None, "layout": None, "rank": None}
    tp = doc.get("tp")
    rank = f"{tp[0]}/{tp[1]}" if isinstance(tp, list) and len(tp) == 2 else None
    layout = doc.get("layout")
    if layout is None and "block_size" in doc:
        layout = f"{doc['block_size']}-token blocks"
    return {
        "format": doc.get("format"),
        "model": doc.get("model"),
        "revision": doc.get("revision"),
        "layout": layout,
        "rank": rank,
    }


_KIND_WORDS = {ImageKind.KV_BLOCK: "kv", ImageKind.STATE: "state"}


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One stored object: its name, what its header says, where it lies, and
    how long ago it was written (disk) or last read or written (Redis)."""

    name: str
    kind: str  # "kv", "state", or "?" where the header does not read
    namespace: bytes
    stored_bytes: int
    age_s: float
    where: str  # a file path, or the store's key

    @classmethod
    def of(
        cls, name: str, head: ImageHeader, *, stored_bytes: int, age_s: float, where: str
    ) -> Entry:
        """The entry of an object whose header reads as ``head``."""
        return cls(
            name=name,
            kind=_KIND_WORDS.get(head.kind, "?"),  # type: ignore[call-overload]
            namespace=head.namespace,
            stored_bytes=stored_bytes,
            age_s=age_s,
            where=where,
        )


def check_alone(name: str, data: bytes | bytearray | memoryview) -> None:
    """Raise :class:`~kvarena.tiers.image.ImageMismatch` unless ``data`` is a whole,
    sealed object whose checksum holds and whose name its kind and key give."""
    head = read_header(data)
    if memoryview(data).nbytes != head.stored_bytes:
        raise ImageMismatch(
            "truncated", f"{len(data)} bytes, the header declares {head.stored_bytes}"
        )
    if not head.sealed:
        raise ImageMismatch("unsealed", "no checksum: an image of a process's memory")
    if checksum_of(data) != head.checksum:
        raise ImageMismatch("checksum", "header or payload changed since it was written")
    try:
        kind = ImageKind(head.kind)
    except ValueError:
        raise ImageMismatch("kind", f"unknown kind {head.kind}") from None
    if object_name(kind, head.key) != name:
        raise ImageMismatch(
            "key", f"stored as {name}, its header names {object_name(kind, head.key)}"
        )


class Inventory(Protocol):
    def describe(self) -> str: ...

    def entries(self) -> tuple[list[Entry], list[tuple[str, str]]]:
        """Every object, and the ``(name, why)`` of those whose header does not read."""
        ...

    def read(self, entry: Entry) -> bytes | None: ...

    def contents(self) -> Iterator[tuple[str, str, bytes]]:
        """Every object whole, once: ``(name, where, stored bytes)``."""
        ...

    def delete(self, names: Sequence[str]) -> int: ...

    def claim(self) -> contextlib.AbstractContextManager[None]: ...


class DiskInventory:
    """A disk tier's directory, and the per-rank directories an engine's ranks
    keep below it (``tp0``, ``tp1``, ...)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise TierError(f"disk {self.dir}: not a directory")
        subdirs = sorted(p for p in self.dir.glob("tp*") if p.is_dir() and p.name[2:].isdigit())
        self.dirs = [self.dir, *subdirs]

    def describe(self) -> str:
        return f"disk {self.dir}"

    def _files(self) -> Iterator[tuple[str, Path]]:
        for d in self.dirs:
            for e in object_entries(d):
                if e.is_file(follow_symlinks=False):
                    yield e.name[: -len(SUFFIX)], Path(e.path)

    def entries(self) -> tuple[list[Entry], list[tuple[str, str]]]:
        out, unreadable, now = [], [], time.time()
        for name, path in self._files():
            try:
                fd = os.open(path, _OPEN)
                try:
                    st = os.fstat(fd)
                    head = read_header(os.pread(fd, HEAD_BYTES + MAX_NAMESPACE_BYTES, 0))
                finally:
                    os.close(fd)
            except (OSError, ImageMismatch) as exc:
                unreadable.append((str(path), str(exc)))
                continue
            age = max(0.0, now - st.st_mtime)
            out.append(Entry.of(name, head, stored_bytes=st.st_size, age_s=age, where=str(path)))
        return out, unreadable

    def read(self, entry: Entry) -> bytes | None:
        try:
            return Path(entry.where).read_bytes()
        except OSError:
            return None

    def contents(self) -> Iterator[tuple[str, str, bytes]]:
        for name, path in self._files():
            try:
                yield name, str(path), path.read_bytes()
            except OSError:
                continue  # gone since the listing: nothing to check

    def delete(self, paths: Sequence[str]) -> int:
        n = 0
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
                n += 1
        return n

    @contextlib.contextmanager
    def claim(self) -> Iterator[None]:
        """Every directory's lock, held while the caller deletes: refused with the
        owner's pid while a live engine's disk tier holds one."""
        fds: list[int] = []
        try:
            for d in self.dirs:
                if (d / LOCK_NAME).exists() or d == self.dir:
                    fds.append(take_directory(d))
            yield
        finally:
            for fd in fds:
                os.close(fd)


class RedisInventory:
    """A Redis store's kvarena objects (its tier's key prefix)."""

    def __init__(self, url: str, *, cluster: bool = False) -> None:
        from .redis_tier import RedisTier

        self.url = url
        # A tier outside a stack warns and serves on when its store is gone; a
        # tool reading the store refuses instead, with the tier's reason.
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            self.tier = RedisTier(url, cluster=cluster)
            self._names = self.tier.names()
        if self._names is None:
            # the tier's own words, less its describe() and its serving advice
            why = str(said[-1].message).split("; ")[0].split(": ", 1)[-1] if said else "no reply"
            raise TierError(f"redis {redacted(url)}: cannot reach the store ({why})")
        self.prefix, self._client = self.tier.prefix, self.tier.client

    def _keys(self) -> list[str]:
        """Every object's key, sorted (the tier's one listing of the store, taken
        when the inventory opened it)."""
        return sorted(self.prefix + n for n in self._names or ())

    def describe(self) -> str:
        return f"redis {redacted(self.url)}"

    def entries(self) -> tuple[list[Entry], list[tuple[str, str]]]:
        keys = self._keys()
        out, unreadable = [], []
        for i in range(0, len(keys), 512):
            chunk = keys[i : i + 512]
            pipe = self._client.pipeline(transaction=False)
            for k in chunk:
                pipe.getrange(k, 0, HEAD_BYTES + MAX_NAMESPACE_BYTES - 1)
                pipe.strlen(k)
                pipe.object("idletime", k)
            replies = pipe.execute()
            for j, key in enumerate(chunk):
                head_bytes, size, idle = replies[3 * j : 3 * j + 3]
                name = key[len(self.prefix) :]
                try:
                    head = read_header(head_bytes)
                except ImageMismatch as exc:
                    unreadable.append((key, str(exc)))
                    continue
                age = float(idle or 0)
                out.append(Entry.of(name, head, stored_bytes=int(size), age_s=age, where=key))
        return out, unreadable

    def read(self, entry: Entry) -> bytes | None:
        data: bytes | None = self._client.get(entry.where)
        return data

    # Reads and deletes go key by key in a pipeline, never one multi-key command:
    # a Redis Cluster refuses MGET or DEL over keys of different slots, and its
    # client's pipeline sends each node its own keys in one round trip.
    def contents(self) -> Iterator[tuple[str, str, bytes]]:
        keys = self._keys()
        for i in range(0, len(keys), 64):
            chunk = keys[i : i + 64]
            pipe = self._client.pipeline(transaction=False)
            for k in chunk:
                pipe.get(k)
            for key, data in zip(chunk, pipe.execute(), strict=True):
                if data is not None:
                    yield key[len(self.prefix) :], key, data

    def delete(self, keys: Sequence[str]) -> int:
        n = 0
        for i in range(0, len(keys), 512):
            pipe = self._client.pipeline(transaction=False)
            for k in keys[i : i + 512]:
                pipe.unlink(k)
            n += sum(int(v) for v in pipe.execute())
        return n

    @contextlib.contextmanager
    def claim(self) -> Iterator[None]:
        yield  # shared by design: engines take a vanished object as a miss
