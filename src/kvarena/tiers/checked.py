"""One path for checked objects: what an object must be, and fetching it so.

Both prefix caches above the tiers — kvarena's own :class:`PrefixCache` and the
vLLM connector's worker — keep the same objects (a KV block, a state image)
under the same keys, and load them the same way, here:

- :func:`object_span` is the one span rule: KV block ``i`` covers tokens
  ``[i·bs, (i+1)·bs)`` (a partial block of ``t`` tokens ``[i·bs, i·bs+t)``);
  the state at boundary ``b`` covers ``[0, b·bs)``.
- :class:`Expectations` says what an object must be to be used (kind, key,
  namespace, span, payload length) for one namespace and layout; the saver
  encodes from the same record.
- :func:`fetch_checked` fetches objects down a stack: each from the first tier
  that holds a good one, checked in full before a byte is used; one that
  fails its checks is deleted from that tier (nobody trips on it again) and
  looked for in the tiers below. It returns what it did — payloads, the
  names no tier could serve, the rejections by reason — for the caller to
  count, log or report.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import InvalidValueError
from .host import HostTier
from .image import Expected, ImageMismatch, TierObject, decode, encode
from .names import ImageKind
from .stack import TierStack


def object_span(
    kind: ImageKind, index: int, block_size: int, tokens: int | None = None
) -> tuple[int, int]:
    """The token span of an object: KV block ``index`` (a partial one holding its
    first ``tokens`` tokens), or the state at boundary ``index`` (in blocks)."""
    if kind is ImageKind.KV_BLOCK:
        if tokens is not None and not 0 < tokens < block_size:
            raise InvalidValueError(
                f"a partial KV block holds 1..{block_size - 1} tokens, got {tokens}"
            )
        return index * block_size, index * block_size + (tokens or block_size)
    if tokens is not None:
        raise InvalidValueError(
            f"a state image is taken at a block boundary, not {tokens} tokens in"
        )
    return 0, index * block_size


@dataclass(frozen=True, kw_only=True)
class Expectations:
    """What a KV block's or a state image's object must be in one namespace and
    layout (``elided``: a meta-device cache, whose objects carry headers only)."""

    namespace: bytes
    block_size: int
    kv_bytes: int
    state_bytes: int
    elided: bool = False

    def of(self, kind: ImageKind, key: bytes, index: int, tokens: int | None = None) -> Expected:
        """Object ``kind`` under ``key``: KV block ``index`` (partial: its first
        ``tokens`` tokens; its payload is still the whole page) or the state at
        boundary ``index``."""
        start, end = object_span(kind, index, self.block_size, tokens)
        return Expected(
            kind=kind,
            key=key,
            namespace=self.namespace,
            start=start,
            end=end,
            payload_bytes=self.kv_bytes if kind is ImageKind.KV_BLOCK else self.state_bytes,
            elided=self.elided,
        )

    def kv(self, key: bytes, index: int) -> Expected:
        return self.of(ImageKind.KV_BLOCK, key, index)

    def state(self, key: bytes, boundary: int) -> Expected:
        return self.of(ImageKind.STATE, key, boundary)

    def encode(
        self,
        kind: ImageKind,
        key: bytes,
        index: int,
        payload: Sequence[memoryview] | None,
        tokens: int | None = None,
    ) -> TierObject:
        """The object a load of :meth:`of` would take (unsealed: a tier outside
        this process's memory seals it on put, :meth:`Tier.stored`)."""
        e = self.of(kind, key, index, tokens)
        return encode(
            kind=kind,
            namespace=e.namespace,
            key=key,
            start=e.start,
            end=e.end,
            payload=None if self.elided else payload,
            payload_bytes=e.payload_bytes,
            seal=False,
        )


CORRUPT = frozenset({"truncated", "magic", "checksum", "length"})
"""The checks (:class:`~kvarena.tiers.image.ImageMismatch` reasons) an object
fails when its own bytes changed or were cut short; failing any other check
(namespace, kind, key, span, format version, unsealed, elided) it is a sound
image of something else."""


def failure_class(reason: str | None) -> str:
    """Why an object could not be used, as an operator counts it: ``missing``
    (no tier held it: ``reason`` None), ``corrupt`` or ``foreign``."""
    if reason is None:
        return "missing"
    return "corrupt" if reason in CORRUPT else "foreign"


@dataclass(frozen=True, kw_only=True)
class Rejected:
    """An object a tier held that failed its checks (deleted from that tier)."""

    label: str
    name: str
    reason: str  # ImageMismatch.reason
    detail: str


@dataclass(frozen=True, kw_only=True)
class Fetched:
    """What :func:`fetch_checked` did: ``payloads[i]`` is object ``i``'s checked
    payload (None: no tier served it); ``failed`` names those; ``rejected`` the
    objects deleted for failing their checks; ``dropped_hosted`` those of them
    deleted from a host tier (a catalogue of its names must forget them);
    ``seconds`` and ``read_bytes`` what each tier asked (by label) took: its
    reads and the checks of what it returned, and the stored bytes it returned;
    ``lent[i]``: where a host tier lent payload ``i`` in place, its level and
    where the payload starts in that tier's ``buffer`` (None elsewhere)."""

    payloads: list[memoryview | None]
    lent: list[tuple[int, int] | None]
    failed: list[str] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    read_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def dropped_hosted(self) -> list[str]:
        return [r.name for r in self.rejected if r.label.startswith("host")]

    def failures(self) -> dict[str, str]:
        """Each failed name with its :func:`failure_class` (the first tier's
        rejection where one rejected it; else it was missing everywhere)."""
        first: dict[str, str] = {}
        for r in self.rejected:
            first.setdefault(r.name, r.reason)
        return {n: failure_class(first.get(n)) for n in self.failed}


def fetch_checked(
    stack: TierStack,
    wanted: Sequence[tuple[str, Expected]],
    *,
    first: Sequence[int] | None = None,
    held: contextlib.ExitStack | None = None,
    last: int | None = None,
) -> Fetched:
    """Each ``(name, expectation)`` from the first tier at or below level
    ``first[i]`` (default: 0, the top) and at or above ``last`` (default: the
    bottom) that holds a good one.

    With ``held``, a host tier lends its objects in place (``HostTier.borrow``,
    kept open by ``held`` until the caller has copied them out): one copy,
    host to device; without it every payload is a tier's own copy."""
    if last is not None and not (isinstance(last, int) and 0 <= last < len(stack)):
        raise InvalidValueError(
            f"fetch_checked: last must name a level (0..{len(stack) - 1}) or be None, got {last!r}"
        )
    start = list(first) if first is not None else [0] * len(wanted)
    if len(start) != len(wanted) or not all(0 <= x < len(stack) for x in start):
        raise InvalidValueError(
            f"fetch_checked: first must name a level (0..{len(stack) - 1}) for each of the "
            f"{len(wanted)} objects, got {start[:8]}"
        )
    out: list[memoryview | None] = [None] * len(wanted)
    lent: list[tuple[int, int] | None] = [None] * len(wanted)
    rejected: list[Rejected] = []
    left = list(range(len(wanted)))
    seconds: dict[str, float] = {}
    read_bytes: dict[str, int] = {}
    for level, tier in enumerate(stack.tiers):
        if last is not None and level > last:
            break
        asking = [j for j in left if start[j] <= level]
        if not asking:
            continue
        label, began = stack.labels[level], time.perf_counter()
        names = [wanted[j][0] for j in asking]
        starts: Sequence[int | None]
        if held is not None and isinstance(tier, HostTier):
            pairs = held.enter_context(tier.lend(names))
            got: Sequence[object] = [p[0] if p is not None else None for p in pairs]
            starts = [p[1] if p is not None else None for p in pairs]
        else:
            got = stack.fetch(level, names)
            starts = [None] * len(names)
        served, bad = set(), []
        for j, data, at in zip(asking, got, starts, strict=True):
            if data is None:
                continue
            read_bytes[label] = read_bytes.get(label, 0) + len(data)  # type: ignore[arg-type]
            name, exp = wanted[j]
            try:
                payload = out[j] = decode(data, exp, trusted=tier.trusted)  # type: ignore[arg-type]
                served.add(j)
                if at is not None:  # decode's payload is the image's tail, in place
                    lent[j] = (level, at + len(data) - len(payload))  # type: ignore[arg-type]
            except ImageMismatch as exc:
                rejected.append(
                    Rejected(
                        label=stack.labels[level], name=name, reason=exc.reason, detail=str(exc)
                    )
                )
                bad.append(name)
        if bad:
            stack.drop(level, bad)
        seconds[label] = time.perf_counter() - began
        left = [j for j in left if j not in served]
    return Fetched(
        payloads=out,
        lent=lent,
        failed=[wanted[j][0] for j in left],
        rejected=rejected,
        seconds=seconds,
        read_bytes=read_bytes,
    )
