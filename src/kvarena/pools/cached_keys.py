"""The one book of cached blocks: which key each cached block holds, and back.

A prefix cache names what a block holds by a key (a chained hash of the
tokens before it); a checkpoint image names its units by the image's key.
The block pool owns this map, as vLLM's ``BlockPool`` owns its
``cached_block_hash_to_block``: the step that evicts a block drops its key,
and the step that relocates a block moves its key, so no one else keeps a
copy to bring into line.

A key holds one block (a KV block) or several in order (an image's units),
and an integer ``tag`` its owner chose (the block's index in the prompt, an
image's boundary): what a lower tier needs to name the bytes when they are
written down. A key may be declared worthless without another one
(``after``): an image at a boundary cannot be resumed from once the KV block
ending there is gone, so evicting that block evicts the image with it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from ..errors import InvalidValueError


@dataclass(frozen=True, kw_only=True)
class Evicted:
    """A key the pool dropped, with the blocks it held and its tag.

    The blocks' bytes are intact when this is reported (before any block is
    handed out again): the moment to write them down to a lower tier."""

    key: Hashable
    blocks: tuple[int, ...]
    tag: int


class CachedKeys:
    """Key -> blocks (in order) and block -> key, kept as one book."""

    def __init__(self) -> None:
        self._blocks: dict[Hashable, tuple[int, ...]] = {}
        self._key: dict[int, Hashable] = {}
        self._tag: dict[Hashable, int] = {}
        self._dependent: dict[Hashable, Hashable] = {}  # key -> the key worthless without it
        self._after: dict[Hashable, Hashable] = {}  # the inverse of _dependent

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._blocks
        except TypeError:  # an unhashable key is held by no block
            return False

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._blocks)

    def blocks_of(self, key: Hashable) -> tuple[int, ...] | None:
        try:
            return self._blocks.get(key)
        except TypeError:  # an unhashable key is held by no block
            return None

    def key_of(self, block: int) -> Hashable | None:
        return self._key.get(block)

    def tag_of(self, key: Hashable) -> int:
        return self._tag[key]

    def dependent_of(self, key: Hashable) -> Hashable | None:
        return self._dependent.get(key)

    def add(self, key: Hashable, blocks: tuple[int, ...], tag: int, after: Hashable | None) -> None:
        """Record ``key`` as held by ``blocks`` (checked by the allocator: live, uncached)."""
        try:
            hash(key)
        except TypeError:
            raise InvalidValueError(f"a cache key must be hashable, got {key!r}") from None
        if key in self._blocks:
            raise InvalidValueError(
                f"key {key!r} is cached already (in blocks {self._blocks[key]})"
            )
        if after is not None and after in self._dependent:
            raise InvalidValueError(
                f"key {after!r} already has a dependent key {self._dependent[after]!r}"
            )
        self._blocks[key] = blocks
        self._tag[key] = tag
        for b in blocks:
            self._key[b] = key
        if after is not None:
            self._dependent[after] = key
            self._after[key] = after

    def drop(self, key: Hashable) -> Evicted:
        blocks = self._blocks.pop(key)
        for b in blocks:
            del self._key[b]
        after = self._after.pop(key, None)
        if after is not None:
            del self._dependent[after]
        # A key whose dependent outlives it keeps no tie: the dependent simply ages.
        dep = self._dependent.pop(key, None)
        if dep is not None:
            del self._after[dep]
        return Evicted(key=key, blocks=blocks, tag=self._tag.pop(key))

    def remap(self, remap: dict[int, int]) -> None:
        """Blocks relocated ``old -> new``: their keys follow them."""
        keys = {self._key[b] for b in remap if b in self._key}
        for b in [b for b in remap if b in self._key]:
            del self._key[b]
        for key in keys:
            blocks = tuple(remap.get(b, b) for b in self._blocks[key])
            self._blocks[key] = blocks
            for b in blocks:
                self._key[b] = key

    def check(self) -> None:
        """Both directions agree (for tests)."""
        assert sum(len(b) for b in self._blocks.values()) == len(self._key)
        for key, blocks in self._blocks.items():
            assert all(self._key[b] == key for b in blocks), key
        assert set(self._tag) == set(self._blocks)
        assert {v: k for k, v in self._dependent.items()} == self._after
