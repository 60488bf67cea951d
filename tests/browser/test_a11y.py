"""An automated accessibility scan of every built book page: axe-core (Deque's engine, installed
by `make`'s setup from the npm registry, see tools/install_axe.sh) runs inside Chromium on each
page, and no violation of impact "serious" or "critical" is allowed.

Scanned after the figures and the maths are drawn, so plotly's SVG and MathJax's output are
checked as a reader meets them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
AXE_JS = ROOT / ".venv" / "share" / "onemask-axe" / "node_modules" / "axe-core" / "axe.min.js"
AXE_VERSION = "4.14.1"  # keep in step with tools/install_axe.sh
BLOCKING = {"serious", "critical"}


def book_pages() -> list[str]:
    """Every page of the book's table of contents, then the pages Sphinx adds itself."""
    toc = yaml.safe_load((ROOT / "book" / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            files.extend([node["file"]] if "file" in node else [])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(toc.get("parts", toc.get("chapters", [])))
    return [f"{Path(f).with_suffix('')}.html" for f in files] + ["genindex.html", "search.html"]


PAGES = book_pages()


@pytest.fixture(scope="module")
def axe_script() -> str:
    if not AXE_JS.exists():
        reason = (
            f"axe-core is not installed at {AXE_JS.relative_to(ROOT)}: "
            "run `bash tools/install_axe.sh .venv` (needs npm)"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)  # CI's setup installs it: absent there is a broken setup, not a skip
        pytest.skip(reason)
    return AXE_JS.read_text(encoding="utf-8")


def describe(violations: list[dict]) -> str:
    lines = []
    for v in violations:
        lines.append(f"[{v['impact']}] {v['id']}: {v['help']} ({len(v['nodes'])} element(s)) {v['helpUrl']}")
        for node in v["nodes"][:5]:
            fix = " ".join(line.strip() for line in node.get("failureSummary", "").splitlines()[1:])  # after "Fix ...:"
            lines.append(f"    {' '.join(map(str, node['target']))}: {fix}")
            lines.append(f"      {node['html'][:160]}")
    return "\n".join(lines)


@pytest.mark.parametrize("path", PAGES)
def test_page_has_no_serious_accessibility_violations(book_server, page_with_log, axe_script, path):
    page, _ = page_with_log(book_server)
    # Generous timeouts: a lesson page carries plotly.js and MathJax, and CI's 2 cores may be busy.
    response = page.goto(f"{book_server}/{path}", timeout=120_000)
    assert response.ok, f"{path}: {response.status} (is the book built? make book)"
    page.wait_for_load_state("networkidle", timeout=120_000)
    n_figures = page.locator(".js-plotly-plot").count()
    if n_figures:
        page.wait_for_function(
            f"() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= {n_figures}", timeout=60_000
        )
    page.add_script_tag(content=axe_script)
    assert page.evaluate("() => axe.version") == AXE_VERSION
    results = page.evaluate("() => axe.run(document, {resultTypes: ['violations']})")
    blocking = [v for v in results["violations"] if v["impact"] in BLOCKING]
    page.context.close()
    assert not blocking, (
        f"{path}: {len(blocking)} serious or critical accessibility violation(s):\n{describe(blocking)}"
    )
