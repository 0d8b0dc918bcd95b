"""Check kvarena's vLLM connector against released vLLM wheels' source.

    .venv-vllm/bin/python tools/vllm_api_check.py vllm-0.33.0-*.whl [more wheels]

Run in the venv where the connector imports (the installed vLLM); each wheel
is read, never installed (a CUDA wheel cannot run here): its connector base
classes against KvarenaConnector, and every name kvarena imports from vLLM
against its modules (kvarena.testing.vllm_api). Exits 1 on any finding.
"""

from __future__ import annotations

import sys
import tempfile
import zipfile
from pathlib import Path

from kvarena.integrations.vllm.connector import KvarenaConnector
from kvarena.testing import vllm_api


def main(wheels: list[str]) -> int:
    package = Path(vllm_api.__file__).resolve().parents[1]
    wanted = vllm_api.vllm_imports(package.rglob("*.py"))
    bad = 0
    for wheel in wheels:
        with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
            z.extractall(
                tmp, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            )
            root = Path(tmp)
            base = (root / vllm_api.BASE_MODULE).read_text()
            found = vllm_api.connector_mismatches(base, KvarenaConnector)
            found += vllm_api.missing_imports(root, wanted)
        print(f"{Path(wheel).name}: {len(found)} finding(s) over {len(wanted)} imported names")
        for line in found:
            print(f"  {line}")
        bad += bool(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
