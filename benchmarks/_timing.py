"""Side-by-side timing: every method once per round, rounds repeated.

Interleaving the methods means a noisy neighbour or a frequency change hits
all of them alike, so the ratios printed are fair even when absolute numbers
drift. Each method runs once untimed first (page first-touch, allocator).
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
    for _ in range(rounds):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}
