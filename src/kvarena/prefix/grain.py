"""Where prompts diverge, learned: the alignment of the boundaries at which shared KV ends.

A lookup whose KV run stops before the prompt's end found where this prompt
parts from everything cached: a divergence point. In a trace whose prompts
are built from fixed-size pieces (a Mooncake trace's 512-token hash blocks,
a chat template that pads turns) every divergence lies on a multiple of that
piece, and an image kept at the prompt's last such multiple is exactly where
the next prompt extending it will diverge; an image at the prompt's last
block boundary lies inside the piece the next prompt changes, and is never
read. :class:`DivergenceGrain` counts, for each power-of-two multiple of the
block size, how many observed divergence points it divides, and answers the
largest one that divides nearly all of them — the block size itself when
prompts diverge anywhere. O(17) counters per observation, no history kept.
"""

from __future__ import annotations

from ..checks import check_count

MAX_GRAIN_TOKENS = 1 << 16
"""The largest grain considered (65,536 tokens): beyond it an end image rarely pays."""

MIN_OBSERVATIONS = 16
"""Divergences seen before a grain above the block size is believed."""

SHARE = 0.9
"""The share of divergence points a grain must divide (a few odd points do not break it)."""


class DivergenceGrain:
    """Counts of divergence points by the power-of-two multiples of the block size they fall on."""

    def __init__(self, block_size: int) -> None:
        self.block_size = check_count(block_size, "DivergenceGrain: block_size", lo=1)
        self.candidates: list[int] = []
        g = self.block_size
        while g <= MAX_GRAIN_TOKENS:
            self.candidates.append(g)
            g *= 2
        self.counts = [0] * len(self.candidates)
        self.observed = 0

    def observe(self, tokens: int) -> None:
        """A divergence point, in tokens (a multiple of the block size, above 0)."""
        self.observed += 1
        for i, g in enumerate(self.candidates):
            if tokens % g:
                break  # a power-of-two ladder: once one does not divide, none above does
            self.counts[i] += 1

    def grain(self) -> int:
        """The largest candidate dividing at least ``SHARE`` of the points seen (the block
        size until ``MIN_OBSERVATIONS`` points were seen)."""
        if self.observed < MIN_OBSERVATIONS:
            return self.block_size
        best = self.block_size
        for g, n in zip(self.candidates, self.counts, strict=True):
            if n >= SHARE * self.observed:
                best = g
        return best


class SuffixLength:
    """How far before its end a prompt parts from the others: the unique suffix.

    Where prompts diverge anywhere (no grain above the block size), a prompt's
    own end image serves only a prompt that continues it (a chat's next turn);
    a prompt that shares all but its question (one document, many questions)
    parts from it somewhere before the end. The length of the unique suffix
    behind each observed divergence, kept on a ladder of half octaves of
    blocks, answers how far back an image must lie to sit inside the shared
    part for ``SHARE`` of such prompts. O(40) counters, no history kept.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = check_count(block_size, "SuffixLength: block_size", lo=1)
        rungs = {1}
        r = 2
        while r <= MAX_GRAIN_TOKENS // self.block_size:
            rungs.update((r, r + r // 2))
            r *= 2
        self.rungs = sorted(rungs)  # suffix lengths in blocks: 1, 2, 3, 4, 6, 8, 12, ...
        self.counts = [0] * len(self.rungs)
        self.observed = 0

    def observe(self, suffix_tokens: int) -> None:
        """A diverging prompt's tokens past the point where it parted (above 0)."""
        blocks = -(-suffix_tokens // self.block_size)
        self.observed += 1
        for i, r in enumerate(self.rungs):
            if blocks <= r:
                self.counts[i] += 1
                return
        self.counts[-1] += 1  # longer than the ladder: counted at its top

    def back_off(self) -> int:
        """Tokens before a prompt's end that cover ``SHARE`` of the suffixes seen (0
        until ``MIN_OBSERVATIONS`` were seen)."""
        if self.observed < MIN_OBSERVATIONS:
            return 0
        seen = 0
        for r, n in zip(self.rungs, self.counts, strict=True):
            seen += n
            if seen >= SHARE * self.observed:
                return r * self.block_size
        return self.rungs[-1] * self.block_size
