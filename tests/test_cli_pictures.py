"""The drawing commands end to end: plan --picture, replay --sweep/--timeline/--report,
their refusals (exit 2, one line, nothing written), and the report in a real browser."""

import json
import shutil
import subprocess
import sys

import pytest
from test_cli_refusals import assert_one_line_refusal, run_many
from test_replay import synthetic_lines

pytest.importorskip("matplotlib")

MODEL = ["--model", "qwen3-next-80b-a3b", "--tp", "8", "--max-seqs", "8"]


def kvarena(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "kvarena", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "chats.jsonl"
    path.write_text("\n".join(synthetic_lines(7, conversations=20)) + "\n")
    return path


def test_plan_picture_writes_the_memory_map(tmp_path):
    out = tmp_path / "map.svg"
    r = kvarena(
        "plan", "qwen3-next-80b-a3b", "--tp", "8", "--memory", "80GiB", "--picture", str(out)
    )
    assert r.returncode == 0, r.stderr
    assert f"memory map written to {out}" in " ".join(r.stdout.split())
    svg = out.read_text()
    assert 'id="band-k-2-1"' in svg and 'id="band-v-1-1"' in svg  # kvarena's and vLLM's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["map.svg"]


def test_sweep_json_picture_and_report(tmp_path, trace_file):
    curve, page = tmp_path / "curve.svg", tmp_path / "report.html"
    r = kvarena(
        "replay",
        str(trace_file),
        *MODEL,
        "--sweep",
        "256MiB,512MiB,1GiB",
        "--picture",
        str(curve),
        "--report",
        str(page),
        "--json",
        "--workers",
        "2",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "kvarena-sweep/1" and doc["budgets"] == [256 << 20, 512 << 20, 1 << 30]
    assert len(doc["points"]) == 3 * len(doc["policies"]) and len(doc["policies"]) == 4
    assert curve.read_text().count('id="curve-') == 4
    text = page.read_text()
    assert "kvarena-sweep" not in text and "budget sweep" in text.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.svg", "report.html"]


BAD = [
    (["plan", "llama-3.1-8b", "--picture", "{d}/map.txt"], "write one of .svg, .png"),
    (["plan", "llama-3.1-8b", "--picture", "/proc/kvarena-map.svg"], "cannot be written"),
    (["plan", "llama-3.1-8b", "--picture", "{d}/no/such/map.svg"], "does not exist"),
    (["plan", "llama-3.1-8b", "--picture", "{d}"], "is a folder"),
    (["demo", "--picture", "{d}/map.gif"], "write one of .svg, .png"),
    (["replay", "{t}", "--sweep", ""], "expected budgets"),
    (["replay", "{t}", "--sweep", "8GiB,4GiB"], "strictly increasing"),
    (["replay", "{t}", "--sweep", "1GiB,,2GiB"], "an empty budget"),
    (["replay", "{t}", "--sweep", "1MiB,1GiB"], "not even one request fits"),
    (["replay", "{t}", "--picture", "{d}/c.svg"], "--picture draws the budget curve of a --sweep"),
    (["replay", "{t}", "--sweep", "1GiB", "--timeline", "{d}/t.svg"], "cannot be combined"),
    (["replay", "{t}", "--sweep", "1GiB", "--verify"], "bookkeeping mode"),
    (["replay", "{t}", "--report", "{d}/r.pdf"], "write one of .html"),
    (["replay", "{t}", "--timeline", "{d}/x.svg", "--report", "{d}/x.svg"], "write one of .html"),
    (
        [
            "replay",
            "{t}",
            "--sweep",
            "1GiB",
            "--picture",
            "{d}/same.svg",
            "--timeline",
            "{d}/same.svg",
        ],
        "cannot be combined",
    ),
    (["replay", "{t}", "--workers", "0", "--sweep", "1GiB"], "--workers"),
]


def test_bad_picture_options_exit_2_with_one_line_and_write_nothing(tmp_path, trace_file):
    d = tmp_path / "out"
    d.mkdir()
    lists = [[a.format(d=d, t=trace_file) for a in args] for args, _ in BAD]
    for (args, words), (code, err) in zip(BAD, run_many(lists), strict=True):
        assert_one_line_refusal(args, code, err, words)
    assert list(d.iterdir()) == []


def test_import_and_plain_commands_load_no_plotting_library():
    code = (
        "import sys, kvarena\n"
        "from kvarena.cli import app\n"
        "app(['plan', 'llama-3.1-8b'], standalone_mode=False)\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium here (make test installs Debian's chromium where it can)")
    raise AssertionError  # unreachable


def test_the_report_opens_in_a_real_browser(tmp_path, trace_file):
    sync_api = pytest.importorskip("playwright.sync_api")
    browser_path = _chromium()
    page_file, timeline = tmp_path / "report.html", tmp_path / "timeline.png"
    r = kvarena(
        "replay",
        str(trace_file),
        *MODEL,
        "--memory",
        "512MiB",
        "--compare",
        "--timeline",
        str(timeline),
        "--report",
        str(page_file),
    )
    assert r.returncode == 0, r.stderr
    assert timeline.read_bytes()[:4] == b"\x89PNG"
    errors: list[str] = []
    shot = tmp_path / "shot.png"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=browser_path,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("requestfailed", lambda q: errors.append(f"request {q.url}"))
            page.goto(page_file.as_uri(), wait_until="load")
            assert page.locator("svg").count() == 2  # the timeline and the memory map
            body = page.inner_text("body")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert "kvarena replay " + str(trace_file) in body and "sha256" in body
    assert "qwen3-next-80b-a3b" in body and "no state reuse" in body
    from PIL import Image

    img = Image.open(shot).convert("L")
    hist = img.histogram()
    assert sum(hist[:250]) > 0.02 * img.width * img.height  # not a blank page
    assert img.height > 900
