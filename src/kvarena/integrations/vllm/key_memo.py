"""kvarena's keys of prefixes met before, found by vLLM's own block hashes.

vLLM hashes every prompt for its prefix cache before the scheduler asks the
connector anything (``Request.block_hashes``): block ``i``'s hash is chained
over every token up to its end, the LoRA, the cache salt and multimodal
inputs, so one hash names one prefix. A prompt that shares a system prompt
or a conversation's earlier turns with one keyed before need not run
kvarena's BLAKE2b chain over those tokens again: the deepest of its hashes
the memo knows gives every key up to there at once (a slice of the chain
that learnt it), and only the blocks past it are hashed.

vLLM's hash stands for kvarena's key only where it is a cryptographic hash
(:func:`trusted_hashes`: a collision there would load another prefix's
bytes), and per set of kvarena's extra keys (kvarena's keys hash the LoRA's
name, vLLM's need not).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

KEPT = 1 << 17
"""Keys the chains a memo holds may hold together (16 B each, and a name where
one was made): the chains learnt first are forgotten first past it."""

TRUSTED_HASHES = ("sha256", "sha256_cbor")
"""vLLM's ``prefix_caching_hash_algo`` values a :class:`KeyMemo` trusts."""


class Chain:
    """One request's keys and KV object names, as far as made: what the memo's
    entries point into (the request's own lists, shared, never copied)."""

    def __init__(self, keys: list[bytes], names: list[str]) -> None:
        self.keys, self.names = keys, names
        self.learnt: list[bytes] = []  # the vLLM hashes whose entries point here
        self.counted = 0  # its keys counted against the memo's bound


class KeyMemo:
    """Chains of keys by vLLM's block hashes, per set of extra keys. ``every``:
    vLLM's hashes per kvarena block (vLLM may hash at a finer size)."""

    def __init__(self, every: int, kept: int = KEPT) -> None:
        self.every, self._kept = every, kept
        self._entries: dict[tuple[object, ...], dict[bytes, tuple[Chain, int]]] = {}
        self._chains: deque[tuple[tuple[object, ...], Chain]] = deque()
        self._held = 0  # keys in the chains held
        self.learnt = (
            0  # how many times it has learnt: a recall that found nothing holds until then
        )

    def recall(
        self, extra: tuple[object, ...], hashes: Sequence[Any], have: int, blocks: int
    ) -> tuple[Chain, int] | None:
        """A chain holding the keys of blocks ``0..j`` of a prompt with these vLLM
        ``hashes``, and ``j + 1``: the deepest block below ``blocks`` (and past
        ``have``, the keys the request holds) whose hash is known, found by
        bisection (entries are learnt in runs from a chain's start)."""
        entries = self._entries.get(extra)
        every = self.every
        top = min(blocks, len(hashes) // every)
        if not entries or top <= have:
            return None
        found = None
        lo, hi = have, top  # the deepest known block lies in [lo, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            entry = entries.get(hashes[(mid + 1) * every - 1])
            if entry is None:
                hi = mid
            else:
                found, lo = (entry[0], mid + 1), mid + 1
        return found

    def learn(
        self, extra: tuple[object, ...], chain: Chain, hashes: Sequence[Any], start: int
    ) -> None:
        """Blocks ``start`` onward of ``chain`` (just hashed) by their vLLM hashes;
        the chains learnt first are forgotten past :data:`KEPT` keys."""
        entries = self._entries.setdefault(extra, {})
        every = self.every
        stop = min(len(chain.keys), len(hashes) // every)
        if stop <= start:
            return
        self.learnt += 1
        if not chain.counted:
            self._chains.append((extra, chain))
        for i in range(start, stop):
            h = hashes[(i + 1) * every - 1]
            entries[h] = (chain, i)
            chain.learnt.append(h)
        # a chain holds every key up to its end (those it recalled too)
        grown = len(chain.keys) - chain.counted
        chain.counted += grown
        self._held += grown
        while self._held > self._kept and len(self._chains) > 1:
            old_extra, old = self._chains.popleft()
            book = self._entries[old_extra]
            for h in old.learnt:
                if book.get(h, (None,))[0] is old:
                    del book[h]
            self._held -= old.counted
            old.learnt, old.counted = [], 0


def hash_block_size(kv_cache_config: Any, block_size: int) -> int:
    """The tokens each of vLLM's ``Request.block_hashes`` covers (its
    ``hash_block_size``: finer than a block in some hybrids), else ``block_size``."""
    return int(getattr(kv_cache_config, "hash_block_size", None) or block_size)


def engine_memo(vllm_config: Any, kv_cache_config: Any, block_size: int) -> KeyMemo | None:
    """The engine's :class:`KeyMemo`, where its block hashes can stand for keys."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", ""))
    return trusted_hashes(algo, hash_block_size(kv_cache_config, block_size), block_size)


def trusted_hashes(algo: str, hash_block_size: int, block_size: int) -> KeyMemo | None:
    """A memo over vLLM's block hashes, where they are cryptographic (``algo``) and
    a whole number of them (``hash_block_size`` tokens each) ends every kvarena
    block of ``block_size`` tokens; else None (every request hashed by kvarena)."""
    if algo not in TRUSTED_HASHES or hash_block_size < 1 or block_size % hash_block_size:
        return None
    return KeyMemo(block_size // hash_block_size)
