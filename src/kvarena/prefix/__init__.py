"""The prefix cache: keys, the lookup contract, checkpoint policy, one LRU."""

from .cache import PrefixCache
from .keys import Namespace, block_keys, key_root
from .lookup import ImagesWalked, TierFinds, locate_in_tiers, resume_point
from .policy import DEFAULT_POLICY, CheckpointPolicy
from .records import (
    Admission,
    Image,
    ImageState,
    PrefixHit,
    PrefixMetrics,
    image_key,
    plan_namespace,
)

__all__ = [
    "DEFAULT_POLICY",
    "Admission",
    "CheckpointPolicy",
    "Image",
    "ImageState",
    "ImagesWalked",
    "Namespace",
    "PrefixCache",
    "PrefixHit",
    "PrefixMetrics",
    "TierFinds",
    "block_keys",
    "image_key",
    "key_root",
    "locate_in_tiers",
    "plan_namespace",
    "resume_point",
]
