"""What the scheduler knows of the tiers: the one place its lookups ask.

The worker owns the tiers' bytes (it copies into and out of vLLM's tensors);
the scheduler answers ``get_num_new_matched_tokens`` from another process.
So each tier is asked where its truth lives:

- the host tier lives in the worker's memory: its book here is the names the
  worker reported putting and dropping (a step late; a name reported but gone
  by load time is a failed load, which vLLM recomputes);
- the disk tier's truth is its directory: a complete object is a file of its
  name (written to a temporary, renamed into view), so a probe is one
  ``stat`` — and a restarted engine sees what the last one wrote at once;
- the shared store is asked (one pipelined ``EXISTS`` batch): other engines
  write to it too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

from ...tiers import RedisTier
from ...tiers.disk import SUFFIX
from ...tiers.stack import first_holders
from .ranks import rank_dir
from .settings import ConnectorSettings


class Catalogue:
    """Which tier holds each name, as the scheduler can know it."""

    def __init__(self, settings: ConnectorSettings, ranks: int = 1) -> None:
        """``ranks``: the engine's tensor-parallel size (each rank's worker writes
        its disk objects into a directory of its own, :func:`.ranks.rank_dir`)."""
        self.kinds: list[str] = []
        self._host: set[str] = set()
        self._disk: list[str] = []
        self._redis: RedisTier | None = None
        for spec in settings.tiers:
            self.kinds.append(spec.kind)
            if spec.kind == "disk":
                assert spec.directory is not None
                self._disk = [
                    os.path.join(rank_dir(spec.directory, r, ranks), "") for r in range(ranks)
                ]
            elif spec.kind == "redis":
                self._redis = spec.open()  # type: ignore[assignment]

    def hosted(self, added: Iterable[str], dropped: Iterable[str]) -> None:
        """Apply a worker's report of its host tier (puts, then drops)."""
        self._host.update(added)
        self._host.difference_update(dropped)

    def locate(self, names: Sequence[str]) -> list[int | None]:
        """For each name, the first tier (index in the settings' order) that holds
        it, None where none does; one batched question per tier."""
        return first_holders(names, [self._probe(kind) for kind in self.kinds])

    def _probe(self, kind: str) -> Callable[[list[str]], list[bool]]:
        if kind == "host":
            return lambda asked: [n in self._host for n in asked]
        if kind == "disk":
            dirs = self._disk  # a name is one rank's: it lies in that rank's directory
            return lambda asked: [
                any(os.path.isfile(f"{d}{n}{SUFFIX}") for d in dirs) for n in asked
            ]
        assert self._redis is not None
        return self._redis.contains_many

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
