"""The kvarena command: ``plan``, ``demo``, ``replay`` and ``tiers``.

Exit codes: 0 success, 1 a demo verification failed, 2 bad arguments or an
unknown model (with a one-line reason on stderr, never a traceback).
:mod:`.app` holds the typer app and its one-line refusals; each command lives
in a module of its own and registers itself on import.
"""

import warnings

from . import demo_command, plan_command, replay_command, tiers_command
from .app import _one_line_warning, app

__all__ = [
    "app",
    "demo_command",
    "main",
    "plan_command",
    "replay_command",
    "tiers_command",
]


def main() -> None:
    # A tier that fails mid-run warns once and serving goes on: one line, like a refusal.
    warnings.formatwarning = _one_line_warning
    app()


if __name__ == "__main__":
    main()
