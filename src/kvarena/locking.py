"""One lock per object, for the objects that several serving threads share.

A prefix cache, a tier stack and each tier are safe to use from several
threads: every public method holds the object's own re-entrant lock for the
whole call, so a call sees and leaves the object's books whole (an admission
is never interleaved with another's eviction). Locks are taken in one order
only — prefix cache, then tier stack, then a tier — since nothing below calls
back into what is above it, so they cannot deadlock.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def synchronized(method: F) -> F:
    """``method`` run while holding ``self._lock`` (a :class:`threading.RLock`)."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]
