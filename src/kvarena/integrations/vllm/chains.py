"""A request's prefix keys, hashed as far as they are asked for.

The scheduler keys a request once: the saves of every later step and every
lookup of it read the same chain. The keys of a prefix some request was keyed
for before are recalled by vLLM's own block hashes (:mod:`.key_memo`), not
hashed again; past them a lookup probes in small windows that double
(:data:`WINDOW`), so a prompt that misses there is hashed for a few blocks,
not for its whole length; the chain grows as the request does and is never
rehashed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...prefix.keys import chained_keys, extra_bytes, tail_key, token_bytes
from ...tiers.names import ImageKind, object_name
from .key_memo import Chain, KeyMemo
from .records import BlockCopy

WINDOW = 4
"""A lookup's first window past the keys had without hashing (:meth:`RequestKeys.known`),
doubling from there: the scheduler's catalogue answers from memory, so small
probes cost less than hashing blocks past a miss."""

CHUNK = 32
"""Blocks hashed at a time where one key is asked for by index (a save's block):
a request's later saves then find theirs hashed."""


_KINDS = tuple(ImageKind)
"""The kinds, listed once (iterating an enum runs Python code: a request's first ask is cold)."""


class RequestKeys:
    """The chained keys of one request's full blocks (``keys[i]``: block ``i``'s),
    and of a partial block after them (:meth:`tail`)."""

    def __init__(
        self,
        root: bytes,
        request: Any,
        block_size: int,
        extra: tuple[object, ...],
        memo: KeyMemo | None = None,
    ):
        """``memo``: keys of prefixes met before, by vLLM's block hashes."""
        self._root, self._request, self._bs, self._extra = root, request, block_size, extra
        self._salt = extra_bytes(extra)
        self.block_size = block_size
        self._keys: list[bytes] = []
        self._names: dict[ImageKind, list[str]] = {kind: [] for kind in _KINDS}
        self._tails: dict[tuple[int, int], bytes] = {}
        self._memo = memo
        # the last recall's blocks, the memo's learnt count and the hashes then:
        # none deeper is known until it learns or vLLM hashes more
        self._missed: tuple[int, int, int] = (0, -1, -1)
        # what the memo's entries point into: this request's own lists
        self._chain = Chain(self._keys, self._names[ImageKind.KV_BLOCK])

    def _tokens(self, start: int, stop: int) -> bytes:
        """Tokens ``start`` to ``stop`` as a key hashes them."""
        return token_bytes(self._request.all_token_ids[start:stop])

    def _extend(self, blocks: int) -> None:
        have, bs = len(self._keys), self._bs
        if blocks <= have:
            return
        have = self.known(blocks)
        if blocks <= have:
            return
        parent = self._keys[-1] if self._keys else self._root
        new = chained_keys(parent, self._tokens(have * bs, blocks * bs), bs, self._salt)
        self._keys.extend(new)
        if self._memo is None:
            return
        names = self._names[ImageKind.KV_BLOCK]  # in step with the keys where it is
        if len(names) == have:  # made now: a lookup asks for them next, a recall copies them
            names.extend(object_name(ImageKind.KV_BLOCK, k) for k in new)
        self._memo.learn(self._extra, self._chain, self._request.block_hashes, have)

    def known(self, blocks: int) -> int:
        """How many of the first ``blocks`` keys are had without hashing: those
        hashed, then those the memo recalls by vLLM's hashes (taken now)."""
        have, memo = len(self._keys), self._memo
        if memo is None or have >= blocks:
            return have
        hashes = getattr(self._request, "block_hashes", ())
        asked = (memo.learnt, len(hashes))
        if self._missed[1:] == asked and blocks <= self._missed[0]:
            return have  # asked as far before, nothing learnt nor hashed since
        recalled = memo.recall(self._extra, hashes, have, blocks)
        self._missed = (blocks, *asked)  # what it recalls is the deepest known
        if recalled is None:
            return have
        chain, upto = recalled
        names = self._names[ImageKind.KV_BLOCK]
        if len(names) == have and len(chain.names) >= upto:
            names.extend(chain.names[have:upto])
        self._keys.extend(chain.keys[have:upto])
        return upto

    def __getitem__(self, i: int) -> bytes:
        try:
            return self._keys[i]
        except IndexError:
            full = len(self._request.all_token_ids) // self._bs
            if i >= full:
                raise IndexError(f"block {i}: the request has {full} full blocks") from None
            self._extend(min(full, -(-(i + 1) // CHUNK) * CHUNK))
            return self._keys[i]

    def upto(self, blocks: int) -> list[bytes]:
        """The keys of the first ``blocks`` blocks."""
        self._extend(blocks)
        return self._keys[:blocks]

    def names(self, kind: ImageKind, start: int, stop: int) -> list[str]:
        """``kind``'s object names of blocks ``start`` to ``stop`` (made once from
        the first block on; a window past the names made is named alone, not kept:
        a state lookup probes boundaries from the run's end down)."""
        made = self._names[kind]
        if len(made) < stop:
            self._extend(stop)
            if len(made) < start:
                return [object_name(kind, k) for k in self._keys[start:stop]]
            made.extend(object_name(kind, k) for k in self._keys[len(made) : stop])
        return made[start:stop]

    def tail(self, blocks: int, tokens: int) -> bytes:
        """The key of the partial block of ``tokens`` tokens after ``blocks`` full ones."""
        key = self._tails.get((blocks, tokens))
        if key is None:
            start = blocks * self._bs
            parent = self[blocks - 1] if blocks else self._root
            ids = np.frombuffer(self._tokens(start, start + tokens), dtype=np.int64)
            key = tail_key(parent, ids, self._bs, self._extra)
            self._tails[(blocks, tokens)] = key
        return key


def request_extra(request: Any) -> tuple[object, ...]:
    """What besides its tokens a request's keys hash: its LoRA's name and its
    cache salt, where it has them."""
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    if lora is None and salt is None:
        return ()  # most requests
    return tuple(x for x in (lora.lora_name if lora is not None else None, salt) if x is not None)


def cacheable(request: Any) -> bool:
    """Multimodal prompts are left to vLLM: the token ids standing for an image
    do not name which image it is."""
    return not getattr(request, "mm_features", None)


def saved_tail(
    objects: Any, request: Any, keys: RequestKeys, full: int, skip: set[str]
) -> tuple[BlockCopy | None, int]:
    """The partial block after the request's first ``full`` blocks that the tiers
    hold (``objects.locate``; its blocks not known yet), and the tokens of it a
    hit uses: the longest saved one whose tokens begin the request's next ones
    (a full block there counts too), used up to the prompt's last token, which
    vLLM computes itself. Objects named in ``skip`` failed a load: not used."""
    bs = keys.block_size
    rows = request.num_tokens - 1 - full * bs
    if rows <= 0 or full < 1:  # a prompt under one block saves no partial block
        return None, 0
    sizes = range(min(bs, request.num_tokens - full * bs), 0, -1)
    wanted = [keys[full] if t == bs else keys.tail(full, t) for t in sizes]
    names = [object_name(ImageKind.KV_BLOCK, k) for k in wanted]
    for t, key, name, where in zip(sizes, wanted, names, objects.locate(names), strict=True):
        if where is not None and name not in skip:
            copy = BlockCopy(
                index=full, key=key, blocks=(), level=where, tokens=None if t == bs else t
            )
            return copy, min(t, rows)
    return None, 0
