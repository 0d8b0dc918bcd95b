"""``kvarena tiers``: what a disk directory or a Redis store holds, checked and pruned.

``stat`` groups the objects by namespace (which model, revision, layout and
rank wrote them), ``verify`` checks every object whole and lists the ones that
fail (``--fix`` removes them; exit 1 while any remain), ``prune`` removes by
namespace, by age, or oldest first down to a size. Tables on a terminal,
``--json`` for scripts; exit 2 with one line on bad input. A directory a live
engine owns is read, never changed: ``verify --fix`` and ``prune`` are refused
with the owner's pid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from ..checks import parse_bytes, parse_duration
from ..errors import InvalidValueError
from ..tiers.image import ImageMismatch
from ..tiers.inventory import (
    DiskInventory,
    Entry,
    Inventory,
    RedisInventory,
    check_alone,
    describe_namespace,
    namespace_id,
)
from ..tiers.spec import SPEC_FORMS, TierSpec
from .root import app, console

tiers_app = typer.Typer(
    no_args_is_help=True,
    help="What a disk directory or a Redis store holds: stat, verify, prune.",
)
app.add_typer(tiers_app, name="tiers")

Where = Annotated[
    str,
    typer.Argument(help="a disk tier's directory (or disk:DIR[:SIZE]), or redis://HOST:PORT[/DB]"),
]
Json = Annotated[bool, typer.Option("--json", help="one JSON document on stdout")]


def open_inventory(where: str) -> Inventory:
    """The tier ``where`` names: a directory path, a disk spec (its size, if
    given, is not needed to read it), or a Redis URL."""
    spec = TierSpec.parse_place(where)
    if spec.kind == "disk" and spec.directory is not None:
        return DiskInventory(spec.directory)
    if spec.kind == "redis" and spec.url is not None:
        return RedisInventory(spec.store_url(), cluster=spec.cluster)
    if spec.kind == "mooncake":
        raise InvalidValueError(
            f"{where!r}: a Mooncake store cannot be listed from outside (its client has no "
            "listing); name a disk directory or a Redis store"
        )
    raise InvalidValueError(
        f"{where!r}: a host tier lives in an engine's memory; name a disk directory or "
        f"a store ({SPEC_FORMS})"
    )


@dataclass
class _Group:
    namespace: bytes
    kv: int = 0
    state: int = 0
    other: int = 0
    nbytes: int = 0
    ages: list[float] = field(default_factory=list)

    def add(self, e: Entry) -> None:
        if e.kind == "kv":
            self.kv += 1
        elif e.kind == "state":
            self.state += 1
        else:
            self.other += 1
        self.nbytes += e.stored_bytes
        self.ages.append(e.age_s)

    def row(self) -> dict[str, Any]:
        return {
            "namespace": namespace_id(self.namespace),
            **describe_namespace(self.namespace),
            "objects": self.kv + self.state + self.other,
            "kv_blocks": self.kv,
            "states": self.state,
            "bytes": self.nbytes,
            "oldest_s": round(max(self.ages), 1),
            "newest_s": round(min(self.ages), 1),
        }


def _groups(entries: list[Entry]) -> list[dict[str, Any]]:
    groups: dict[bytes, _Group] = {}
    for e in entries:
        groups.setdefault(e.namespace, _Group(e.namespace)).add(e)
    return sorted((g.row() for g in groups.values()), key=lambda r: -r["bytes"])


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f}{unit}"
    return f"{seconds:.0f}s"


def _emit(doc: dict[str, Any], as_json: bool, table: Table | None, lines: list[str]) -> None:
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    if table is not None:
        console.print(table)
    for line in lines:
        console.print(escape(line))


def _namespace_table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in (
        "namespace",
        "model",
        "revision",
        "layout",
        "rank",
        "kv blocks",
        "states",
        "bytes",
        "oldest",
        "newest",
    ):
        table.add_column(
            col,
            justify="right"
            if col in ("kv blocks", "states", "bytes", "oldest", "newest")
            else "left",
        )
    for r in rows:
        table.add_row(
            r["namespace"],
            escape(str(r["model"] or "?")),
            escape(str(r["revision"] or "")),
            escape(str(r["layout"] or "")),
            str(r["rank"] or ""),
            f"{r['kv_blocks']:,}",
            f"{r['states']:,}",
            f"{r['bytes']:,}",
            _age(r["oldest_s"]),
            _age(r["newest_s"]),
        )
    return table


@tiers_app.command()
def stat(where: Where, as_json: Json = False) -> None:
    """Objects and bytes per namespace (model, revision, layout, rank) and their ages."""
    inv = open_inventory(where)
    entries, unreadable = inv.entries()
    rows = _groups(entries)
    doc = {
        "tier": inv.describe(),
        "objects": len(entries),
        "bytes": sum(e.stored_bytes for e in entries),
        "unreadable": [{"where": w, "why": why} for w, why in unreadable],
        "namespaces": rows,
    }
    lines = [
        f"{doc['objects']:,} objects, {doc['bytes']:,} B in {len(rows)} "
        + ("namespace" if len(rows) == 1 else "namespaces")
    ]
    if unreadable:
        lines.append(
            f"{len(unreadable)} files with no readable header (kvarena tiers verify --fix removes them)"
        )
    _emit(doc, as_json, _namespace_table(inv.describe(), rows), lines)


@tiers_app.command()
def verify(
    where: Where,
    fix: Annotated[bool, typer.Option("--fix", help="remove every object that fails")] = False,
    as_json: Json = False,
) -> None:
    """Check every object whole (header, size, seal, checksum, name); exit 1 while any fails."""
    inv = open_inventory(where)
    bad: list[dict[str, str]] = []
    checked = 0
    for name, place, data in inv.contents():
        checked += 1
        try:
            check_alone(name, data)
        except ImageMismatch as exc:
            bad.append({"where": place, "reason": exc.reason, "detail": str(exc)})
    removed = 0
    if fix and bad:
        with inv.claim():
            removed = inv.delete([b["where"] for b in bad])
    doc = {
        "tier": inv.describe(),
        "checked": checked,
        "failed": bad,
        "removed": removed,
    }
    table = None
    if bad:
        table = Table(title="objects that fail their checks", title_justify="left")
        for col in ("object", "reason", "detail"):
            table.add_column(col)
        for b in bad:
            table.add_row(escape(b["where"]), b["reason"], escape(b["detail"]))
    lines = [
        f"{doc['checked']:,} objects checked, {len(bad)} failed"
        + (f", {removed} removed" if fix else "")
    ]
    _emit(doc, as_json, table, lines)
    if bad and not fix:
        raise typer.Exit(1)


@tiers_app.command()
def prune(
    where: Where,
    namespace: Annotated[
        list[str] | None,
        typer.Option(
            "--namespace", help="remove this namespace's objects (an id from stat; repeatable)"
        ),
    ] = None,
    older_than: Annotated[
        str | None, typer.Option(help="remove objects older than this (90s, 30m, 12h, 7d)")
    ] = None,
    to_size: Annotated[
        str | None, typer.Option(help="then remove the oldest until the tier holds at most this")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="say what would go; remove nothing")
    ] = False,
    as_json: Json = False,
) -> None:
    """Remove by namespace, by age, or oldest first down to a size."""
    if not (namespace or older_than or to_size):
        raise InvalidValueError(
            "prune: name what to remove: --namespace, --older-than or --to-size"
        )
    age = parse_duration(older_than) if older_than is not None else None
    size = parse_bytes(to_size) if to_size is not None else None
    wanted = set(namespace or ())
    inv = open_inventory(where)
    entries, _ = inv.entries()
    known = {namespace_id(e.namespace) for e in entries}
    unknown = sorted(wanted - known)
    if unknown:
        raise InvalidValueError(
            f"prune: --namespace {unknown[0]} names no namespace here (held: {', '.join(sorted(known)) or 'none'})"
        )
    gone = [
        e
        for e in entries
        if namespace_id(e.namespace) in wanted or (age is not None and e.age_s > age)
    ]
    if size is not None:
        left = sorted((e for e in entries if e not in gone), key=lambda e: -e.age_s)  # oldest first
        held = sum(e.stored_bytes for e in left)
        for e in left:
            if held <= size:
                break
            gone.append(e)
            held -= e.stored_bytes
    removed = 0
    if gone and not dry_run:
        with inv.claim():
            removed = inv.delete([e.where for e in gone])
    rows = _groups(gone)
    doc = {
        "tier": inv.describe(),
        "dry_run": dry_run,
        "selected": len(gone),
        "selected_bytes": sum(e.stored_bytes for e in gone),
        "removed": removed,
        "left_bytes": sum(e.stored_bytes for e in entries) - sum(e.stored_bytes for e in gone),
        "namespaces": rows,
    }
    verb = "would remove" if dry_run else "removed"
    lines = [
        f"{verb} {len(gone) if dry_run else removed:,} objects, {doc['selected_bytes']:,} B; "
        f"{doc['left_bytes']:,} B left"
    ]
    _emit(
        doc,
        as_json,
        _namespace_table(f"{verb} from {inv.describe()}", rows) if rows else None,
        lines,
    )
