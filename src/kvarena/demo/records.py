"""What the main job is asked to do, and what each of its steps found."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """One verified claim: a short name, whether it held, and the numbers."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    model: str = "qwen3-next-80b-a3b"
    tp: int = 8
    requests: int = 4
    seed: int = 0
