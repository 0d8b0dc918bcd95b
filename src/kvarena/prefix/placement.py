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
"""

from __future__ import annotations

from collections.abc import Sequence

from .ghosts import Ghosts
from .grain import DivergenceGrain
from .policy import CheckpointPolicy


class Placement:
    """The policy, the learned grain, the ghosts and the wanted branch points."""

    def __init__(self, policy: CheckpointPolicy, block_size: int, ghost_capacity: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.grain = DivergenceGrain(block_size)
        self.ghosts = Ghosts(ghost_capacity)
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
        policy = self.policy
        out = policy.boundaries(
            prompt_tokens, self.block_size, hit, self.grain.grain() if policy.learn else 0
        )
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
