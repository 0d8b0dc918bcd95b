"""Prefill -> decode transfer of blocks and request states on NIXL.

:mod:`.endpoint` is one side (a NIXL agent over a cache's buffer), :mod:`.sender`
the prefill side, :mod:`.receiver` the decode side, :mod:`.wire` what their
notifications carry, :mod:`.geometry` and :mod:`.descriptors` what the two sides
agree on and post, :mod:`.service` the ZeroMQ control channel between hosts.
"""

from .descriptors import (
    DescriptorBoundsError,
    RequestDescriptors,
    per_layer_descriptor_count,
    plan_request,
)
from .endpoint import (
    LayoutMismatchError,
    NixlEndpoint,
    ShipResult,
    TransferError,
    TransferTimeout,
    nixl_available,
)
from .geometry import CacheGeometry
from .receiver import DecodeReceiver, ReceiverEvents
from .sender import PrefillSender

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
