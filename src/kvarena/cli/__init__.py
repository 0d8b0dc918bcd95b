"""The kvarena command: ``plan``, ``demo``, ``replay`` and ``tiers``.

Exit codes: 0 success, 1 a demo verification failed, 2 bad arguments or an
unknown model (with a one-line reason on stderr, never a traceback).
:mod:`.root` holds the typer app and its one-line refusals; each command lives
in a module of its own and registers itself on the app when imported.

A run imports the command it runs, no other (``kvarena tiers`` never loads
torch, which the planning commands need); ``kvarena --help``, an unknown
command and :data:`app` as a library reads it register all of them.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import TYPE_CHECKING, Any

from ..checks import check_choice
from .root import _one_line_warning

if TYPE_CHECKING:
    import typer

    app: typer.Typer

COMMANDS: dict[str, str] = {
    "plan": "plan_command",
    "demo": "demo_command",
    "replay": "replay_command",
    "tiers": "tiers_command",
}
"""Each command's name and the module that registers it."""

__all__ = ["COMMANDS", "app", "main", "registered"]


def registered(names: list[str] | None = None) -> typer.Typer:
    """The app with the commands ``names`` registered (every command: None);
    a name that is no command is refused before any is imported."""
    chosen = (
        list(COMMANDS) if names is None else [check_choice(n, "command", COMMANDS) for n in names]
    )
    for name in chosen:
        importlib.import_module(f".{COMMANDS[name]}", __name__)
    # imported here, never at the top: a module-level ``app`` would answer
    # ``from kvarena.cli import app`` before __getattr__ registers the commands
    from .root import app

    return app


def main(argv: list[str] | None = None) -> None:
    """The ``kvarena`` console script: ``argv`` (default: the process's) run."""
    args = sys.argv[1:] if argv is None else argv
    first = args[0] if args else None
    # A tier that fails mid-run warns once and serving goes on: one line, like a refusal.
    warnings.formatwarning = _one_line_warning
    registered([first] if first in COMMANDS else None)(args)


def __getattr__(name: str) -> Any:
    # ``from kvarena.cli import app``: the app with every command on it.
    if name == "app":
        return registered()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
