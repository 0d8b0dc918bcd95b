"""The typer app every command hangs on, and its one-line refusals.

Exit codes: 0 success, 1 a demo verification failed, 2 bad arguments or an
unknown model (with a one-line reason on stderr, never a traceback).

Nothing here imports torch (nor anything that does): ``kvarena tiers`` runs
on this module and its own, and starts in a fraction of torch's import.
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.console import Console
from typer.core import TyperGroup

try:  # typer >= 0.20 vendors click; older typer depends on it
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - depends on the typer release
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[no-redef,assignment]

from ..errors import Error


def _one_line(message: str) -> None:
    """The reason, on stderr, as one line and verbatim (no markup: a model name
    with ``[...]`` in it is printed as given)."""
    sys.stderr.write("error: " + " ".join(str(message).split()) + "\n")
    sys.stderr.flush()


class _OneLineErrors(TyperGroup):
    """Every refusal, whether typer's (a bad option, a value out of range) or
    kvarena's, ends as one line on stderr and exit code 2; exit 1 stays for a
    verification that failed."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            kwargs["standalone_mode"] = False  # refusals come back here as exceptions
            code = super().main(*args, **kwargs)
        except NoArgsIsHelpError as exc:
            sys.stdout.write(exc.format_message() + "\n")
            code = 2
        except ClickException as exc:
            _one_line(exc.format_message())
            code = 2
        except typer.Abort:
            _one_line("aborted")
            code = 2
        except RecursionError:
            _one_line("input nested too deeply")
            code = 2
        except Exception as exc:
            # A kvarena.Error names the value and the legal range; anything
            # else is still one line, with its type so a report can name it.
            _one_line(str(exc) if isinstance(exc, Error) else f"{type(exc).__name__}: {exc}")
            code = 2
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="kvarena: plan a model's cache, run the demo, replay request traces.\n\nExit codes: 0 success, 1 a demo verification failed, 2 bad arguments or an unknown model (one line on stderr, never a traceback).",
    cls=_OneLineErrors,
)


@app.callback()
def _root() -> None:
    # A callback keeps the app a group of commands whichever of them are
    # registered (typer runs an app of one command as that command alone).
    pass


# Piped output (CI logs, files) gets wide tables instead of 80 folded columns.
console = Console(width=None if sys.stdout.isatty() else 160)


def _one_line_warning(
    message: Warning | str, category: type[Warning], *args: Any, **kw: Any
) -> str:
    return f"kvarena: warning: {message}\n"
