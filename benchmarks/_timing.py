"""Side-by-side timing: every method once per round, rounds repeated.

Interleaving the methods means a noisy neighbour or a frequency change hits
all of them alike, so the ratios printed are fair even when absolute numbers
drift; the order is shuffled round by round (seeded), so no method always
follows the same one. Each method runs once untimed first (page first-touch, allocator).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvarena.layout import aligned_zeros


class Timings(dict[str, float]):
    """Median seconds per method, plus every round's samples for paired ratios."""

    def __init__(self, samples: dict[str, list[float]]) -> None:
        super().__init__({name: statistics.median(s) for name, s in samples.items()})
        self.samples = samples

    def speed(self, name: str, baseline: str) -> float:
        """How many times faster ``name`` ran than ``baseline``: the median over
        rounds of the two methods' ratio IN ONE ROUND. Methods of one round run
        back to back, so a slow spell of this shared machine (memcpy of the
        same bytes measured 13-23 GB/s across runs) moves both alike; the ratio
        of two medians would mix rounds."""
        pairs = zip(self.samples[baseline], self.samples[name], strict=True)
        return statistics.median(b / a for b, a in pairs)


def side_by_side(
    methods: dict[str, Callable[[], object]], rounds: int, device: torch.device
) -> Timings:
    """Median seconds per method over ``rounds`` interleaved rounds (and the samples)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in methods.values():
        fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    shuffle = random.Random(0)
    for _ in range(rounds):
        # A new order each round, so no method always follows the same one: a
        # method right after a torch parallel op finds torch's OpenMP workers
        # still spinning on the cores (measured on 2 cores: a threaded copy
        # after a torch copy_ ran at 0.66x memcpy, 0.93x with
        # OMP_WAIT_POLICY=PASSIVE). A rotation would keep each method's
        # predecessor the same in every round.
        for name in shuffle.sample(names, len(names)):
            start = time.perf_counter()
            methods[name]()
            sync()
            samples[name].append(time.perf_counter() - start)
    return Timings(samples)


CACHE_FLUSH_BYTES = 64 << 20
"""Twice the 32 MiB L3 of the CI machine class: writing this much leaves no
operand of the previous method in any cache level."""


def flush_caches(scratch: torch.Tensor) -> None:
    """Write ``scratch`` (at least CACHE_FLUSH_BYTES) so the next timed copy reads
    and writes memory, as the copy it is compared with does; a buffer filled
    just before would otherwise serve its last L3-worth of bytes from cache."""
    scratch.add_(1)


def cache_memory(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor from the allocator kvarena's caches use (``aligned_zeros``:
    on CPU a private mapping advised to use huge pages), so a baseline (a memcpy,
    the per-layer tensors) runs on the same kind of memory as the cache it is
    compared with and a ratio measures the copy, not the page size."""
    nbytes = math.prod(shape) * dtype.itemsize
    return aligned_zeros(nbytes, 64, device).view(dtype).view(shape)


def filled(nbytes: int, value: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` bytes of ``value`` in cache memory (filled, not zeros: untouched
    zero pages all map one shared page and read for free)."""
    buf = cache_memory((nbytes,), torch.uint8, device)
    return buf.fill_(value)


def plain_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The ceiling every ratio is taken against: one contiguous ``copy_`` of the
    same bytes, as 8-byte words where both buffers allow (torch copies words
    1.03-1.2x faster than bytes on the CI machine class; a byte copy would make
    a worse ceiling and flatter every ratio), else as bytes."""
    if (
        src.numel() % 8 == 0
        and dst.numel() == src.numel()
        and src.storage_offset() % 8 == 0
        and dst.storage_offset() % 8 == 0
    ):
        dst.view(torch.int64).copy_(src.view(torch.int64))
    else:
        dst.copy_(src)
