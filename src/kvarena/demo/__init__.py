"""The main job: materialize a real model's request states and prove the bytes.

Each step returns a :class:`Check` (what was verified, and whether it held),
so the CLI renders progress and a report, and tests assert on the same
results. Every check compares bytes (or tokens), never only shapes.
"""

from .records import Check, DemoConfig
from .run import run_demo, state_fields

__all__ = ["Check", "DemoConfig", "run_demo", "state_fields"]
