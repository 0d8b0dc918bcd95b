"""The front door (``kvarena/__init__.py``) and the command's start: every name
served is the object its module defines, the three lists of names (the
imports type checkers read, the homes that serve them, ``__all__``) agree,
and importing ``kvarena`` or running ``kvarena tiers`` loads no torch."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import kvarena

INIT = pathlib.Path(kvarena.__file__)


def _type_checking_imports() -> dict[str, set[str]]:
    """The names the ``if TYPE_CHECKING:`` block imports, by module."""
    tree = ast.parse(INIT.read_text())
    block = next(
        n
        for n in tree.body
        if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"
    )
    out: dict[str, set[str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1
        out.setdefault(node.module or "", set()).update(a.name for a in node.names)
    return out


def test_the_three_lists_of_names_agree():
    homes = {m: set(names) for m, names in kvarena._HOMES.items()}
    assert _type_checking_imports() == homes
    served = {n for names in homes.values() for n in names}
    assert sum(len(v) for v in homes.values()) == len(served)  # one home per name
    assert set(kvarena.__all__) == served | {"__version__"}
    assert len(kvarena.__all__) == len(set(kvarena.__all__))


@pytest.mark.parametrize("name", sorted(n for n in kvarena.__all__ if n != "__version__"))
def test_each_name_is_its_modules_object(name):
    import importlib

    home = importlib.import_module(f"kvarena.{kvarena._HOME_OF[name]}")
    assert getattr(kvarena, name) is getattr(home, name)
    assert name in dir(kvarena)


def test_subpackages_are_attributes_and_unknown_names_refused():
    assert kvarena.tiers.TierStack is kvarena.TierStack
    assert kvarena.layout.EntryField is kvarena.EntryField
    with pytest.raises(AttributeError, match="no_such_name"):
        kvarena.no_such_name  # noqa: B018
    from kvarena.tiers import HostTier
    from kvarena.tiers.host import HostTier as home

    assert HostTier is home
    with pytest.raises(AttributeError, match="HostTiers"):
        kvarena.tiers.HostTiers  # noqa: B018


def _fresh(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_importing_kvarena_loads_no_torch_until_a_name_needs_it():
    out = _fresh(
        "import sys, kvarena\n"
        "print('torch' in sys.modules, kvarena.Error.__name__, 'torch' in sys.modules)\n"
        "kvarena.UnifiedCache\n"
        "print('torch' in sys.modules)\n"
    )
    assert out.split() == ["False", "Error", "False", "True"]


def test_kvarena_tiers_runs_without_torch(tmp_path):
    """``kvarena tiers stat`` on a real directory, in a fresh interpreter: its
    answer as the command gives it, and torch never imported."""
    from kvarena.tiers import DiskTier

    DiskTier(tmp_path / "d", 1 << 20).close()
    out = _fresh(
        "import sys\n"
        "from kvarena.cli import main\n"
        "try:\n"
        f"    main(['tiers', 'stat', {str(tmp_path / 'd')!r}, '--json'])\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "print('torch' in sys.modules)\n"
    )
    *answer, loaded = out.strip().splitlines()
    assert loaded == "False"
    assert json.loads("\n".join(answer))["objects"] == 0


def test_registering_an_unknown_command_is_refused_naming_the_commands():
    from kvarena.cli import COMMANDS, registered

    with pytest.raises(kvarena.InvalidValueError, match=r"'tiers'.*got 'tier'"):
        registered(["tier"])
    assert registered(["tiers"]).registered_groups  # a known name registers its command
    assert set(COMMANDS) == {"plan", "demo", "replay", "tiers"}
