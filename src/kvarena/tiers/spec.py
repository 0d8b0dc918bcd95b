"""``TierSpec``: one tier as its spec string names it, parsed once.

The grammar (:data:`SPEC_FORMS`) is read here and nowhere else: the CLI's
``--tier``, the vLLM connector's ``tiers`` setting, each tensor-parallel
rank's share of them and the scheduler's catalogue all hold ``TierSpec``
records, and a tier is opened from one (:meth:`TierSpec.open`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import urllib.parse
from dataclasses import dataclass

from ..checks import check_count, parse_bytes
from ..errors import Error, InvalidValueError
from .base import Tier
from .disk import DiskTier
from .frames import DEFAULT_FRAME_BYTES
from .mooncake_tier import DEFAULT_SEGMENT_BYTES, MooncakeTier
from .redact import VARIABLE, redacted
from .redis_tier import RedisTier

SPEC_FORMS = (
    "host:SIZE, disk:DIR:SIZE, redis://[:PASSWORD@]HOST:PORT[/DB], redis+cluster://HOST:PORT, "
    "mooncake://HOST:PORT[/SEGMENT]"
)
KINDS = ("host", "disk", "redis", "mooncake")
_MOONCAKE = "mooncake://"
_REDIS = ("redis://", "rediss://", "unix://")
_CLUSTER = "redis+cluster://"


class TierSpecError(InvalidValueError):
    """A spec string that names no tier; ``reason`` says why, without the spec
    (a caller that names the spec its own way, a settings key, adds it)."""

    def __init__(self, spec: object, reason: str) -> None:
        shown = redacted(spec) if isinstance(spec, str) else spec
        super().__init__(f"tier {shown!r}: {reason}")
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class TierSpec:
    """A tier's kind and where it lives: ``size`` for host and disk (bytes),
    ``directory`` for disk, ``url`` (as redis-py takes it) and ``cluster`` for a
    shared store; for Mooncake ``url`` is the master's HOST:PORT and ``size`` the
    segment this process contributes. ``str()`` gives the spec back in its
    canonical form."""

    kind: str
    size: int | None = None
    directory: str | None = None
    url: str | None = None
    cluster: bool = False

    @classmethod
    def parse(cls, spec: object) -> TierSpec:
        """The spec string's tier, refused (naming the forms) where it names none."""
        if isinstance(spec, TierSpec):
            return spec
        if not isinstance(spec, str) or not spec.strip():
            raise TierSpecError(spec, f"use {SPEC_FORMS}")
        text = spec.strip()
        if text.startswith((*_REDIS, _CLUSTER)):
            _check_variables(spec, text)
        if text.startswith(_REDIS):
            return cls(kind="redis", url=text)
        if text.startswith(_CLUSTER):
            return cls(kind="redis", url="redis://" + text[len(_CLUSTER) :], cluster=True)
        if text.startswith(_MOONCAKE):
            return cls._mooncake(spec, text[len(_MOONCAKE) :])
        kind, _, rest = text.partition(":")
        size: str | None = None
        directory = None
        if kind == "host" and rest:
            size = rest
        elif kind == "disk":
            m = re.fullmatch(r"(.+):([^:]+)", rest)
            if m:
                directory, size = m.group(1), m.group(2)
        if size is None:
            raise TierSpecError(spec, f"use {SPEC_FORMS}")
        try:
            nbytes = parse_bytes(size)
        except Error as exc:
            raise TierSpecError(spec, str(exc)) from None
        return cls(kind=kind, size=nbytes, directory=directory)

    @classmethod
    def _mooncake(cls, spec: object, rest: str) -> TierSpec:
        where, _, segment = rest.partition("/")
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise TierSpecError(spec, "a Mooncake master is mooncake://HOST:PORT[/SEGMENT]")
        try:
            size = parse_bytes(segment) if segment else DEFAULT_SEGMENT_BYTES
        except Error as exc:
            raise TierSpecError(spec, str(exc)) from None
        return cls(kind="mooncake", url=where, size=size)

    @classmethod
    def parse_place(cls, text: object) -> TierSpec:
        """Where a tier's objects live, as one reads them from outside an engine
        (``kvarena tiers``): any spec, a disk spec without its size, or a bare
        directory (a disk tier's). The size, which only a tier's owner needs,
        is None where not given."""
        if isinstance(text, str) and text.strip():
            t = text.strip()
            if not t.startswith(("host:", "disk:", *_REDIS, _CLUSTER, _MOONCAKE)):
                return cls(kind="disk", directory=t)
            if t.startswith("disk:") and t.count(":") == 1:
                return cls(kind="disk", directory=t[len("disk:") :])
        return cls.parse(text)

    def __str__(self) -> str:
        """The canonical spec, a store's password in it (it opens the same tier);
        shown to people as :func:`redacted` gives it."""
        if self.kind == "host":
            return f"host:{self.size}"
        if self.kind == "disk":
            return f"disk:{self.directory}:{self.size}"
        assert self.url is not None
        if self.kind == "mooncake":
            return f"{_MOONCAKE}{self.url}/{self.size}"
        return _CLUSTER + self.url[len("redis://") :] if self.cluster else self.url

    def share(self, parts: int, *, directory: str | None = None) -> TierSpec:
        """This tier's ``1/parts`` share (a host or disk size divided; a shared
        store is shared whole), in ``directory`` where given (disk)."""
        parts = check_count(parts, "TierSpec.share: parts", lo=1)
        if self.size is None:
            return self
        return dataclasses.replace(
            self,
            size=self.size // parts,
            directory=directory if directory is not None else self.directory,
        )

    def open(self, *, frame_bytes: int = DEFAULT_FRAME_BYTES, pin_memory: bool = False) -> Tier:
        """Open the tier (a directory is taken, a server connected to)."""
        if self.kind == "host":
            from .host import HostTier  # torch: loaded by the tier that holds a tensor

            assert self.size is not None
            return HostTier(self.size, frame_bytes=frame_bytes, pin_memory=pin_memory)
        if self.kind == "disk":
            assert self.size is not None and self.directory is not None
            return DiskTier(self.directory, self.size)
        assert self.url is not None
        if self.kind == "mooncake":
            assert self.size is not None
            return MooncakeTier(self.url, segment_bytes=self.size)
        return RedisTier(self.store_url(), cluster=self.cluster)

    def store_url(self) -> str:
        """The shared store's URL as its client connects: each ``${NAME}`` in the
        spec the environment variable ``NAME``, quoted for a URL (redis-py
        unquotes a password). A spec names a secret this way, so that neither
        it nor anything printed from it — vLLM's own log of its
        ``--kv-transfer-config`` above all — holds the secret itself; a
        variable gone since the spec was parsed is refused here, naming it."""
        assert self.url is not None
        _check_variables(str(self), self.url)
        return VARIABLE.sub(lambda m: urllib.parse.quote(os.environ[m.group(1)], safe=""), self.url)


def _check_variables(spec: object, url: str) -> None:
    """Refuse a store URL naming a variable the environment lacks, naming it."""
    missing = [n for n in VARIABLE.findall(url) if n not in os.environ]
    if missing:
        raise TierSpecError(
            spec,
            f"the environment has no {missing[0]} (a store URL's ${{NAME}} is the "
            "environment variable NAME, read when the tier opens)",
        )
