"""Side-by-side timing: every method once per round, rounds repeated.

Interleaving the methods means a noisy neighbour or a frequency change hits
all of them alike, so the ratios printed are fair even when absolute numbers
drift; the order rotates round by round, so no method always follows the same
one. Each method runs once untimed first (page first-touch, allocator).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def side_by_side(
    methods: dict[str, Callable[[], object]], rounds: int, device: torch.device
) -> dict[str, float]:
    """Median seconds per method over ``rounds`` interleaved rounds."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in methods.values():
        fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(rounds):
        # Rotate the order each round: a method right after a torch parallel op
        # finds torch's OpenMP workers still spinning on the cores (measured on
        # 2 cores: a threaded copy after a torch copy_ ran at 0.66x memcpy,
        # 0.93x with OMP_WAIT_POLICY=PASSIVE), so every method takes each place.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            methods[name]()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}
