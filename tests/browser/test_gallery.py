"""The classroom gallery (`make demo`) in a real Chromium: one Voilà server, the same command
`make demo` runs (tools/make_gallery.py), every widget page opened in turn.

On each page: the widget renders a plotly figure with no error output and no console error;
operating one control with the keyboard alone changes the figure; Tab reaches every control
(sliders, menus, text boxes, buttons, checkboxes, play buttons); no request leaves 127.0.0.1
(Voilà's own template would fetch its icon font from a CDN; the gallery's serves it locally).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from widgets.gallery import GALLERY

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "onemask-gallery-test-token"
PAGES = [(f"{i:02d}-{name}.ipynb", name) for i, name in enumerate(GALLERY, start=1)]
RENDER_TIMEOUT_MS = 180_000  # a page builds its widget when it opens; three of them train a small model first

# What counts as a control: everything a user operates. Plotly's own modebar is not a widget control.
CONTROLS = 'input, select, button, textarea, .noUi-handle, [contenteditable="true"]'
MARK_CONTROLS_JS = """(sel) => {
  const root = document.querySelector('.onemask-present');
  const controls = Array.from(root.querySelectorAll(sel)).filter(el =>
    !el.disabled && !el.closest('[disabled]') && !el.closest('.modebar') && el.getClientRects().length > 0);
  controls.forEach((el, i) => el.setAttribute('data-onemask-control', String(i)));
  return controls.map(el => el.tagName.toLowerCase() + '.' + String(el.className).split(' ')[0]
                             + ' ' + (el.closest('.widget-inline-hbox, .widget-text, .widget-dropdown')
                                      ?.querySelector('.widget-label')?.textContent || el.textContent || '').trim());
}"""
FIGURE = "JSON.stringify([el.data.map(t => [t.x, t.y, t.z, t.text]), el.layout.title])"


def _load_make_gallery():
    spec = importlib.util.spec_from_file_location("make_gallery", ROOT / "tools" / "make_gallery.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gallery_server(tmp_path_factory, server, unused_port):
    """Voilà serving a freshly generated gallery, started exactly as `make demo` starts it."""
    out = tmp_path_factory.mktemp("demo")
    make_gallery = _load_make_gallery()
    make_gallery.write_gallery(out)
    port = unused_port()
    argv, env = make_gallery.voila_command(out, port, TOKEN)
    env = {**env, "JUPYTER_RUNTIME_DIR": str(out / "runtime"), "JUPYTER_CONFIG_DIR": str(out / "config"),
           "PYTHONHASHSEED": "0"}
    with server(argv, env, out, out / "voila.log", f"http://127.0.0.1:{port}/?token={TOKEN}", "voila", 120):
        yield f"http://127.0.0.1:{port}", out


@pytest.fixture(scope="module")
def context(gallery_server, browser):
    """One browser context for the module: the token in the first URL logs it in (a cookie)."""
    base, _ = gallery_server
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    page.goto(f"{base}/?token={TOKEN}")
    page.close()
    yield context
    context.close()


@pytest.fixture(scope="module", params=PAGES, ids=[name for _, name in PAGES])
def widget_page(request, gallery_server, context, page_log):
    """One widget page, opened once for the three tests below (its kernel builds the widget)."""
    base, _ = gallery_server
    path, name = request.param
    page = context.new_page()
    log = page_log(page, base)
    page.goto(f"{base}/voila/render/{path}", timeout=RENDER_TIMEOUT_MS)
    page.wait_for_selector(".onemask-present .js-plotly-plot .main-svg", timeout=RENDER_TIMEOUT_MS)
    plot = page.locator(".onemask-present .js-plotly-plot").first
    page.wait_for_function("(el) => el.data && el.data.length >= 1", arg=plot.element_handle(), timeout=30_000)
    yield page, log, name
    page.goto("about:blank")  # leaving the page makes Voilà shut its kernel down
    page.close()


def test_index_links_every_widget_and_stays_offline(gallery_server, context, page_log):
    base, _ = gallery_server
    page = context.new_page()
    log = page_log(page, base)
    page.goto(f"{base}/voila/render/index.ipynb", timeout=RENDER_TIMEOUT_MS)
    page.wait_for_selector("table a[href$='.ipynb']", timeout=RENDER_TIMEOUT_MS)
    links = page.eval_on_selector_all("table a[href$='.ipynb']", "(as) => as.map(a => a.getAttribute('href'))")
    assert links == [path for path, _ in PAGES]
    # the presenter key N goes to the first widget (answered by a stub here: no second kernel)
    page.route(f"**/{PAGES[0][0]}", lambda route: route.fulfill(body="next", content_type="text/plain"))
    page.keyboard.press("n")
    page.wait_for_url(f"**/{PAGES[0][0]}", timeout=30_000)
    page.goto("about:blank")
    assert log.outside_requests() == []
    assert log.console_errors == [] and log.page_errors == []
    page.close()


def test_widget_renders_without_errors_or_outside_requests(widget_page):
    page, log, name = widget_page
    text = page.inner_text("body")
    assert "Traceback" not in text and "There was an error" not in text, text[-2000:]
    assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").count() == 0
    assert page.locator(".onemask-present .onemask-present-title").inner_text() == GALLERY[name].title
    # the icon font comes from the gallery's own template, not a CDN
    assert any("/voila/templates/onemask/static/font-awesome/" in u for u in log.requests)
    assert log.outside_requests() == [], log.outside_requests()
    assert log.console_errors == [] and log.page_errors == [], log.console_errors + log.page_errors
    assert log.failed == []


def test_widget_responds_to_the_keyboard(widget_page):
    """A menu gets ArrowDown (ArrowUp on its last option); otherwise the first slider ArrowRight."""
    page, log, name = widget_page
    root = page.locator(".onemask-present")
    plot = root.locator(".js-plotly-plot").first
    before = plot.evaluate(f"(el) => {FIGURE}")
    selects = root.locator(".widget-dropdown select:not([disabled])")
    if selects.count():
        select = selects.first
        select.focus()
        at_end = select.evaluate("(s) => s.selectedIndex === s.options.length - 1")
        select.press("ArrowUp" if at_end else "ArrowDown")
    else:
        handle = root.locator(".noUi-handle").first
        handle.focus()
        for _ in range(3):
            handle.press("ArrowRight")
    page.wait_for_function(f"([el, old]) => {FIGURE} !== old",
                           arg=[plot.element_handle(), before], timeout=60_000)
    assert log.console_errors == [] and log.page_errors == []


def test_every_control_is_reachable_by_tab(widget_page):
    page, _, name = widget_page
    controls = page.evaluate(MARK_CONTROLS_JS, CONTROLS)
    assert len(controls) >= 2, f"{name}: expected several controls, found {controls}"
    page.evaluate("() => document.activeElement && document.activeElement.blur()")
    page.evaluate("() => window.scrollTo(0, 0)")
    reached: set[int] = set()
    for _ in range(4 * len(controls) + 60):  # links, plotly's modebar and the readouts come in between
        page.keyboard.press("Tab")
        mark = page.evaluate("() => document.activeElement?.getAttribute('data-onemask-control')")
        if mark is not None:
            reached.add(int(mark))
        if len(reached) == len(controls):
            break
    missed = [c for i, c in enumerate(controls) if i not in reached]
    assert not missed, f"{name}: Tab never reaches {missed}"
