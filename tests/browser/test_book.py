"""The built book: every page renders its figures and maths with no console error and no
request leaving the site; static figures work without a kernel; every lesson page says what to
read first and links its notebooks, served by the site itself."""

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml

from lib.course.lessons import LESSONS

ROOT = Path(__file__).resolve().parents[2]

LESSON_PAGES = [f"lessons/{lesson.stem}.html" for lesson in LESSONS if lesson.landed()]
PAGES = ["index.html", "intro.html", "course-map.html", "notation.html", "claims.html", "teaching.html", *LESSON_PAGES]


@pytest.mark.parametrize("path", PAGES)
def test_page_loads_cleanly_and_offline(book_server, page_with_log, path):
    page, log = page_with_log(book_server)
    page.goto(f"{book_server}/{path}")
    page.wait_for_load_state("networkidle")
    assert log.outside_requests() == []
    assert log.failed == []
    assert log.page_errors == []
    assert log.console_errors == []
    page.context.close()


@pytest.mark.parametrize("path", LESSON_PAGES)
def test_lesson_figures_and_maths_render(book_server, page_with_log, path):
    page, log = page_with_log(book_server)
    page.goto(f"{book_server}/{path}")
    page.wait_for_load_state("networkidle")
    n_figures = page.locator(".cell_output .js-plotly-plot").count()
    assert n_figures >= 2
    page.wait_for_function(
        f"() => document.querySelectorAll('.cell_output .js-plotly-plot .main-svg').length >= {n_figures}",
        timeout=30_000,
    )
    page.wait_for_function(
        "() => document.querySelectorAll('article mjx-container svg').length > 3", timeout=30_000
    )  # MathJax, served by the site itself, typeset the equations
    assert log.outside_requests() == [] and log.page_errors == [] and log.console_errors == []
    page.context.close()


def test_mask_zoo_buttons_work_without_a_kernel(book_server, page_with_log):
    page, _ = page_with_log(book_server)
    page.goto(f"{book_server}/lessons/01-masking-equation.html")
    page.wait_for_load_state("networkidle")
    plot = page.locator(".js-plotly-plot").filter(has=page.locator(".updatemenu-button")).first
    plot.scroll_into_view_if_needed()
    before = plot.evaluate("(el) => JSON.stringify(el.data[2].z)")
    plot.locator(".updatemenu-button").filter(has_text="bidirectional").click()
    page.wait_for_function(
        "([el, old]) => JSON.stringify(el.data[2].z) !== old", arg=[plot.element_handle(), before], timeout=10_000
    )
    after = page.evaluate("(el) => el.data[2].z", plot.element_handle())
    assert any(after[0][j] > 0 for j in range(1, len(after)))  # bidirectional: the first token now sees ahead
    page.context.close()


def test_bertviz_views_render_on_the_book_page(book_server, page_with_log):
    page, log = page_with_log(book_server)
    page.goto(f"{book_server}/lessons/02-bert.html")
    page.wait_for_load_state("networkidle")
    page.wait_for_function("() => document.querySelectorAll('[id^=bertviz-] svg text').length > 10", timeout=30_000)
    drawn = page.evaluate(
        "() => Array.from(document.querySelectorAll('[id^=bertviz-] svg text')).map(t => t.textContent)"
    )
    assert "tired" in drawn and "[CLS]" in drawn
    assert log.outside_requests() == [] and log.page_errors == []
    page.context.close()


@pytest.mark.parametrize("lesson", [lesson for lesson in LESSONS if lesson.landed()], ids=lambda lesson: lesson.stem)
def test_lesson_page_links_its_notebooks_and_names_its_prerequisites(book_server, lesson):
    page_url = f"{book_server}/lessons/{lesson.stem}.html"
    page = urllib.request.urlopen(page_url).read().decode()
    box = re.search(r'<div class="admonition note onemask-lesson-box">(.*?)</div>', page, flags=re.S)
    assert box, f"{lesson.stem}: no 'Before you start' box"
    box = box.group(1)
    hrefs = re.findall(r'<a class="reference download" href="([^"]+)" download=', box)
    downloads = {href: f"lessons/{href}" for href in hrefs}
    build = next((ROOT / "lessons" / "build").glob(f"{lesson.number:02d}-build-*.ipynb"))
    assert downloads == {
        f"{lesson.stem}.ipynb": f"lessons/{lesson.stem}.ipynb",
        f"exercises/{lesson.stem}.ipynb": f"lessons/exercises/{lesson.stem}.ipynb",
        f"build/{build.name}": f"lessons/build/{build.name}",
    }
    for href, source in downloads.items():
        served = urllib.request.urlopen(f"{book_server}/lessons/{href}").read()  # relative to the page
        assert served == (ROOT / source).read_bytes(), f"{href} is not the repository's {source} (rebuild: make book)"
        assert json.loads(served)["nbformat"] == 4
    assert "make lab" in box and f"exercises/{lesson.stem}.ipynb</code>" in box and f"build/{build.name}</code>" in box

    prerequisites = yaml.safe_load((ROOT / "book" / "prerequisites.yml").read_text())[f"{lesson.number:02d}"]
    linked = re.findall(r'<li><a class="reference internal" href="(\d\d)-[\w-]+\.html">', box)
    assert linked == [entry["lesson"] for entry in prerequisites]
    for href in re.findall(r'<li><a class="reference internal" href="([^"]+)">', box):
        assert urllib.request.urlopen(f"{book_server}/lessons/{href}").status == 200
    if not prerequisites:
        assert "None: the course starts here." in box
