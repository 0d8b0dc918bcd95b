"""Where a picture or a report goes, checked before any work, and written whole.

A command that draws checks its output paths first (the extension it can
write, a folder that exists and can be written), so a bad ``--picture`` is
refused in one line before a long replay runs; and it writes through a
temporary file beside the target, renamed over it at the end, so a failure
mid-way never leaves half a file. Nothing here imports matplotlib.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

from ..errors import Error, InvalidValueError

PICTURE_FORMATS = (".svg", ".png")
REPORT_FORMATS = (".html",)


class MissingExtraError(Error, RuntimeError):
    """A drawing was asked for, but the plotting library is not installed."""


def require_matplotlib() -> None:
    """Refuse, naming the extra to install, where matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingExtraError(
            "pictures need matplotlib: pip install 'kvarena[pictures]' (make test installs it)"
        )


def check_output(path: object, what: str, formats: tuple[str, ...]) -> Path:
    """``path`` as a :class:`Path` a file of one of ``formats`` can be written to."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise InvalidValueError(f"{what}: expected a file path, got {path!r}")
    p = Path(path)
    if p.is_dir():
        raise InvalidValueError(f"{what}: {str(p)!r} is a folder; name a file in it")
    if p.suffix.lower() not in formats:
        raise InvalidValueError(
            f"{what}: {str(p)!r} has extension {p.suffix or '(none)'!r}; "
            f"write one of {', '.join(formats)}"
        )
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InvalidValueError(f"{what}: folder {str(parent)!r} of {str(p)!r} does not exist")
    try:  # a real probe: permission bits say nothing to root, a read-only mount does
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InvalidValueError(
            f"{what}: {str(p)!r} cannot be written ({exc.strerror or exc})"
        ) from None
    return p


def write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
