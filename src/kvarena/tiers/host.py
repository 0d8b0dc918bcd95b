"""The host tier: one allocation of host memory, carved into frames.

One buffer, allocated once (pinned where the cache is on CUDA, so device
copies into and out of it run at DMA speed), split into fixed frames; an object
takes as many frames as its logical size needs, lowest free ids first, so it
usually lands in one contiguous run and moves with one copy. Its own
allocator (:class:`~kvarena.pools.free_ids.FreeIds`) and LRU: no per-object
Python allocation while serving.

A frame count sized by logical bytes means an elided image (bookkeeping
replays) holds the room its payload would, while writing only its header: the
buffer is an anonymous mapping, so pages never written cost no memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..checks import check_bytes
from ..errors import InvalidValueError
from ..layout.regions import aligned_zeros
from ..locking import synchronized
from ..pools.free_ids import FreeIds
from .base import IndexedTier, Put
from .frames import DEFAULT_FRAME_BYTES, MAX_FRAMES, MIN_FRAME_BYTES
from .image import TierObject


def _runs(frames: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of ``frames`` as (first, count)."""
    out: list[tuple[int, int]] = []
    for u in frames:
        if out and out[-1][0] + out[-1][1] == u:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((u, 1))
    return out


class HostTier(IndexedTier):
    kind = "host"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        pin_memory: bool = False,
    ) -> None:
        capacity = check_bytes(capacity_bytes, "host tier: capacity_bytes", lo=1)
        frame = check_bytes(frame_bytes, "host tier: frame_bytes", lo=MIN_FRAME_BYTES)
        if capacity // frame > MAX_FRAMES:
            smallest = -(-capacity // MAX_FRAMES)
            raise InvalidValueError(
                f"host tier: {capacity:,} B in frames of {frame:,} B is {capacity // frame:,} frames, "
                f"more than {MAX_FRAMES:,} (its books would outgrow it); use frames of at least "
                f"{smallest:,} B"
            )
        if frame > capacity:
            raise InvalidValueError(
                f"host tier: capacity {capacity:,} B is smaller than one frame ({frame:,} B)"
            )
        if not isinstance(pin_memory, bool):
            raise InvalidValueError(f"host tier: pin_memory must be a bool, got {pin_memory!r}")
        frames = capacity // frame
        super().__init__(frames * frame)
        self.frame_bytes = frame
        self.num_frames = frames
        if pin_memory:
            self._buf = torch.empty(frames * frame, dtype=torch.uint8, pin_memory=True)
        else:
            self._buf = aligned_zeros(frames * frame, 4096, torch.device("cpu"))
        self._mv = memoryview(self._buf.numpy()).cast("B")  # type: ignore[arg-type]
        self._view = self._mv.toreadonly()  # what is lent: no caller writes the frames
        self._free = FreeIds(range(frames))
        self._frames: dict[str, list[int]] = {}
        self._stored: dict[str, int] = {}
        self.pinned = pin_memory

    @property
    def buffer(self) -> torch.Tensor:
        """The tier's one allocation (1-D uint8): what a borrowed object's view
        lies in, for a caller copying out of it with offsets instead of views."""
        return self._buf

    @property
    def trusted(self) -> bool:
        return True

    def describe(self) -> str:
        return f"host {self._capacity:,} B ({self.num_frames:,} frames of {self.frame_bytes:,} B)"

    def _frames_for(self, logical: int) -> int:
        return -(-logical // self.frame_bytes)

    def _read(self, name: str) -> memoryview:
        """A copy of the object's bytes (never a view of the frames: a later put may
        reuse them while the caller still holds what it got)."""
        n = self._stored[name]
        dst = np.empty(n, dtype=np.uint8)  # every byte is written below: no zeroing pass
        out = memoryview(dst).cast("B")  # type: ignore[arg-type]
        pos = 0
        for first, count in _runs(self._frames[name]):
            take = min(count * self.frame_bytes, n - pos)
            if take <= 0:
                break
            start = first * self.frame_bytes
            out[pos : pos + take] = self._mv[start : start + take]
            pos += take
        return out

    def _write(self, frames: list[int], parts: Sequence[bytes | memoryview]) -> int:
        """Write ``parts`` into ``frames`` in order; the bytes written."""
        if frames[-1] - frames[0] == len(frames) - 1:  # one run (frames are sorted): the usual case
            start = pos = frames[0] * self.frame_bytes
            mv = self._mv
            for part in parts:
                if type(part) is bytes:
                    n = len(part)
                    mv[pos : pos + n] = part
                elif type(part) is memoryview and part.ndim == 1 and part.format == "B":
                    n = part.nbytes  # a flat byte view (a saver's rows): no cast to make
                    mv[pos : pos + n] = part
                else:
                    view = memoryview(part).cast("B")
                    n = view.nbytes
                    mv[pos : pos + n] = view
                pos += n
            return pos - start
        runs = _runs(frames)
        r, run_pos = 0, 0  # run index, bytes written into it
        for part in parts:
            src = memoryview(part).cast("B")  # memoryview slices copy with the least overhead
            pos = 0
            while pos < src.nbytes:
                first, count = runs[r]
                room = count * self.frame_bytes - run_pos
                take = min(room, src.nbytes - pos)
                start = first * self.frame_bytes + run_pos
                self._mv[start : start + take] = src[pos : pos + take]
                pos += take
                run_pos += take
                if run_pos == count * self.frame_bytes:
                    r, run_pos = r + 1, 0
        return sum(memoryview(p).nbytes for p in parts)  # (the rare path: every part's bytes)

    def _drop(self, name: str) -> None:
        for u in self._frames.pop(name):
            self._free.push(u)
        del self._stored[name]
        self._removed(name)

    @synchronized
    def put_many(self, objects: Sequence[TierObject], *, want_evicted: bool = True) -> Put:
        evicted: list[TierObject] = []
        index, free, frame = self._index, self._free, self.frame_bytes
        metrics = self.metrics
        puts = written = 0
        for obj in objects:
            name, logical = obj.name, obj.logical_bytes
            if name in index or logical > self._capacity or self.disabled is not None:
                self._admit(obj)  # held (refreshed) or refused: counted there
                continue
            need = -(-logical // frame)
            while len(free) < need:
                old = next(iter(index))
                parts = (self._read(old),) if want_evicted else ()
                evicted.append(TierObject(old, parts, index[old]))
                self._drop(old)
                metrics.evictions += 1
            frames = [free.pop()] if need == 1 else sorted(free.pop() for _ in range(need))
            self._frames[name] = frames
            self._stored[name] = self._write(frames, obj.parts)
            index[name] = logical  # IndexedTier._added, inline: its counts are summed below
            self._used += logical
            puts += 1
            written += logical
        metrics.puts += puts
        metrics.put_bytes += written
        return Put(evicted=evicted, refused=self._refused(objects, evicted))

    def _fetch(self, name: str) -> memoryview:
        return self._read(name)

    @contextlib.contextmanager
    def borrow(self, names: Sequence[str]) -> Iterator[list[memoryview | None]]:
        """Each object's stored bytes, read in place where its frames are one run
        (a copy where they are not), None where it is not held — valid only
        inside the ``with`` block, which holds the tier's lock: no put can
        reuse the frames while the caller copies out of them. The one-copy read
        (host memory straight into a device tensor) of the loaders' hot path."""
        with self.lend(names) as lent:
            yield [x[0] if x is not None else None for x in lent]

    @contextlib.contextmanager
    def lend(self, names: Sequence[str]) -> Iterator[list[tuple[memoryview, int | None] | None]]:
        """:meth:`borrow`, each view with where it starts in :attr:`buffer` (None
        for a copy): a caller copying out of the buffer by offsets (a load's
        grids) takes them from here instead of asking each view its address."""
        with self._lock:
            index, frames_of, stored, view, fb = (
                self._index,
                self._frames,
                self._stored,
                self._view,
                self.frame_bytes,
            )
            out: list[tuple[memoryview, int | None] | None] = []
            got = 0
            for name in names:
                logical = index.get(name)
                if logical is None:
                    out.append(None)
                    continue
                frames, n = frames_of[name], stored[name]
                if frames and frames[-1] - frames[0] == len(frames) - 1:  # one run (sorted)
                    start = frames[0] * fb
                    out.append((view[start : start + n], start))
                else:
                    out.append((self._read(name), None))
                index.move_to_end(name)  # IndexedTier._hit, inline: counts summed below
                got += logical
            hits = sum(x is not None for x in out)
            self.metrics.gets += len(out)
            self.metrics.hits += hits
            self.metrics.misses += len(out) - hits
            self.metrics.get_bytes += got
            yield out

    @synchronized
    def check_books(self) -> None:
        """Every frame is free or held by exactly one object (for tests)."""
        held = [u for us in self._frames.values() for u in us]
        assert len(held) == len(set(held))
        assert len(held) + len(self._free) == self.num_frames
        assert not set(held) & {u for u in range(self.num_frames) if u in self._free}
        assert self._used == sum(self._index.values())
