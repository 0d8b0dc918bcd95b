"""Does ``KvarenaConnector`` still fit a vLLM release's connector API?

vLLM calls a KV connector through the methods of ``KVConnectorBase_V1`` and,
for hybrid models, ``SupportsHMA``; a release that adds an abstract method or
changes a signature breaks a connector only when the engine first makes that
call, deep in a serving process. These checks read the base classes from the
*source* of ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (so a
release that cannot be installed here, a CUDA wheel, is checked from its
wheel) and compare them with the connector class as imported:

- every abstract method of the bases is implemented by the connector;
- every base method the connector overrides accepts every call the base's
  signature accepts (same positional names in the same places, each keyword
  taken, ``*args``/``**kwargs`` kept, and no new parameter without a default);
- every name kvarena imports from ``vllm`` exists in that release's source.

Each finding is one line naming the method (or the import) and what differs.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

BASES = ("KVConnectorBase_V1", "SupportsHMA")
BASE_MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


@dataclass(frozen=True, kw_only=True)
class Params:
    """A signature reduced to what decides which calls it accepts."""

    positional: tuple[str, ...]  # positional-or-keyword (and positional-only) names, in order
    keyword_only: frozenset[str]
    required: frozenset[str]  # names without a default
    var_positional: bool
    var_keyword: bool


@dataclass(frozen=True, kw_only=True)
class BaseMethod:
    cls: str
    name: str
    abstract: bool
    is_property: bool
    params: Params


def _params_of_ast(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Params:
    a = fn.args
    pos = [x.arg for x in (*a.posonlyargs, *a.args)]
    defaults = len(a.defaults)
    required = set(pos[: len(pos) - defaults] if defaults else pos)
    kwonly = [x.arg for x in a.kwonlyargs]
    required |= {n for n, d in zip(kwonly, a.kw_defaults, strict=True) if d is None}
    first = pos[:1]
    if first and first[0] in ("self", "cls"):
        pos = pos[1:]
        required -= set(first)
    return Params(
        positional=tuple(pos),
        keyword_only=frozenset(kwonly),
        required=frozenset(required),
        var_positional=a.vararg is not None,
        var_keyword=a.kwarg is not None,
    )


def _params_of(fn: object) -> Params:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    kinds = inspect.Parameter
    ps = list(sig.parameters.values())
    if ps and ps[0].name in ("self", "cls"):
        ps = ps[1:]
    return Params(
        positional=tuple(
            p.name for p in ps if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
        ),
        keyword_only=frozenset(p.name for p in ps if p.kind == kinds.KEYWORD_ONLY),
        required=frozenset(
            p.name
            for p in ps
            if p.default is kinds.empty and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
        ),
        var_positional=any(p.kind == kinds.VAR_POSITIONAL for p in ps),
        var_keyword=any(p.kind == kinds.VAR_KEYWORD for p in ps),
    )


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        node = d.func if isinstance(d, ast.Call) else d
        names.add(node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", ""))
    return names


def base_methods(source: str) -> list[BaseMethod]:
    """The public methods of the connector base classes in a ``base.py`` source."""
    out = []
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and node.name in BASES):
            continue
        for fn in node.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if fn.name.startswith("_"):
                continue
            marks = _decorators(fn)
            out.append(
                BaseMethod(
                    cls=node.name,
                    name=fn.name,
                    abstract="abstractmethod" in marks,
                    is_property="property" in marks or "setter" in marks,
                    params=_params_of_ast(fn),
                )
            )
    return out


def _accepts(mine: Params, base: Params) -> list[str]:
    """What of ``base``'s calls ``mine`` would refuse (empty: it takes them all)."""
    why = []
    for i, name in enumerate(base.positional):
        if i < len(mine.positional):
            if mine.positional[i] != name:
                why.append(f"argument {i + 1} is {mine.positional[i]!r}, vLLM passes {name!r}")
        elif not (mine.var_positional and (mine.var_keyword or name in mine.keyword_only)):
            why.append(f"takes no argument {i + 1} ({name!r})")
    for name in sorted(base.keyword_only):
        if name not in mine.positional and name not in mine.keyword_only and not mine.var_keyword:
            why.append(f"takes no keyword {name!r}")
    if base.var_positional and not mine.var_positional:
        why.append("takes no *args")
    if base.var_keyword and not mine.var_keyword:
        why.append("takes no **kwargs")
    # a positional name at a place vLLM fills is reported above, not here
    known = set(base.positional) | base.keyword_only | set(mine.positional[: len(base.positional)])
    extra = sorted(mine.required - known)
    if extra:
        why.append(f"requires {extra}, which vLLM does not pass")
    return why


def connector_mismatches(base_source: str, connector: type) -> list[str]:
    """One line per way ``connector`` does not fit the bases in ``base_source``."""
    methods = base_methods(base_source)
    found = {m.cls for m in methods}
    lines = [f"{c}: not in this vLLM's base.py" for c in BASES if c not in found]
    for m in methods:
        impl = inspect.getattr_static(connector, m.name, None)
        where = f"{m.cls}.{m.name}"
        if impl is None:
            if m.abstract:
                lines.append(f"{where}: abstract in vLLM, not implemented by {connector.__name__}")
            continue
        if getattr(impl, "__isabstractmethod__", False):
            lines.append(f"{where}: abstract in vLLM, not implemented by {connector.__name__}")
            continue
        if m.is_property or isinstance(impl, property):
            if m.is_property != isinstance(impl, property):
                lines.append(f"{where}: a property on one side only")
            continue
        fn = impl.__func__ if isinstance(impl, (classmethod, staticmethod)) else impl
        if not callable(fn):
            lines.append(f"{where}: {connector.__name__} holds a {type(fn).__name__}")
            continue
        lines.extend(f"{where}: {why}" for why in _accepts(_params_of(fn), m.params))
    return lines


def vllm_imports(sources: Iterable[Path]) -> set[tuple[str, str]]:
    """``(module, name)`` for every ``from vllm... import name`` in the given files."""
    out = set()
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                out |= {(node.module or "", a.name) for a in node.names}
    return out


def missing_imports(root: Path, wanted: set[tuple[str, str]]) -> list[str]:
    """Each wanted name that the vLLM source tree under ``root`` (the folder holding
    ``vllm/``) neither defines, assigns nor re-exports in its module."""
    lines = []
    for module, name in sorted(wanted):
        base = root / module.replace(".", "/")
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not path.exists():
            if (base / name).is_dir() or (base / f"{name}.py").exists():
                continue  # a submodule
            lines.append(f"from {module} import {name}: no module {module}")
            continue
        if base.is_dir() and ((base / name).is_dir() or (base / f"{name}.py").exists()):
            continue
        if not _binds(ast.parse(path.read_text()), name):
            lines.append(f"from {module} import {name}: not in {module}")
    return lines


def _binds(tree: ast.Module, name: str) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        elif isinstance(node, ast.Constant) and node.value == name:
            return True  # a lazy export table (``__getattr__`` over a dict of names)
    return False
