"""The connector against vLLM's connector API (kvarena.testing.vllm_api).

The checker itself is tested on made-up base classes in any venv (it reads
source, never imports vLLM); the installed vLLM's own base classes and
modules are checked in ``.venv-vllm``, so a vLLM upgrade that adds an abstract
method or changes a signature fails here, naming the method, rather than in a
serving engine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from kvarena.testing import vllm_api

BASE = """
from abc import ABC, abstractmethod

class KVConnectorBase_V1(ABC):
    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs) -> None: ...

    def request_finished(self, request, block_ids):
        return False, None

    @property
    def role(self):
        return self._role

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return None

    def _private(self, anything): ...

class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids): ...
"""


class _Fits:
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def request_finished(self, request: Any, block_ids: Any, extra: int = 0) -> Any:
        return False, None

    @property
    def role(self) -> str:
        return "worker"

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> None:
        return None

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return False, None


def test_a_fitting_connector_has_no_findings():
    assert vllm_api.connector_mismatches(BASE, _Fits) == []


def test_a_new_abstract_method_is_named():
    new = BASE + "\n    @abstractmethod\n    def get_finished_all_groups(self, ids): ...\n"
    assert vllm_api.connector_mismatches(new, _Fits) == [
        "SupportsHMA.get_finished_all_groups: abstract in vLLM, not implemented by _Fits"
    ]


def test_signature_changes_are_named():
    class Renamed(_Fits):
        def request_finished(self, req: Any, block_ids: Any) -> Any:  # type: ignore[override]
            return False, None

    class NoKwargs(_Fits):
        def start_load_kv(self, forward_context: Any) -> None:  # type: ignore[override]
            return None

    class Requires(_Fits):
        def request_finished(self, request: Any, block_ids: Any, extra: int) -> Any:  # type: ignore[override]
            return False, None

    class NotProperty(_Fits):
        def role(self) -> str:  # type: ignore[override]
            return "worker"

    assert vllm_api.connector_mismatches(BASE, Renamed) == [
        "KVConnectorBase_V1.request_finished: argument 1 is 'req', vLLM passes 'request'"
    ]
    assert vllm_api.connector_mismatches(BASE, NoKwargs) == [
        "KVConnectorBase_V1.start_load_kv: takes no **kwargs"
    ]
    assert vllm_api.connector_mismatches(BASE, Requires) == [
        "KVConnectorBase_V1.request_finished: requires ['extra'], which vLLM does not pass"
    ]
    assert vllm_api.connector_mismatches(BASE, NotProperty) == [
        "KVConnectorBase_V1.role: a property on one side only"
    ]
    grown = BASE.replace(
        "def request_finished(self, request, block_ids)",
        "def request_finished(self, request, block_ids, *, num_computed)",
    )
    assert vllm_api.connector_mismatches(grown, _Fits) == [
        "KVConnectorBase_V1.request_finished: takes no keyword 'num_computed'"
    ]
    assert vllm_api.connector_mismatches("class Other: ...", _Fits) == [
        "KVConnectorBase_V1: not in this vLLM's base.py",
        "SupportsHMA: not in this vLLM's base.py",
    ]


def test_missing_imports_are_named(tmp_path):
    pkg = tmp_path / "vllm" / "config"
    pkg.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("from vllm.entry import LLM\n")
    (pkg / "__init__.py").write_text("KVTransferConfig = object\n")
    (pkg / "parallel.py").write_text("class ParallelConfig: ...\n")
    src = tmp_path / "user.py"
    src.write_text(
        "from vllm import LLM, SamplingParams\n"
        "from vllm.config import KVTransferConfig, parallel\n"
        "from vllm.gone import Thing\n"
        "import os\n"
    )
    wanted = vllm_api.vllm_imports([src])
    assert wanted == {
        ("vllm", "LLM"),
        ("vllm", "SamplingParams"),
        ("vllm.config", "KVTransferConfig"),
        ("vllm.config", "parallel"),
        ("vllm.gone", "Thing"),
    }
    assert vllm_api.missing_imports(tmp_path, wanted) == [
        "from vllm import SamplingParams: not in vllm",
        "from vllm.gone import Thing: no module vllm.gone",
    ]


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (.venv-vllm has it)"
)


@needs_vllm
def test_the_connector_fits_the_installed_vllm():
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    from kvarena.integrations.vllm.connector import KvarenaConnector

    found = vllm_api.connector_mismatches(Path(base.__file__).read_text(), KvarenaConnector)
    assert found == [], f"vLLM {vllm.__version__}: " + "; ".join(found)


@needs_vllm
def test_every_name_kvarena_imports_from_vllm_exists():
    import vllm

    package = Path(vllm_api.__file__).resolve().parents[1]
    wanted = vllm_api.vllm_imports(package.rglob("*.py"))
    assert ("vllm.config", "KVTransferConfig") in wanted  # the scan sees the integration
    root = Path(vllm.__file__).resolve().parents[1]
    assert vllm_api.missing_imports(root, wanted) == []
