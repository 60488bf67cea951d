"""The built book: lesson pages render their figures and maths with no console error and no
request leaving the site."""

import json

import pytest

PAGES = ["index.html", "intro.html", "course-map.html", "lessons/01-masking-equation.html"]


@pytest.mark.parametrize("path", PAGES)
def test_page_loads_cleanly_and_offline(book_server, page_with_log, path):
    page, log = page_with_log(book_server)
    page.goto(f"{book_server}/{path}")
    page.wait_for_load_state("networkidle")
    assert log.outside_requests() == []
    assert log.failed == []
    assert log.page_errors == []
    assert log.console_errors == []


def test_lesson_figures_and_maths_render(book_server, page_with_log):
    page, log = page_with_log(book_server)
    page.goto(f"{book_server}/lessons/01-masking-equation.html")
    page.wait_for_load_state("networkidle")
    n_html_figures = page.locator(".cell_output .js-plotly-plot").count()
    assert n_html_figures >= 2
    page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= {n_html_figures}",
                           timeout=30_000)
    page.wait_for_function("() => document.querySelectorAll('article mjx-container svg').length > 10",
                           timeout=30_000)  # MathJax, served by the site itself, typeset the equations
    assert log.outside_requests() == [] and log.page_errors == [] and log.console_errors == []


def test_mask_zoo_buttons_work_without_a_kernel(book_server, page_with_log):
    page, _ = page_with_log(book_server)
    page.goto(f"{book_server}/lessons/01-masking-equation.html")
    page.wait_for_load_state("networkidle")
    plot = page.locator(".js-plotly-plot").filter(has=page.locator(".updatemenu-button")).first
    plot.scroll_into_view_if_needed()
    before = plot.evaluate("(el) => JSON.stringify(el.data[2].z)")
    plot.locator(".updatemenu-button").filter(has_text="bidirectional").click()
    page.wait_for_function("([el, old]) => JSON.stringify(el.data[2].z) !== old",
                           arg=[plot.element_handle(), before], timeout=10_000)
    after = json.loads(plot.evaluate("(el) => JSON.stringify(el.data[2].z)"))
    T = len(after)
    assert any(after[0][j] > 0 for j in range(1, T))  # bidirectional: the first token now sees ahead
