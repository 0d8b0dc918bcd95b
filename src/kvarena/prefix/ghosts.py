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

from collections import deque
from collections.abc import Iterable

from ..checks import check_count


class Ghosts:
    """A bounded FIFO set of evicted KV keys (a key remembered again keeps its place).

    A set for membership and a deque for the order: about half the cost of an
    ``OrderedDict`` per key, and one key is remembered for every KV block evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = check_count(capacity, "Ghosts: capacity")
        self._keys: set[bytes] = set()
        self._order: deque[bytes] = deque()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[bytes]) -> None:
        known = self._keys
        new = [k for k in dict.fromkeys(keys) if k not in known]
        known.update(new)
        self._order.extend(new)
        for _ in range(len(self._order) - self.capacity):
            known.discard(self._order.popleft())
