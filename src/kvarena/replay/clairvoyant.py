"""Clairvoyant placement: images exactly where a later request parts from this one.

A checkpoint policy decides where images are kept knowing only the past. The
row it is judged against here knows the whole trace: request ``i`` keeps an
image at boundary ``b`` exactly when some later request could resume there:
it shares ``i``'s first ``b`` blocks and no more, or more but its hit is
capped at ``b`` (a hit is at most ``len(prompt) - 1`` tokens). It misses no boundary a
later request could resume from, whatever the pool evicted meanwhile, and
keeps none at a boundary no later prompt reaches. Replayed through the same
pool and LRU, it shows what placement can reach; what still separates it from
the KV-only row is memory (the state slots and the images' bytes) and
eviction. (Keeping only each later request's deepest share, the fewest
images, hits less: once the pool evicted that image, nothing earlier is left.) Used by
``benchmarks/bench_prefix.py`` as its ``clairvoyant`` row.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from ..checks import check_count
from ..errors import InvalidValueError
from ..models import ModelCache
from ..prefix.keys import block_keys
from .run import ReplayConfig, ReplayResult, replay
from .trace import TraceRequest

_ROOT = b"\x00" * 16  # any root: only equality of keys within one trace matters


def parting_points(trace: Sequence[TraceRequest], block_size: int) -> list[tuple[int, ...]]:
    """For each request in trace order, the block boundaries (ascending, ``1..`` its
    full blocks) at which some later request could resume from it: the blocks
    the two share, capped as that request's hit is (``len(prompt) - 1`` tokens).
    Every boundary a later request could resume from, with this request's image
    or any image before it evicted."""
    block_size = check_count(block_size, "parting_points: block_size", lo=1)
    if not all(isinstance(r, TraceRequest) for r in trace):
        raise InvalidValueError("parting_points: trace must hold TraceRequest records")
    keys = [block_keys(_ROOT, r.tokens, block_size) for r in trace]
    passing: dict[bytes, list[int]] = {}  # a boundary's key -> requests through it, ascending
    resumable: dict[bytes, list[int]] = {}  # ... that could resume at it
    ending: dict[bytes, list[int]] = {}  # ... whose prompt ends exactly there
    for j, (req, ks) in enumerate(zip(trace, keys, strict=True)):
        limit = (req.tokens.size - 1) // block_size
        for b, k in enumerate(ks, 1):
            passing.setdefault(k, []).append(j)
            if b <= limit:
                resumable.setdefault(k, []).append(j)
        if ks and limit < len(ks):
            ending.setdefault(ks[-1], []).append(j)

    def later(requests: list[int] | None, i: int) -> int:
        return len(requests) - bisect.bisect_right(requests, i) if requests else 0

    out = []
    for i, ks in enumerate(keys):
        # Chained keys: whoever passes boundary b+1 passes b and can resume at b. Those
        # resuming at b are the ones resumable there less those passing b+1, except
        # the ones passing b+1 whose prompt ends there (their cap is b).
        out.append(
            tuple(
                b
                for b in range(1, len(ks) + 1)
                if later(resumable.get(ks[b - 1]), i)
                > (later(passing[ks[b]], i) - later(ending.get(ks[b]), i) if b < len(ks) else 0)
            )
        )
    return out


def clairvoyant_bound(
    model: ModelCache, trace: Sequence[TraceRequest], cfg: ReplayConfig
) -> ReplayResult:
    """``trace`` replayed like :func:`~.run.replay`, each request keeping images at
    its :func:`parting_points` instead of where ``cfg.policy`` would."""
    points = parting_points(trace, model.block_size)
    return replay(model, trace, cfg, label="clairvoyant placement", checkpoints=points)
