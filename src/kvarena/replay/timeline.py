"""What one replay records over its simulated time, for ``replay --timeline``.

A :class:`Sample` is taken after every event the replay handles (an arrival,
a prefill's end, a finish): the device's books at that moment and the
running totals of hits and evictions. :func:`windows` turns the samples into
per-window rates (hit tokens and evictions per window), which is what a
picture of a long trace can show; the samples themselves stay exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Sample:
    """The device at simulated second ``t``: its books, and totals so far."""

    t: float
    blocks: int  # PAGE blocks the pool holds now (the boundary moves it)
    live_blocks: int  # held by running requests
    cached_blocks: int  # evictable: cached KV and aged images, in the LRU
    slots: int  # STATE slots the pool holds now (the boundary's position)
    live_slots: int
    running: int  # admitted requests not yet finished
    waiting: int  # arrived, not admitted
    hit_tokens: int  # totals since the start
    prompt_tokens: int
    evicted_blocks: int
    evicted_images: int

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class Window:
    """``[start, end)`` simulated seconds: the state at its end and what happened in it."""

    start: float
    end: float
    occupancy: float  # (live + cached) blocks over the blocks held, at the window's end
    live: float  # live blocks over the blocks held
    slots: int
    hit_tokens: int
    prompt_tokens: int
    evicted_blocks: int
    evicted_images: int


def windows(samples: Sequence[Sample], count: int = 60) -> list[Window]:
    """``samples`` cut into ``count`` equal windows of simulated time (fewer when
    the trace has fewer events); a window without samples repeats the state of
    the last one before it and counts nothing."""
    if not samples:
        return []
    count = max(1, min(count, len(samples)))
    t0, t1 = samples[0].t, samples[-1].t
    span = (t1 - t0) or 1.0
    out: list[Window] = []
    i = 0
    prev = samples[0]
    base = Sample(
        t=t0,
        blocks=0,
        live_blocks=0,
        cached_blocks=0,
        slots=0,
        live_slots=0,
        running=0,
        waiting=0,
        hit_tokens=0,
        prompt_tokens=0,
        evicted_blocks=0,
        evicted_images=0,
    )  # totals count from the start of the replay
    for w in range(count):
        start, end = t0 + span * w / count, t0 + span * (w + 1) / count
        last = w == count - 1
        while i < len(samples) and (samples[i].t < end or last):
            prev = samples[i]
            i += 1
        held = prev.blocks or 1
        out.append(
            Window(
                start=start,
                end=end,
                occupancy=(prev.live_blocks + prev.cached_blocks) / held,
                live=prev.live_blocks / held,
                slots=prev.slots,
                hit_tokens=prev.hit_tokens - base.hit_tokens,
                prompt_tokens=prev.prompt_tokens - base.prompt_tokens,
                evicted_blocks=prev.evicted_blocks - base.evicted_blocks,
                evicted_images=prev.evicted_images - base.evicted_images,
            )
        )
        base = prev
    return out
