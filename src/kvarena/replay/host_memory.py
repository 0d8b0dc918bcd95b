"""Whether a verified replay's caches fit in this host's memory, asked before any is made."""

from __future__ import annotations

from ..checks import check_bytes
from ..errors import InvalidValueError


def host_memory_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``),
    or None where it does not say (no ``/proc/meminfo``)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(budget_bytes: int, *, verify: bool, engines: int = 1) -> None:
    """A verified replay writes real bytes into a CPU cache of the whole budget
    (one per engine of a fleet), and a prefix cache keeps what it computed
    until it must evict: caches above the host's available memory end in the
    kernel killing the process once they fill, so they are refused before
    anything is allocated."""
    if not verify:
        return
    budget = check_bytes(budget_bytes, "replay: budget_bytes", lo=1) * engines
    available = host_memory_available()
    if available is not None and budget > available:
        caches = "the cache's" if engines == 1 else f"{engines} engines' caches,"
        raise InvalidValueError(
            f"a verified replay keeps {caches} {budget:,} B in host memory, but this host "
            f"has {available:,} B available; replay a smaller budget (--memory)"
        )
