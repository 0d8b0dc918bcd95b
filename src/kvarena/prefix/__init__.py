"""The prefix cache: keys, the lookup contract, checkpoint policy, one LRU."""

from .cache import PrefixCache
from .keys import Namespace, block_keys
from .lookup import TierFinds, locate_in_tiers, resume_boundary
from .policy import DEFAULT_POLICY, CheckpointPolicy
from .records import Admission, Image, ImageState, PrefixHit, PrefixMetrics, image_key

__all__ = [
    "DEFAULT_POLICY",
    "Admission",
    "CheckpointPolicy",
    "Image",
    "ImageState",
    "Namespace",
    "PrefixCache",
    "PrefixHit",
    "PrefixMetrics",
    "TierFinds",
    "block_keys",
    "image_key",
    "locate_in_tiers",
    "resume_boundary",
]
