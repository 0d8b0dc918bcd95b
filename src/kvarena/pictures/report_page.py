"""``replay --report FILE.html``: one self-contained page a person can open offline.

Everything the page shows is inside the file: pictures as inline SVG, tables
as HTML, the command line that made it and the identity of the trace (path,
size, SHA-256) and of the model (name, family, serving options, layout
fingerprints, the prefix cache's namespace digest). It loads nothing and runs
no script, so it opens the same in any browser, on any machine, years later.
"""

from __future__ import annotations

import datetime
import hashlib
import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .files import write_whole


@dataclass(frozen=True, kw_only=True)
class Table:
    caption: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, kw_only=True)
class Section:
    """A heading, then its facts (label, value), pictures (SVG text) and tables."""

    heading: str
    facts: tuple[tuple[str, str], ...] = ()
    pictures: tuple[tuple[str, str], ...] = ()  # (caption, SVG document)
    tables: tuple[Table, ...] = field(default=())


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ccc; }
code, .cmd { font-family: ui-monospace, monospace; background: #f4f4f4; padding: 0.1em 0.3em; }
.cmd { display: block; padding: 0.6em; white-space: pre-wrap; word-break: break-all; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
caption { text-align: left; font-weight: bold; padding: 0.3em 0; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1em; }
dt { font-weight: bold; } dd { margin: 0; font-family: ui-monospace, monospace; }
figure { margin: 1em 0; } figure svg { width: 100%; height: auto; }
figcaption { font-size: 0.85em; color: #555; }
"""


def file_identity(path: str | Path) -> tuple[tuple[str, str], ...]:
    """A file's path, size and SHA-256, as facts for a page."""
    p = Path(path)
    digest = hashlib.sha256()
    size = 0
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return (("path", str(p)), ("bytes", f"{size:,}"), ("sha256", digest.hexdigest()))


def _inline_svg(svg: str) -> str:
    """An SVG document as an element of the page (its XML prolog and doctype dropped)."""
    start = svg.find("<svg")
    if start < 0:
        raise ValueError("not an SVG document")
    return svg[start:]


def _table(t: Table) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in t.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in t.rows
    )
    return (
        f"<table><caption>{html.escape(t.caption)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )


def render_page(*, title: str, command: str, sections: Sequence[Section]) -> str:
    """The whole page as HTML text."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>Made by <span class='cmd'>{html.escape(command)}</span></p>",
        "<p>Written "
        + html.escape(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
        + ".</p>",
    ]
    for s in sections:
        parts.append(f"<section><h2>{html.escape(s.heading)}</h2>")
        if s.facts:
            parts.append(
                "<dl>"
                + "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in s.facts)
                + "</dl>"
            )
        for caption, svg in s.pictures:
            parts.append(
                f"<figure>{_inline_svg(svg)}<figcaption>{html.escape(caption)}</figcaption>"
                "</figure>"
            )
        parts.extend(_table(t) for t in s.tables)
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_page(path: Path, *, title: str, command: str, sections: Sequence[Section]) -> None:
    write_whole(path, render_page(title=title, command=command, sections=sections).encode())
