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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..checks import check_bytes
from .base import IndexedTier, TierError
from .image import HEAD_BYTES, MAX_NAMESPACE_BYTES, ImageMismatch, TierObject, read_header

SUFFIX = ".kvi"
TMP_SUFFIX = ".tmp"
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


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


class DiskTier(IndexedTier):
    kind = "disk"

    def __init__(
        self, directory: str | os.PathLike[str], capacity_bytes: int, *, batch_sync: bool = True
    ) -> None:
        super().__init__(check_bytes(capacity_bytes, "disk tier: capacity_bytes", lo=1))
        # One syncfs per batch (Linux) instead of one fsync per object: the same
        # guarantee — nothing is renamed into view before its bytes are durable.
        self._syncfs = _find_syncfs() if batch_sync else None
        self.dir = Path(directory)
        self._prefix = os.path.join(str(self.dir), "")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            entries = list(os.scandir(self.dir))
        except OSError as exc:
            raise TierError(f"disk tier {self.dir}: cannot use the directory ({exc})") from None
        self.dropped_on_start = 0  # unreadable objects and dead writers' temporaries removed
        self._rebuild(entries)

    def describe(self) -> str:
        return f"disk {self.dir} {self._capacity:,} B"

    def _path(self, name: str) -> str:
        return self._prefix + name + SUFFIX

    def _rebuild(self, entries: list[os.DirEntry[str]]) -> None:
        found: list[tuple[int, str, int]] = []
        for e in entries:
            if e.name.endswith(TMP_SUFFIX) and e.name.startswith("."):
                parts = e.name.split(".")
                pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else 0
                if pid and _pid_alive(pid) and pid != os.getpid():
                    continue  # another live process is writing it
                self._unlink(e.path)
                continue
            if not e.name.endswith(SUFFIX) or not e.is_file(follow_symlinks=False):
                continue
            name = e.name[: -len(SUFFIX)]
            try:
                with open(e.path, "rb") as fh:
                    head = read_header(fh.read(HEAD_BYTES + MAX_NAMESPACE_BYTES))
                st = e.stat()
                if st.st_size != head.stored_bytes:
                    raise ImageMismatch("truncated", "file size differs from its header")
            except (OSError, ImageMismatch):
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
        """The file's bytes, or None if it is gone."""
        try:
            with open(self._prefix + name + SUFFIX, "rb", buffering=0) as fh:
                return fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._failed("read", exc)
            return None

    def put_many(
        self, objects: Sequence[TierObject], *, want_evicted: bool = True
    ) -> list[TierObject]:
        """Write the batch to temporary files, make them durable together, then
        rename each into place: a reader never sees an object before its bytes
        are on disk."""
        evicted: list[TierObject] = []
        written: list[tuple[TierObject, Path]] = []
        for obj in objects:
            if not self._admit(obj):
                continue
            for old in self._victims(obj.logical_bytes):
                data = self._read(old) if want_evicted else None
                if data is not None:
                    evicted.append(TierObject(old, (data,), self._index[old]))
                self._drop(old)
                self.metrics.evictions += 1
            tmp = self._write_tmp(obj)
            if tmp is not None:
                self._added(obj.name, obj.logical_bytes)  # counted now: room for the rest
                written.append((obj, tmp))
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
        return evicted

    def _fetch(self, name: str) -> bytes | None:
        return self._read(name)
