"""Request traces: the Mooncake FAST'25 format and a plain one, checked line by line.

A Mooncake line gives ``hash_ids``, one per 512-token block; each id expands into
512 deterministic token ids, so equal ids give equal token blocks and the cache's
own hashing finds the reuse. A plain line gives its ``tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checks import check_count
from ..errors import InvalidValueError

MOONCAKE_BLOCK = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces."""


class TraceError(InvalidValueError):
    """A trace line that cannot be replayed; the message names the line."""


@dataclass(frozen=True, kw_only=True)
class TraceRequest:
    arrival_ms: float
    tokens: np.ndarray
    output_tokens: int


def _mooncake_tokens(hash_ids: list[int], input_length: int, where: str) -> np.ndarray:
    n = len(hash_ids)
    if not (MOONCAKE_BLOCK * (n - 1) < input_length <= MOONCAKE_BLOCK * n):
        raise TraceError(
            f"{where}: input_length {input_length} does not fit {n} hash ids of "
            f"{MOONCAKE_BLOCK} tokens"
        )
    ids = np.asarray(hash_ids, dtype=np.int64)
    tokens = (ids[:, None] * MOONCAKE_BLOCK + np.arange(MOONCAKE_BLOCK)).reshape(-1)
    return tokens[:input_length]


def parse_trace(
    lines: Iterable[str], *, source: str = "trace", limit: int | None = None
) -> list[TraceRequest]:
    """Requests from trace lines, checked line by line (sorted by arrival). A
    trace with no request (empty, or blank lines alone) is refused: replaying
    nothing would print a table of zeros for what is almost surely the wrong
    file."""
    out: list[TraceRequest] = []
    for i, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        where = f"{source}:{i}"
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            # ValueError covers JSONDecodeError and an integer of thousands of
            # digits, which the JSON reader refuses to convert.
            raise TraceError(f"{where}: not a JSON object a replay can read") from None
        if not isinstance(row, dict):
            raise TraceError(f"{where}: not a JSON object")
        try:
            ts = row.get("timestamp", 0)
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < 1e15:
                raise TraceError(f"{where}: timestamp must be milliseconds >= 0, got {ts!r}")
            output = check_count(row.get("output_length", 0), f"{where}: output_length", hi=1 << 24)
            if "tokens" in row:
                tokens = row["tokens"]
                if (
                    not isinstance(tokens, list)
                    or not tokens
                    or not all(
                        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 62
                        for t in tokens
                    )
                ):
                    raise TraceError(f"{where}: tokens must be a non-empty list of token ids")
                arr = np.asarray(tokens, dtype=np.int64)
            else:
                ids = row.get("hash_ids")
                if (
                    not isinstance(ids, list)
                    or not ids
                    or not all(
                        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 40
                        for h in ids
                    )
                ):
                    raise TraceError(f"{where}: hash_ids must be a non-empty list of ids >= 0")
                length = check_count(
                    row.get("input_length"), f"{where}: input_length", lo=1, hi=1 << 24
                )
                arr = _mooncake_tokens(ids, length, where)
        except InvalidValueError as exc:
            raise TraceError(str(exc)) from None
        out.append(TraceRequest(arrival_ms=float(ts), tokens=arr, output_tokens=output))
    if not out and limit != 0:
        raise TraceError(f"{source}: no request in it (a JSON object a line)")
    out.sort(key=lambda r: r.arrival_ms)  # stable: equal timestamps keep file order
    return out


def load_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as fh:
            return parse_trace(fh, source=str(p), limit=limit)
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{p}: cannot read the trace ({exc})") from None
