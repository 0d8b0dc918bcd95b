"""The machine a benchmark measured, in one line, printed above its table.

A shared development machine may be moved to another host between days: on
2026-12-06 an AMD EPYC host with AVX2 alone ran vLLM's CPU compute about
seven times slower than the days before (a prefill step 97 ms against 14).
Only rows of one run compare, and a run's machine belongs beside its numbers.
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The CPU features named (Linux's ``/proc/cpuinfo`` flags): with AVX-512 or AMX,
vLLM's CPU kernels run several times faster than with AVX2 alone."""


def host() -> str:
    """``host: CPU model, cores, vector features; torch version`` (torch's
    version read from its metadata: nothing is imported)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = set(value.split())
                    break
    except OSError:
        pass
    have = " ".join(f for f in VECTOR_FLAGS if f in flags) or "none of " + "/".join(VECTOR_FLAGS)
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"host: {model}, {os.cpu_count()} cores, {have}; torch {torch}"
