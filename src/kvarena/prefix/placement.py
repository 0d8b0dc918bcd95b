"""Where a prefix cache keeps images: its policy, and what it learned from lookups.

The policy's rules (:mod:`~kvarena.prefix.policy`) name boundaries from the
prompt alone; two of them learn from the lookups the cache answers: the
branch rule (a boundary where a lookup found matching KV but no image is
wanted: the next request computing through it keeps one there) and ``learn``
(the grain on which prompts diverge, :mod:`~kvarena.prefix.grain`). Both read
where a prompt's known prefix ends, and the device's KV alone forgets that
too soon: a KV block evicted yesterday still says that two prompts shared up
to it. So the keys of evicted KV blocks are kept a while as ghosts
(:mod:`~kvarena.prefix.ghosts`) and the known prefix runs through them.
Measured on the shared trace (Qwen3-Next-80B, TP 8, 80 GiB): 0.89x -> 0.92x of
the KV-only hit tokens for ``end,interval:8192,branch``, 0.94x -> 0.95x with
``learn`` (``benchmarks/bench_prefix.py``).

``learn`` also learns, where prompts part anywhere, how far before its end a
prompt parts from the others (:class:`~kvarena.prefix.grain.SuffixLength`:
one more image that far back, inside the document many questions read), and
keeps images inside long prompts at an interval sized by what an image costs
(:func:`learned_interval`) where the policy names none.
"""

from __future__ import annotations

from collections.abc import Sequence

from .ghosts import Ghosts
from .grain import DivergenceGrain, SuffixLength
from .policy import CheckpointPolicy

GHOSTS_PER_BLOCK = 2
"""Evicted keys remembered per block of the pool: a prefix's ghosts outlive its KV
by about one more turn of the pool."""

INTERVAL_IMAGES = 16
"""``learn``'s interval holds this many images' worth of KV: images inside long
prompts cost at most 1/16 of what the prompt's KV holds."""


def learned_interval(block_size: int, image_blocks: int) -> int:
    """The interval ``learn`` keeps images at inside long prompts, in tokens: the
    power of two of blocks at or above :data:`INTERVAL_IMAGES` images' worth of
    blocks (an image of 25 blocks: 512 blocks; of 98 blocks, Qwen3-Next-80B's 39.5 MB
    state at TP 1: 2,048). A cheap image is kept often, a dear one seldom: on the
    shared trace at TP 1 an interval of 8,192 tokens reaches 0.85x of the KV-only
    hits, 16,384 0.88x, 32,768 0.88x (fewer images, more KV)."""
    blocks = 1
    while blocks < INTERVAL_IMAGES * max(1, image_blocks):
        blocks *= 2
    return blocks * block_size


class Placement:
    """The policy, the learned grain, the ghosts and the wanted branch points."""

    def __init__(
        self, policy: CheckpointPolicy, block_size: int, pool_blocks: int, image_blocks: int
    ) -> None:
        """For a pool of ``pool_blocks`` blocks whose images hold ``image_blocks`` each."""
        self.policy = policy
        self.block_size = block_size
        self.interval = learned_interval(block_size, image_blocks)
        self.grain = DivergenceGrain(block_size)
        self.suffix = SuffixLength(block_size)
        # Ghosts for twice the pool's blocks: about 150 bytes of host memory a key
        # (Python's), ~60 MB for 200k blocks, against the 80 GB those blocks hold.
        self.ghosts = Ghosts(GHOSTS_PER_BLOCK * pool_blocks)
        self._wanted: set[bytes] = set()  # branch points

    def boundaries(
        self, prompt_tokens: int, keys: Sequence[bytes], *, hit: int, matched: int, limit: int
    ) -> list[int]:
        """Block boundaries past ``hit`` where this prompt keeps an image, given the
        lookup's answer: ``hit`` blocks resumed, ``matched`` blocks of KV on the
        device, at most ``limit`` blocks a hit could have covered."""
        ghosts = self.ghosts
        while matched < limit and keys[matched] in ghosts:  # shared once, evicted since
            matched += 1
        if 0 < matched < limit:  # the known prefix ended inside the prompt
            self.grain.observe(matched * self.block_size)
            self.suffix.observe(prompt_tokens - matched * self.block_size)
        policy = self.policy
        grain = self.grain.grain() if policy.learn else 0
        back_off = self.suffix.back_off() if policy.learn and grain <= self.block_size else 0
        out = policy.boundaries(prompt_tokens, self.block_size, hit, grain, back_off, self.interval)
        if not policy.branch:
            return out
        if matched > hit:
            self._wanted.add(keys[matched - 1])
        full = min(len(keys), prompt_tokens // self.block_size)
        wanted = self._wanted
        return sorted(set(out) | {b for b in range(hit + 1, full + 1) if keys[b - 1] in wanted})

    def kept(self, key: bytes) -> None:
        """An image is kept at the boundary ending with ``key``: no longer wanted."""
        self._wanted.discard(key)

    def forgotten(self, keys: Sequence[bytes]) -> None:
        """The pool evicted the KV blocks of ``keys``: ghosts now."""
        self.ghosts.add(keys)
