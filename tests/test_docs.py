"""The documentation runs: every ```python block of the README and of docs/ is
executed, page by page in one namespace, so a page cannot drift from the code
unnoticed. A block that cannot run here (a Hub model, a GPU) is preceded by
``<!-- not run: REASON -->``; the reason is required. The site itself is built
with ``mkdocs build --strict`` by ``make test`` (broken links and missing
pages fail there)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARK = re.compile(r"<!--\s*not run:(.*?)-->")


def blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason not run or None)`` for each ```python block."""
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, code = i + 1, []
            i += 1
            while lines[i].strip() != "```":
                code.append(lines[i])
                i += 1
            before = next((x for x in reversed(lines[: start - 1]) if x.strip()), "")
            m = MARK.search(before)
            out.append((start, "\n".join(code), m.group(1).strip() if m else None))
        i += 1
    return out


def test_every_page_is_in_the_site_and_every_skip_says_why():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES[1:]:
        rel = page.relative_to(ROOT / "docs").as_posix()
        assert rel in nav, f"{rel} is not in mkdocs.yml's nav"
    for page in PAGES:
        for line, _, reason in blocks(page):
            assert reason != "", f"{page.name}:{line}: a block not run must say why"


RUNNABLE = [p for p in PAGES if any(r is None for _, _, r in blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_python_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that writes a file writes it here
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for line, code, reason in blocks(page):
        if reason is None:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
    assert set(namespace) - {"__name__", "__builtins__"}, "the examples defined nothing"


def vocabulary(path: Path) -> list[str]:
    """The rows of the page's ``| word | meaning |`` table."""
    lines = path.read_text().split("\n")
    start = lines.index("| word | meaning |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_one_vocabulary_and_every_name_in_it_exists():
    """The README's table is the concepts page's (one table, two places a reader
    starts), and every code name it gives is defined in the package: a rename
    that leaves the table behind fails here."""
    rows = vocabulary(ROOT / "README.md")
    assert rows == vocabulary(ROOT / "docs" / "concepts" / "road.md")
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "kvarena").rglob("*.py"))
    for row in rows:
        for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)`", row):
            leaf = name.split(".")[-1]
            assert re.search(rf"\b{re.escape(leaf)}\b", source), f"{name!r} ({row[:40]}...)"


def test_the_architecture_page_maps_every_module_of_the_vllm_connector():
    page = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    table = page[page.index("## The vLLM connector, module by module") :]
    named = set(re.findall(r"`(\w+)\.py`", table))
    package = ROOT / "src" / "kvarena" / "integrations" / "vllm"
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    assert modules - named == set(), "modules the architecture page does not map"
    assert named - modules == set(), "the page maps modules that do not exist"
