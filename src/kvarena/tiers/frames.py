"""The host tier's frames: the sizes its buffer is cut into.

Apart from :mod:`.host` (which holds a tensor, and so imports torch): the
stack's and the specs' defaults name them without loading torch, so a
process that never opens a host tier (``kvarena tiers``) never pays for it.
"""

DEFAULT_FRAME_BYTES = 64 << 10
MIN_FRAME_BYTES = 512
MAX_FRAMES = 1 << 24
"""The tier's books (a free-id set and heap, an LRU entry per object) cost about
100 B a frame in Python: frames of at least 512 B keep them under a fifth of the
tier, and at most 16M frames under 2 GB whatever the capacity."""
