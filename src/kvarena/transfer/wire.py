"""Request ids on the wire: what a transfer notification and the control channel carry.

A request id is any hashable (``kvarena.checks.check_request_id``), but a
notification is bytes and the control channel is JSON: ``7`` sent as text
comes back as ``"7"``, a tuple as a list (not even hashable), and the request
is never marked ready. So an id crosses as a small tagged JSON value that
decodes to an equal value of the same type — str, int, bytes, float, bool, or
tuples of them — and an id of any other type is refused where it enters
(``expect``, ``ship``, ``offer``) rather than lost on the way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Iterable
from typing import Any

from ..checks import check_request_id
from ..errors import InvalidValueError

MAX_ID_BYTES = 4096
"""An encoded id longer than this is refused (a notification is a small message)."""
MAX_DEPTH = 8

_TYPES = "str, int, bytes, float, bool or tuples of them"


def _tag(value: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise InvalidValueError(f"request id nests deeper than {MAX_DEPTH} tuples")
    if isinstance(value, bool):  # before int: True is an int
        return ["?", value]
    if isinstance(value, int):
        return ["i", str(value)]
    if isinstance(value, str):
        return ["s", value]
    if isinstance(value, bytes):
        return ["b", value.hex()]
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidValueError(f"request id {value!r}: a float id must be finite")
        return ["f", value.hex()]
    if isinstance(value, tuple):
        return ["t", [_tag(v, depth + 1) for v in value]]
    raise InvalidValueError(
        f"request id {value!r} ({type(value).__name__}) cannot cross a transfer; use a {_TYPES}"
    )


def encode_request(request: object) -> str:
    """``request`` as the text a notification or a control message carries."""
    check_request_id(request)
    text = json.dumps(_tag(request, 1), separators=(",", ":"), ensure_ascii=True)
    if len(text) > MAX_ID_BYTES:
        raise InvalidValueError(
            f"request id {request!r} encodes to {len(text):,} bytes; at most {MAX_ID_BYTES:,}"
        )
    return text


def _untag(v: Any, depth: int) -> Any:
    if not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], str) or depth > MAX_DEPTH:
        raise ValueError("not a tagged id")
    tag, x = v
    if tag == "?" and isinstance(x, bool):
        return x
    if tag == "i" and isinstance(x, str) and x.lstrip("-").isascii() and x.lstrip("-").isdigit():
        return int(x)
    if tag == "s" and isinstance(x, str):
        return x
    if tag == "b" and isinstance(x, str):
        return bytes.fromhex(x)
    if tag == "f" and isinstance(x, str):
        return float.fromhex(x)
    if tag == "t" and isinstance(x, list):
        return tuple(_untag(e, depth + 1) for e in x)
    raise ValueError(f"unknown tag {tag!r}")


def decode_request(text: object) -> Hashable | None:
    """The id :func:`encode_request` wrote, or None for text it did not write
    (a foreign or garbled notification: the caller counts it as refused)."""
    if not isinstance(text, str) or len(text) > MAX_ID_BYTES:
        return None
    try:
        value = _untag(json.loads(text), 1)
    except (ValueError, RecursionError, TypeError, OverflowError):
        return None
    return value


def notification(kind: str, transfer: int, request: Hashable) -> bytes:
    """A transfer's notification: ``w`` (its WRITE landed) or ``a`` (its sender
    aborted it, and no byte of it can land any more), with the transfer id and
    the request id in its wire form (:mod:`.wire`: it decodes to an equal id)."""
    return f"{kind}:{transfer}:{encode_request(request)}".encode()


def parse_notification(msg: bytes) -> tuple[str, int, Hashable] | None:
    kind, _, rest = msg.decode(errors="replace").partition(":")
    tid, _, text = rest.partition(":")
    request = decode_request(text)
    if kind in ("w", "a") and tid.isascii() and tid.isdigit() and request is not None:
        return kind, int(tid), request
    return None


def in_order(ids: Iterable[Hashable]) -> list[Hashable]:
    """Request ids sorted (by their repr where their types do not compare)."""
    ids = list(ids)
    try:
        return sorted(ids)  # type: ignore[type-var]
    except TypeError:
        return sorted(ids, key=repr)


PULLED = "pulled:"
"""The prefix of a pull's completion notification (then the request's wire form)."""
