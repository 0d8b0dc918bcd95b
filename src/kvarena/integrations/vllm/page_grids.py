"""A load's or a save's copies as the grids vLLM's cache layout declares.

Every span an object kind has in one storage (:class:`~.tensors.StorageSpans`:
each layer's page in payload order) is fixed when vLLM registers its
tensors. Spans that follow each other in the payload at one step and in the
storage at another — one group's layers in ``LBHNC``, where each layer's
region lies one region apart; a token-major page's rows — are a RUN
(:class:`SpanRuns`), found once at registration. For a set of objects, a run
is one family per object (its rows one payload step and one layer step
apart); where the objects' payloads and blocks are themselves evenly spaced
(a request's consecutive blocks read from a host tier's consecutive frames)
the run is ONE grid for all of them, else the families are merged by
:func:`~kvarena.spans.grids` as far as they advance evenly. So a request's
load of 28 KV blocks x 12 layers plus a state of 36 layers is four copy calls,
planned from the blocks alone, with no search over its 372 spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...copy.thresholds import TORCH_SPAN_BYTES
from ...spans import Grid, grids

Run = tuple[int, int, int, int, int, int, int, int]
"""``(group, payload, at, count, length, payload_step, at_step, block_step)``:
``count`` spans of ``length`` bytes of one ``group``'s layers, starting at
payload offset ``payload`` and ``at`` bytes into block 0, each next span
``payload_step`` and ``at_step`` further; a block is ``block_step`` bytes
from the last."""


@dataclass(frozen=True, kw_only=True)
class SpanRuns:
    """The runs of one storage's spans of one object kind (:data:`Run`), found at
    registration; :meth:`grids` plans a copy from them in Python numbers (a
    few runs a storage: numpy's per-call cost would be most of it)."""

    runs: tuple[Run, ...]

    @classmethod
    def of(
        cls,
        group: np.ndarray,
        payload: np.ndarray,
        at: np.ndarray,
        step: np.ndarray,
        length: np.ndarray,
    ) -> SpanRuns:
        """The runs of spans given in payload order (one pass, at registration).
        A span joins the run before it where it has its group, block step and
        length and continues the run's steps (a run's second span sets them);
        an ``at`` step below the length (rows that would overlap) starts a run."""
        rows: list[list[int]] = []
        for g, p, a, s, n in zip(
            group.tolist(),
            payload.tolist(),
            at.tolist(),
            step.tolist(),
            length.tolist(),
            strict=True,
        ):
            if rows:
                r = rows[-1]
                same = r[0] == g and r[4] == n and r[7] == s
                if same and r[3] == 1 and p >= r[1] and a - r[2] >= n:
                    r[3], r[5], r[6] = 2, p - r[1], a - r[2]
                    continue
                if same and r[3] > 1 and p - r[1] == r[3] * r[5] and a - r[2] == r[3] * r[6]:
                    r[3] += 1
                    continue
            rows.append([g, p, a, 1, n, 0, 0, s])
        return cls(runs=tuple((r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]) for r in rows))

    def grids(self, blocks: Sequence[Sequence[int]], payload_at: Sequence[int]) -> list[Grid]:
        """The grids that copy objects ``j`` (blocks ``blocks[j]``, one id per group;
        payload at ``payload_at[j]`` of a flat buffer) from their payloads into
        their blocks. Rows are not checked here: the copy checks them all."""
        objects = len(payload_at)
        p_step = _even(payload_at)
        b_step = {g: _even([b[g] for b in blocks]) for g in {r[0] for r in self.runs}}
        out: list[Grid] = []
        families: list[tuple[int, int, int, int, int, int]] = []
        for g, p, a, count, n, ps, as_, bs in self.runs:
            step = b_step[g]
            if objects > 1 and p_step is not None and step is not None:
                # every object's family one outer step from the last
                first = payload_at[0] + p, a + blocks[0][g] * bs
                out.append((*first, count, n, ps, as_, objects, p_step, step * bs))
            else:
                families.extend(
                    (at + p, a + ids[g] * bs, count, n, ps, as_)
                    for at, ids in zip(payload_at, blocks, strict=True)
                )
        return out + grids(families)


def _even(values: Sequence[int]) -> int | None:
    """The step of numbers that advance by one step, never backward; else None."""
    if len(values) < 2:
        return 0
    first, step = values[0], values[1] - values[0]
    if step < 0:
        return None
    even = [first] * len(values) if step == 0 else range(first, first + step * len(values), step)
    return step if list(values) == list(even) else None


def worth_grids(found: list[Grid], nbytes: int) -> bool:
    """Whether ``found`` moves enough bytes a call to be copied grid by grid: at
    least :data:`~kvarena.copy.thresholds.TORCH_SPAN_BYTES` on average (what
    the copy engine moves with one call of its own); else the engine's search
    takes the batch (short spans grouped, gathers), as for any layout it was
    not told."""
    return bool(found) and nbytes >= len(found) * TORCH_SPAN_BYTES
