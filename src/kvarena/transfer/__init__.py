"""Prefill -> decode transfer of blocks and request states on NIXL."""

from .descriptors import (
    DescriptorBoundsError,
    RequestDescriptors,
    per_layer_descriptor_count,
    plan_request,
)
from .geometry import CacheGeometry
from .nixl_agent import (
    DecodeReceiver,
    LayoutMismatchError,
    NixlEndpoint,
    PrefillSender,
    ReceiverEvents,
    ShipResult,
    TransferError,
    TransferTimeout,
    nixl_available,
)

__all__ = [
    "CacheGeometry",
    "DecodeReceiver",
    "DescriptorBoundsError",
    "LayoutMismatchError",
    "NixlEndpoint",
    "PrefillSender",
    "ReceiverEvents",
    "RequestDescriptors",
    "ShipResult",
    "TransferError",
    "TransferTimeout",
    "nixl_available",
    "per_layer_descriptor_count",
    "plan_request",
]
