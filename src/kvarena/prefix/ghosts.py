"""Keys of KV blocks evicted lately: where prompts shared, remembered without the bytes.

A lookup whose KV run stops inside the prompt tells the checkpoint policy
where this prompt parts from earlier ones (a branch point, a divergence for
the learned grain). Once the pool has evicted that KV — soon, for a hybrid's
KV that no image reaches any more — the next prompt through the same prefix
would look new, and the boundary where many prompts share would never get
its image. So the keys of evicted KV blocks are kept a while longer, as ARC
keeps its ghost lists: 16 bytes a block instead of a block, the oldest
forgotten first, consulted only to place checkpoints, never to answer a hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from ..checks import check_count


class Ghosts:
    """A bounded FIFO set of evicted KV keys."""

    def __init__(self, capacity: int) -> None:
        self.capacity = check_count(capacity, "Ghosts: capacity")
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def forget(self, key: bytes) -> None:
        """``key`` is cached again (its blocks are real now)."""
        self._keys.pop(key, None)
