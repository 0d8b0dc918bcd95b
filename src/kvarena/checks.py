"""Validation of each kind of value, written once and used at every door.

A count, a byte size, an id or a list of ids is checked here and nowhere else,
so every entry point refuses the same nonsense with the same words: the value
that was given and what would be legal. ``bool`` is refused wherever an int is
expected (``True`` is an int to Python, never a count to a user), and floats
are never truncated into ids.
"""

from __future__ import annotations

import array
import numbers
import re
import sys
from collections.abc import Hashable, Iterable, Sequence
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidValueError

if TYPE_CHECKING:
    import torch


def _is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor, without importing torch: a value
    can be one only once torch is loaded, so a command that checks a count or
    a size never pays torch's import."""
    loaded = sys.modules.get("torch")
    return loaded is not None and isinstance(value, loaded.Tensor)


MAX_BYTES = 1 << 60
"""The largest byte count or offset kvarena accepts (1 EiB): far above any
real memory, far enough below 2**63 that sums of a few such values never wrap
an int64 address computation."""


MAX_ENTRIES = 1 << 26
"""The most entries (blocks or slots) one allocator or arena indexes: 67M, far
above any real pool (80 GiB of 16 KiB blocks is 5M), low enough that an
allocator's books fit in memory."""


def _legal(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an int in {lo}..{hi}"
    if lo is not None:
        return f"an int >= {lo}"
    if hi is not None:
        return f"an int <= {hi}"
    return "an int"


def check_int(value: Any, what: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as a Python int if it is an integer in ``[lo, hi]``, else refuse.

    Python ints and numpy integers pass; bools, floats (even integral ones),
    strings and tensors do not.
    """
    if type(value) is int:  # the common case, without the ABC check's cost
        v = value
    elif isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidValueError(f"{what} must be {_legal(lo, hi)}, got {value!r}")
    else:
        v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidValueError(f"{what} must be {_legal(lo, hi)}, got {v}")
    return v


def check_count(value: Any, what: str, *, lo: int = 0, hi: int | None = None) -> int:
    """A count of things (entries, slots, layers): an int >= ``lo`` (default 0)."""
    return check_int(value, what, lo=lo, hi=hi)


def check_bytes(value: Any, what: str, *, lo: int = 0) -> int:
    """A byte size or offset: an int in ``lo..MAX_BYTES``."""
    return check_int(value, what, lo=lo, hi=MAX_BYTES)


def integer_array(values: Any, what: str) -> np.ndarray:
    """``values`` (an integer tensor, array or list) as an int64 array of its shape.

    Floats, bools and strings are refused (an offset of 2.9 is never byte 2),
    and so is an unsigned value above MAX_BYTES, which int64 would wrap.
    """
    if _is_tensor(values):
        values = values.detach().cpu().numpy()
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError):
        raise InvalidValueError(f"{what} must hold integers, got {values!r}") from None
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidValueError(f"{what} must hold integers, got an array of {arr.dtype}")
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) > MAX_BYTES:
        raise InvalidValueError(f"{what} holds a value above {MAX_BYTES}")
    return arr.astype(np.int64)


_BOOL_TYPES = frozenset({bool, np.bool_})


def check_ids(values: Any, what: str, *, lo: int, hi: int) -> np.ndarray:
    """Ids in ``[lo, hi)`` as an int64 array, from a sequence of ints or an integer array.

    Accepts Python ints, numpy integers, integer numpy arrays and integer
    tensors; refuses floats, bools and strings (a slot 2.9 is never slot 2).
    """
    if isinstance(values, np.ndarray) or _is_tensor(values):
        flat = integer_array(values, what).reshape(-1)
        bad = flat[(flat < lo) | (flat >= hi)]
        if bad.size:
            _out_of_range(what, int(bad[0]), lo, hi)
        return flat
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidValueError(f"{what} must be a sequence of ints, got {values!r}")
    if isinstance(values, (list, tuple)) and values:
        fast = int_lists([values])
        if fast is not None:
            return check_ids(fast, what, lo=lo, hi=hi)
    ids = [check_int(v, f"{what}[{i}]") for i, v in enumerate(values)]
    for v in ids:
        if not lo <= v < hi:
            _out_of_range(what, v, lo, hi)
    return np.asarray(ids, dtype=np.int64)


def int_lists(lists: Sequence[Sequence[Any]]) -> np.ndarray | None:
    """Lists of plain ints, one after another, as one flat int64 array; None
    where any item is not one (a float, a string, a bool, an int beyond
    int64), so the caller checks item by item and names the culprit.

    The fast road for the id lists allocators hand out: ``array.fromlist``
    converts a list of ints in one C loop without numpy's type discovery
    (64 lists of 656 ids: 0.58 ms, against 1.3 ms joined and read by numpy)
    and refuses floats and strings itself. A bool is an int to it, so the
    items read as 0 or 1 (ids an allocator hands out once each) are looked
    at by type.
    """
    buf = array.array("q")
    try:
        for values in lists:
            buf.fromlist(values if isinstance(values, list) else list(values))
    except (TypeError, OverflowError):
        return None
    if not buf:
        return np.zeros(0, dtype=np.int64)
    flat = np.frombuffer(buf, dtype=np.int64)
    small = np.flatnonzero(flat <= 1)
    if small.size:
        ends = np.cumsum([len(values) for values in lists])
        which = np.searchsorted(ends, small, side="right").tolist()
        at = (small - np.concatenate(([0], ends))[which]).tolist()
        if any(type(lists[k][i]) in _BOOL_TYPES for k, i in zip(which, at, strict=True)):
            return None
    return flat


def _out_of_range(what: str, value: int, lo: int, hi: int) -> None:
    legal = f"{lo}..{hi - 1}" if hi > lo else "none (the range is empty)"
    raise InvalidValueError(f"{what}: id {value} is out of range; legal: {legal}")


def check_key(value: Any, what: str) -> Hashable:
    """An identity (a request id, a cache key): any hashable value except None,
    which reads as "no owner" / "no key" wherever such ids are looked up."""
    if value is None:
        raise InvalidValueError(
            f"{what} None is refused: it reads as 'none'; use any other hashable value"
        )
    try:
        hash(value)
    except TypeError:
        raise InvalidValueError(f"{what} {value!r} is not hashable") from None
    return value


def check_request_id(request: Any) -> Hashable:
    """A request id: any hashable value except None (which reads as "no owner")."""
    return check_key(request, "request id")


def check_choice(value: Any, what: str, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices``, else refuse naming them."""
    options = tuple(choices)
    if value not in options:
        raise InvalidValueError(
            f"{what} must be one of {', '.join(map(repr, options))}; got {value!r}"
        )
    return value


def check_device(device: Any) -> torch.device:
    """A torch device this process can allocate on, else refuse naming what exists."""
    import torch  # the callers allocate on it: torch is theirs already

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidValueError(
            f"device {device!r} is not a torch device (e.g. 'cpu', 'cuda:0')"
        ) from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidValueError(
                f"device {device!r}: this machine has no CUDA device; use 'cpu'"
            )
        if dev.index is not None and dev.index >= count:
            raise InvalidValueError(f"device {device!r}: legal CUDA indices are 0..{count - 1}")
    elif dev.type not in ("cpu", "meta"):  # meta: shapes and books, no bytes (replays)
        backend = getattr(torch, dev.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise InvalidValueError(f"device {device!r} is not available here; use 'cpu'")
    return dev


MAX_TIMEOUT_S = 24 * 3600.0
"""Timeouts beyond a day are refused (a typo, not a deadline)."""


def check_timeout(value: Any, what: str) -> float:
    """A timeout in seconds: a finite number in ``(0, MAX_TIMEOUT_S]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidValueError(f"{what} must be seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
    seconds = float(value)
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise InvalidValueError(f"{what} must be seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
    return seconds


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """``"40GiB"``, ``"40G"`` (binary), ``"40GB"`` (decimal), ``"1048576"`` -> bytes.

    Exact: the number is read as a decimal, never through a float, so a large
    byte count is not rounded; a size that is not a whole number of bytes or
    exceeds 1 EiB is refused.
    """
    match = re.fullmatch(r"\s*([0-9]{0,30}\.?[0-9]{1,30})\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidValueError(
            f"{text!r} is not a size; use e.g. 40GiB, 512MiB, 80GB or a byte count"
        )
    try:
        exact = Decimal(match.group(1)) * _UNITS[unit]
    except InvalidOperation:
        raise InvalidValueError(f"{text!r} is not a size") from None
    if exact != exact.to_integral_value():
        raise InvalidValueError(f"{text!r} is not a whole number of bytes ({exact})")
    value = int(exact)
    if value > MAX_BYTES:
        raise InvalidValueError(f"{text!r} exceeds the largest budget, {MAX_BYTES:,} bytes (1 EiB)")
    if value <= 0:
        raise InvalidValueError(f"{text!r} must be positive")
    return value


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` -> seconds (a bare number
    is seconds); refused, naming the forms, where it is none of them."""
    match = re.fullmatch(r"\s*([0-9]{1,12}(?:\.[0-9]{1,6})?)\s*([smhdw]?)\s*", str(text))
    if match is None:
        raise InvalidValueError(f"{text!r} is not a duration; use e.g. 90s, 30m, 12h, 7d, 2w")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
