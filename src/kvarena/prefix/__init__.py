"""The prefix cache: keys, the lookup contract, checkpoint policy, one LRU."""

from .cache import Admission, Image, ImageState, PrefixCache, PrefixHit, PrefixMetrics
from .keys import Namespace, block_keys
from .policy import CheckpointPolicy

__all__ = [
    "Admission",
    "CheckpointPolicy",
    "Image",
    "ImageState",
    "Namespace",
    "PrefixCache",
    "PrefixHit",
    "PrefixMetrics",
    "block_keys",
]
