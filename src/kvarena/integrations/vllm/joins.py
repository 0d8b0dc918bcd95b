"""Loads in two parts, reported to vLLM as one.

A decode engine with tiers of its own loads the whole KV blocks its tiers
hold and reads only the rest from the prefill engine (:mod:`.pd_scheduler`).
vLLM knows one load per request: the request resumes when its id is reported
done, and is recomputed from its first token when it is reported failed. A
request reported while one part is still writing its blocks would resume
over bytes still landing, or be recomputed into blocks a late READ still
fills. So a worker reports such a request once both parts are over, and as
failed where either failed.
"""

from __future__ import annotations

from collections.abc import Iterable


class Joins:
    """The requests of this worker whose load has two parts, and what each part did."""

    PARTS = 2  # the tiers' load and the prefill engine's read

    def __init__(self) -> None:
        self._left: dict[str, int] = {}
        self._failed: set[str] = set()

    def expect(self, requests: Iterable[str]) -> None:
        """Requests whose load comes in parts: each part reports on its own."""
        for rid in requests:
            self._left[rid] = self.PARTS

    def settle(self, *parts: tuple[set[str], set[str]]) -> tuple[set[str], set[str]]:
        """Each part's (requests over, those of them that failed) since the last
        call, merged into what vLLM is told: requests over, and failed."""
        done: set[str] = set()
        failed: set[str] = set()
        for over, bad in parts:
            for rid in over | bad:
                left = self._left.get(rid)
                if left is None:  # a load of one part
                    done.add(rid)
                    if rid in bad:
                        failed.add(rid)
                    continue
                if rid in bad:
                    self._failed.add(rid)
                if left > 1:
                    self._left[rid] = left - 1
                    continue
                del self._left[rid]
                done.add(rid)
                if rid in self._failed:
                    self._failed.discard(rid)
                    failed.add(rid)
        return done, failed

    @property
    def waiting(self) -> int:
        """Requests with a part still running."""
        return len(self._left)
