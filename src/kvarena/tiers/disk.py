"""The disk tier: a directory of image files, each visible only once complete.

A put writes a temporary file (``.NAME.PID.RANDOM.tmp``), makes it durable
(one ``syncfs`` for the whole batch on Linux, else an fsync per file) and
renames it to ``NAME.kvi``; rename is atomic within a filesystem, so a reader
sees either nothing or the whole object, and a writer killed mid-write leaves
only a temporary file, which the next start removes (when its writer's pid is
gone). The directory's fsync after the rename is left out: a crash may lose
the newest objects (a miss), never expose a partial one.

The index (name -> logical bytes, in LRU order) lives in memory and is
rebuilt from the files' headers on start, oldest write first (a hit does not
stamp the file: a syscall per load for an order only a restart would read), so a second run —
or a restarted server — hits what the first left. A header that does not read
as an image is deleted at once; checksums are checked on every load (by the
loader), not at start, which would read every byte.

A full disk (ENOSPC, EDQUOT, EFBIG) disables the tier's writes with one
message; reads go on.

What the tier trusts of its directory: nothing it did not write. It reads
and deletes only files named as it names them (``NAME.kvi``, and temporaries
``.NAME.PID.HEX.tmp`` whose writer is gone), opens them without following
links and without blocking (a FIFO, a device or a link in their place is a
miss, never a hang), and reads at most the bytes its index says an object
has. An object whose header declares more than the tier's whole capacity
cannot be one it wrote: that file alone is dropped, never the valid ones
beside it.

One process owns a directory at a time (an exclusive ``flock`` on
``.kvarena-disk.lock``, held until :meth:`DiskTier.close` or the process
ends, so a crashed owner frees it): a second tier on the same directory, in
this process or another, is refused naming the owner's pid. Two processes
each keeping their own index of one directory would hold twice its
capacity; engines that share objects share them through a Redis tier.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..checks import check_bytes
from ..errors import InvalidValueError
from ..locking import synchronized
from .base import IndexedTier, Put, TierError
from .image import HEAD_BYTES, MAX_NAMESPACE_BYTES, ImageMismatch, TierObject, read_header

SUFFIX = ".kvi"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".kvarena-disk.lock"
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,199}")
"""An object name this tier writes as a file name: no separator, no dot, no surprise."""
_TEMP = re.compile(r"\.([A-Za-z0-9][A-Za-z0-9_-]{0,199})\.([0-9]{1,10})\.([0-9a-f]{1,32})\.tmp")
_OPEN = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _find_syncfs() -> Any:
    """libc's syncfs(2) (Linux), or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def object_entries(directory: str | os.PathLike[str]) -> list[os.DirEntry[str]]:
    """The files of ``directory`` named as a disk tier names its objects
    (``NAME.kvi``), without opening any; none where the directory is absent."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    return [
        e for e in entries if e.name.endswith(SUFFIX) and NAME.fullmatch(e.name[: -len(SUFFIX)])
    ]


def take_directory(directory: Path) -> int:
    """The directory's lock (an open descriptor holding its exclusive ``flock``,
    the holder's pid written in it), for as long as the descriptor is open;
    refused, naming the owner's pid, while another holds it. A disk tier holds
    it for its life; ``kvarena tiers`` holds it while it deletes."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise TierError(
            f"disk tier {directory}: the directory is in use by process {owner} (one process "
            "owns a disk directory at a time: close the other tier, give each engine its "
            "own directory, or share objects through a redis:// tier)"
        ) from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class DiskTier(IndexedTier):
    kind = "disk"

    def __init__(
        self, directory: str | os.PathLike[str], capacity_bytes: int, *, batch_sync: bool = True
    ) -> None:
        super().__init__(check_bytes(capacity_bytes, "disk tier: capacity_bytes", lo=1))
        # One syncfs per batch (Linux) instead of one fsync per object: the same
        # guarantee — nothing is renamed into view before its bytes are durable.
        self._syncfs = _find_syncfs() if batch_sync else None
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise InvalidValueError(f"disk tier: directory must be a path, got {directory!r}")
        self.dir = Path(directory)
        self._prefix = os.path.join(str(self.dir), "")
        self._lock_fd: int | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = take_directory(self.dir)
            entries = list(os.scandir(self.dir))
        except OSError as exc:
            self.close()
            raise TierError(f"disk tier {self.dir}: cannot use the directory ({exc})") from None
        self.dropped_on_start = 0  # unreadable objects and dead writers' temporaries removed
        self._rebuild(entries)

    def close(self) -> None:
        """Give the directory up (its objects stay, for the next owner)."""
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None  # refused half-built: none
        if fd is not None:
            os.close(fd)  # closing the descriptor releases its flock

    def __del__(self) -> None:
        self.close()

    def describe(self) -> str:
        return f"disk {self.dir} {self._capacity:,} B"

    def _path(self, name: str) -> str:
        return self._prefix + name + SUFFIX

    def _rebuild(self, entries: list[os.DirEntry[str]]) -> None:
        found: list[tuple[int, str, int]] = []
        for e in entries:
            temp = _TEMP.fullmatch(e.name)
            if temp is not None:  # a temporary of ours: its writer's pid is in its name
                pid = int(temp.group(2))
                if pid and _pid_alive(pid) and pid != os.getpid():
                    continue  # another live process is writing it
                if e.is_file(follow_symlinks=False):
                    self._unlink(e.path)
                continue
            name = e.name[: -len(SUFFIX)]
            if not e.name.endswith(SUFFIX) or not NAME.fullmatch(name):
                continue  # not a file this tier names: never read, never deleted
            try:
                st, head = self._read_header(e.path)
            except (OSError, ImageMismatch):
                if e.is_file(follow_symlinks=False) or e.is_symlink():
                    self._unlink(e.path)
                continue
            found.append((st.st_mtime_ns, name, head.logical_bytes))
        found.sort()
        for _, name, logical in found:
            self._index[name] = logical
            self._used += logical
        # A directory that holds more than this tier's capacity (a smaller capacity
        # this run) sheds its oldest objects now.
        for name in self._victims(0):
            self._drop(name)

    def _open_regular(self, path: str) -> tuple[int, os.stat_result]:
        """An open descriptor of ``path`` if it is a regular file (no link followed,
        no FIFO or device waited on), with its stat."""
        fd = os.open(path, _OPEN)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _read_header(self, path: str) -> tuple[os.stat_result, Any]:
        """A file's stat and image header, checked against its size and the capacity."""
        fd, st = self._open_regular(path)
        try:
            head = read_header(os.pread(fd, HEAD_BYTES + MAX_NAMESPACE_BYTES, 0))
        finally:
            os.close(fd)
        if st.st_size != head.stored_bytes:
            raise ImageMismatch("truncated", "file size differs from its header")
        if head.logical_bytes > self._capacity:
            # Larger than the whole tier: not one this tier wrote (its puts
            # refuse that), and counting it would evict every valid object.
            raise ImageMismatch("length", f"declares {head.logical_bytes:,} B")
        return st, head

    def _unlink(self, path: str | Path) -> None:
        try:
            os.unlink(path)
            self.dropped_on_start += 1
        except OSError:
            pass

    def _drop(self, name: str) -> None:
        self._removed(name)
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._failed("delete", exc)

    def _write_tmp(self, obj: TierObject) -> Path | None:
        """Write ``obj`` to a new temporary file (not yet durable, not yet visible)."""
        tmp = self.dir / f".{obj.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                views = [memoryview(p).cast("B") for p in obj.parts]
                while views:
                    n = os.writev(fd, views)
                    while views and n >= views[0].nbytes:
                        n -= views[0].nbytes
                        views.pop(0)
                    if views and n:
                        views[0] = views[0][n:]
                if self._syncfs is None:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self._discard(tmp)
            if exc.errno in _FULL:
                self._disable(f"the disk is full ({os.strerror(exc.errno or 0)})")
            else:
                self._failed("write", exc)
            return None
        return tmp

    def _discard(self, path: Path) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def _sync(self) -> bool:
        """Make every temporary file written so far durable: one syncfs(2) for the
        batch where Linux has it (the per-file fsync already ran otherwise)."""
        if self._syncfs is None:
            return True
        try:
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                if self._syncfs(fd) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            finally:
                os.close(fd)
        except OSError as exc:
            self._failed("sync", exc)
            return False
        return True

    def _read(self, name: str) -> bytes | None:
        """The file's bytes, or None if it is gone or cannot be an object of this
        tier: a regular file only (opened without following a link or waiting on
        a FIFO), and no larger than the tier's capacity, which bounds the read."""
        limit = self._capacity
        try:
            fd, st = self._open_regular(self._path(name))
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._failed("read", exc)
            return None
        try:
            if st.st_size > limit:
                return None  # larger than the whole tier: not an object it wrote
            return os.pread(fd, st.st_size, 0)
        except OSError as exc:
            self._failed("read", exc)
            return None
        finally:
            os.close(fd)

    @synchronized
    def put_many(self, objects: Sequence[TierObject], *, want_evicted: bool = True) -> Put:
        """Write the batch to temporary files, make them durable together, then
        rename each into place: a reader never sees an object before its bytes
        are on disk. Objects are sealed first (a file can be changed by anyone)."""
        objects = self.stored(objects)
        for obj in objects:
            if not NAME.fullmatch(obj.name):
                raise InvalidValueError(
                    f"disk tier: object name {obj.name!r} is not a file name it can use "
                    "(letters, digits, '_' and '-', at most 200)"
                )
        evicted: list[TierObject] = []
        pending: dict[str, tuple[TierObject, Path]] = {}  # written, not yet renamed
        for obj in objects:
            if not self._admit(obj):
                continue
            for old in self._victims(obj.logical_bytes):
                if old in pending:
                    # A batch larger than the room evicts its own first members:
                    # they never land (their temporaries go), and go down as they are.
                    gone, gone_tmp = pending.pop(old)
                    self._discard(gone_tmp)
                    evicted.append(
                        gone if want_evicted else TierObject(old, (), gone.logical_bytes)
                    )
                    self._removed(old)
                else:
                    if not want_evicted:
                        evicted.append(TierObject(old, (), self._index[old]))
                    else:
                        data = self._read(old)
                        if data is not None:
                            evicted.append(TierObject(old, (data,), self._index[old]))
                    self._drop(old)
                self.metrics.evictions += 1
            tmp = self._write_tmp(obj)
            if tmp is not None:
                self._added(obj.name, obj.logical_bytes)  # counted now: room for the rest
                pending[obj.name] = (obj, tmp)
        written = list(pending.values())
        durable = self._sync() if written else True
        for obj, tmp in written:
            try:
                if not durable:
                    raise OSError("the batch could not be made durable")
                os.rename(tmp, self._path(obj.name))
            except OSError as exc:
                self._discard(tmp)
                self._removed(obj.name)
                self.metrics.puts -= 1
                self.metrics.put_bytes -= obj.logical_bytes
                if durable:
                    self._failed("rename", exc)
                continue
        if written and durable:
            self._worked()
        return Put(evicted=evicted, refused=self._refused(objects, evicted))

    def _fetch(self, name: str) -> bytes | None:
        return self._read(name)
