"""``kvarena replay``: request traces through the real prefix cache and pools.

:mod:`.trace` reads traces, :mod:`.run` replays one through a prefix cache
(bookkeeping on torch's ``meta`` device, or real bytes with ``verify``),
:mod:`.policies` runs the same trace under several policies beside the
infinite-cache bound, :mod:`.clairvoyant` places images knowing the whole trace
(what placement alone can reach), :mod:`.sweep` repeats a comparison over budgets, and
:mod:`.timeline` is what one replay records over its simulated time.
"""

from .clairvoyant import clairvoyant_bound, parting_points
from .host_memory import host_memory_available
from .policies import compare, infinite_bound
from .run import ReplayConfig, ReplayResult, replay
from .trace import MOONCAKE_BLOCK, TraceError, TraceRequest, load_trace, parse_trace

__all__ = [
    "MOONCAKE_BLOCK",
    "ReplayConfig",
    "ReplayResult",
    "TraceError",
    "TraceRequest",
    "clairvoyant_bound",
    "compare",
    "host_memory_available",
    "infinite_bound",
    "load_trace",
    "parse_trace",
    "parting_points",
    "replay",
]
