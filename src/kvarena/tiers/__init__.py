"""Tiers below the device — host memory, local disk, a shared Redis store — and
the one image format they all hold (checksummed, namespaced, verified on load).

:class:`HostTier` is imported when first named: it holds a tensor, and so
torch, which the disk and shared tiers and their command (``kvarena tiers``)
never need."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Put, Tier, TierError, TierMetrics, TierWarning
from .disk import DiskTier
from .image import (
    Expected,
    ImageHeader,
    ImageMismatch,
    TierObject,
    decode,
    encode,
    read_header,
    seal,
)
from .mooncake_tier import MooncakeTier
from .names import ImageKind, object_name
from .redis_tier import RedisTier
from .spec import SPEC_FORMS, TierSpec, TierSpecError
from .stack import TierStack, parse_tier

__all__ = [
    "SPEC_FORMS",
    "DiskTier",
    "Expected",
    "HostTier",
    "ImageHeader",
    "ImageKind",
    "ImageMismatch",
    "MooncakeTier",
    "Put",
    "RedisTier",
    "Tier",
    "TierError",
    "TierMetrics",
    "TierObject",
    "TierSpec",
    "TierSpecError",
    "TierStack",
    "TierWarning",
    "decode",
    "encode",
    "object_name",
    "parse_tier",
    "read_header",
    "seal",
]


if TYPE_CHECKING:
    from .host import HostTier


def __getattr__(name: str) -> Any:
    if name == "HostTier":
        from .host import HostTier

        return HostTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
