"""The floors of the package: who may import whom, module sizes, no second books.

Read from the source (``ast``), so a new module is held to the same rules the
day it is written: imports go down the floors or sideways inside one
subpackage, never up and never in a circle; no module in ``src/`` runs over
400 lines; the pools and the prefix cache hold no weak references and the
prefix cache no book of blocks (the block pool owns which block holds which
key)."""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "kvarena"

# Bottom to top. A subpackage may import from its own floor's neighbours only
# where listed in SIDEWAYS, and from any floor below.
FLOORS: list[set[str]] = [
    {"errors"},
    {"checks", "locking"},
    {"layout", "spans"},
    {"copy", "models"},
    {"checkpoint"},
    {"pools"},
    {"tiers", "transfer"},
    {"prefix"},
    {"integrations", "replay", "report", "testing"},
    {"pictures", "demo"},
    {"cli"},
    {"__init__", "__main__"},
]
SIDEWAYS: set[tuple[str, str]] = set()


def _floor(unit: str) -> int:
    for i, floor in enumerate(FLOORS):
        if unit in floor:
            return i
    raise AssertionError(f"kvarena.{unit} is on no floor: add it to FLOORS")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in sorted(SRC.rglob("*.py")):
        parts = f.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """The kvarena modules ``module`` imports (relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("kvarena"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvarena"))
    return found


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


MODULES = _modules()
GRAPH = {m: {t for t in _imports(m, p) if t in MODULES and t != m} for m, p in MODULES.items()}


def test_every_import_goes_down_the_floors():
    up = []
    for m, targets in GRAPH.items():
        for t in targets:
            a, b = _unit(m), _unit(t)
            if a != b and _floor(b) >= _floor(a) and (a, b) not in SIDEWAYS:
                up.append(f"{m} -> {t}")
    assert not up, "imports up or sideways across floors:\n" + "\n".join(sorted(up))


def test_no_import_circle():
    """No circle among modules, a package's __init__ aside (it only re-exports)."""
    graph = {
        m: {t for t in ts if not MODULES[t].name == "__init__.py"}
        for m, ts in GRAPH.items()
        if MODULES[m].name != "__init__.py"
    }
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(t) :], t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_library_never_imports_its_test_harness():
    bad = [
        m
        for m, ts in GRAPH.items()
        if _unit(m) != "testing" and any(_unit(t) == "testing" for t in ts)
    ]
    assert not bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_under_400_lines(module):
    lines = MODULES[module].read_text().count("\n")
    assert lines <= 400, f"{module} has {lines} lines; split it by responsibility"


def test_pools_and_prefix_hold_no_weak_references_and_no_callbacks_up():
    """By behaviour: a prefix cache over a host tier, after admissions, commits,
    checkpoints, evictions to the tier and a boundary move, holds (anywhere in
    the objects of pools/ and prefix/ it reaches) no weak reference and no
    callable but the block pool's one write-down sink (held too by the tier
    loads that made it and the prefix cache that set it)."""
    import math
    import weakref

    import numpy as np
    import torch
    from conftest import plan_for

    from kvarena import EntryField
    from kvarena.prefix import CheckpointPolicy, PrefixCache
    from kvarena.tiers import HostTier, TierStack

    page = [EntryField("k", 2, (4, 8), torch.bfloat16)]
    state = [
        EntryField("ssm", 2, (2, 16), torch.float32),
        EntryField("score", 1, (8,), torch.float32, fill=-math.inf, in_checkpoint=False),
    ]
    plan = plan_for(page, state, 24 * 1024, 2, block_size=4)
    pc = PrefixCache(
        plan,
        "cpu",
        policy=CheckpointPolicy.parse("end,interval:8"),
        tiers=TierStack([HostTier(1 << 20, frame_bytes=1024)]),
    )
    rng = np.random.default_rng(0)
    for r in range(40):  # more prompts than the device holds: evictions to the tier
        tokens = rng.integers(0, 50, 40 + r)
        pc.admit(r, tokens)
        pc.commit(r, len(tokens))
        pc.checkpoint(r, len(tokens) // 4)
        pc.finish(r)
    pc.cache.grow_state(1)
    assert pc.metrics.evicted_blocks and pc.tiers.tiers[0].used_bytes  # the tier was used
    # the pool's sink, and the objects that made it (the tier loads) and keep it
    allowed = {
        ("BlockAllocator", "_write_down"),
        ("TierLoads", "write_down"),
        ("PrefixCache", "_write_down"),
    }
    seen, todo, found = set(), [pc], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        values: list[tuple[str, object]] = []
        if isinstance(obj, dict):
            values = [(str(k), v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            values = [("[]", v) for v in obj]
        elif type(obj).__module__.startswith(("kvarena.pools", "kvarena.prefix")):
            values = list(vars(obj).items()) if hasattr(obj, "__dict__") else []
        for name, v in values:
            if isinstance(v, (weakref.ref, weakref.WeakValueDictionary, weakref.WeakSet)):
                found.append(f"{type(obj).__name__}.{name}: a weak reference")
            elif callable(v) and not isinstance(v, (type, torch.Tensor)):
                if (type(obj).__name__, name) not in allowed:
                    found.append(f"{type(obj).__name__}.{name}: {v!r:.60}")
            if isinstance(v, (dict, list, tuple, set, frozenset)) or type(v).__module__.startswith(
                ("kvarena.pools", "kvarena.prefix")
            ):
                todo.append(v)
    assert len(seen) > 10 and not found, found


def test_the_prefix_cache_keeps_no_book_of_blocks():
    """No dict from keys to blocks or back in the prefix cache: it asks the pool."""
    for m, p in MODULES.items():
        if _unit(m) != "prefix":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
                ann = ast.unparse(node.annotation)
                assert not ("dict[bytes, int]" in ann or "dict[int, bytes]" in ann), (
                    f"{m}: self.{node.target.attr}: {ann}"
                )


def _calls(name: str) -> dict[str, int]:
    """Modules calling ``name(...)`` (a plain name or an attribute), with counts."""
    out: dict[str, int] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if called == name:
                    out[module] = out.get(module, 0) + 1
    return out


def _prefix_tests(prefixes: tuple[str, ...]) -> set[str]:
    """Modules that test a string for one of ``prefixes`` (``x.startswith(...)``):
    where a grammar is parsed, not where a string of it is written."""
    found = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "startswith"
                and any(
                    isinstance(c, ast.Constant) and str(c.value).startswith(prefixes)
                    for arg in node.args
                    for c in ast.walk(arg)
                )
            ):
                found.add(module)
    return found


def test_each_rule_has_one_definition():
    """What an object must be (the span rule), when it is sealed, and the tier
    spec grammar are each written once: a second writer of any of them is
    named here."""
    assert _calls("Expected") == {"kvarena.tiers.checked": 1}
    assert _calls("object_span") == {"kvarena.tiers.checked": 1}
    assert _calls("seal") == {"kvarena.tiers.base": 1}
    assert _prefix_tests(("host:", "disk:", "redis")) <= {"kvarena.tiers.spec"}
    # a key (KEY_BYTES long) is derived in the key chain and per rank, nowhere else
    keyed = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "blake2b":
                if any(getattr(k.value, "id", None) == "KEY_BYTES" for k in node.keywords):
                    keyed.add(module)
    assert keyed == {"kvarena.prefix.keys", "kvarena.integrations.vllm.ranks"}


def test_no_mixin_declares_its_hosts_attributes():
    """A class that declares attributes it never sets (bare annotations outside a
    dataclass, a Protocol or a NamedTuple, never assigned on ``self``) is a mixin
    reading its host's private state: the piece should be an object its host
    holds and passes what it needs."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            marks = {ast.unparse(d).split("(")[0] for d in node.decorator_list}
            bases = {ast.unparse(b) for b in node.bases}
            if marks & {"dataclass", "dataclasses.dataclass"} or bases & {
                "Protocol",
                "ABC",  # an abstract base: its subclasses set what it declares
                "NamedTuple",
                "TypedDict",
                "Enum",
                "enum.Enum",
                "enum.IntEnum",
            }:
                continue
            assigned = {
                t.attr
                for n in ast.walk(node)
                if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                for tgt in (n.targets if isinstance(n, ast.Assign) else [n.target])
                for t in ast.walk(tgt)
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
            }
            bare = [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and s.value is None
                and isinstance(s.target, ast.Name)
                and s.target.id not in assigned
            ]
            if bare:
                found.append(f"{module}.{node.name}: {bare[:4]}")
    assert not found, found
