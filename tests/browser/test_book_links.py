"""The built book as files: no page shows an error output, and every internal link (and its
#anchor) points at something the build contains. Runs after `make book`, like the other
browser-stage tests; needs no browser."""

from __future__ import annotations

import html
import re
from pathlib import Path
from urllib.parse import unquote, urldefrag

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "book" / "_build" / "html"
PAGES = sorted(p for p in SITE.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts)
HREF = re.compile(r'\b(?:href|src)="([^"]+)"')
ID = re.compile(r'\bid="([^"]+)"')
EXTERNAL = ("http://", "https://", "mailto:", "data:", "javascript:", "//")


def ids_of(page: Path, cache: dict = {}) -> set[str]:  # noqa: B006 (a per-run cache)
    if page not in cache:
        cache[page] = set(ID.findall(page.read_text(encoding="utf-8")))
    return cache[page]


@pytest.fixture(scope="module", autouse=True)
def built():
    if not (SITE / "index.html").exists():
        pytest.fail("the book is not built: run `make book` first (make test does)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(SITE)))
def test_internal_links_and_anchors_resolve(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for raw in HREF.findall(text):
        url = html.unescape(raw)
        if url.startswith(EXTERNAL):
            continue  # off-site links are allowed as links; test_book checks no request leaves the site
        path, fragment = urldefrag(url)
        target = page if not path else (page.parent / unquote(path.split("?")[0])).resolve()
        if path and not target.exists():
            broken.append(f"{url}: no such file")
        elif fragment and target.suffix == ".html" and unquote(fragment) not in ids_of(target):
            broken.append(f"{url}: no element with id {fragment!r}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent.name == "lessons"], ids=lambda p: p.name)
def test_lesson_page_shows_no_error_output(page):
    text = page.read_text(encoding="utf-8")
    assert "output traceback" not in text and "Traceback (most recent call last)" not in text
