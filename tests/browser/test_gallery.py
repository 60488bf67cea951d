"""The classroom gallery (`make demo`) in a real Chromium: one Voilà server, the same command
`make demo` runs (tools/make_gallery.py), every widget page opened in turn.

On each page: the widget renders a plotly figure with no error output and no console error;
operating one control with the keyboard alone redraws the figure, and what it draws is what the
same widget, built in this test's process at the same defaults, draws for the moved control (every
trace's x, y, z and text, and the title: the right numbers, not just different ones; the models of
the three trained widgets are trained again here, seeded, in float64, a few seconds each); the
router's probe characters are drawn at 16 px without overlapping; Tab reaches every control
(sliders, menus, text boxes, buttons, checkboxes, play buttons); no request leaves 127.0.0.1
(Voilà's own template would fetch its icon font from a CDN; the gallery's serves it locally).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
from drawn import DRAWN_JS, FIGURE
from drawn import difference as _difference
from drawn import drawn_data as _drawn_data
from drawn import plain as _plain

from widgets.gallery import GALLERY, build

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
# The probe characters of the router's strip as drawn: text-mode scatter points of one or two glyphs
PROBE_LABELS_JS = """(el) => Array.from(el.querySelectorAll('.textpoint text'))
  .filter(t => t.textContent.length <= 2)
  .map(t => { const r = t.getBoundingClientRect();
              return {text: t.textContent, size: parseFloat(getComputedStyle(t).fontSize),
                      left: r.left, right: r.right, top: r.top, bottom: r.bottom}; })"""


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
    env = {
        **env,
        "JUPYTER_RUNTIME_DIR": str(out / "runtime"),
        "JUPYTER_CONFIG_DIR": str(out / "config"),
        "PYTHONHASHSEED": "0",
    }
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


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


def _expected_after_the_move(name: str):
    """(what the keyboard does, the data drawn before, the data it must lead to): the same widget
    built here at the gallery's defaults, its control moved as the keys move it in the page. A
    menu's next option (the previous one on its last); otherwise the first slider three steps right
    (stopping at its end)."""
    import ipywidgets as W

    widget = build(name)
    parts = list(_walk(widget))
    figure = next(w for w in parts if type(w).__name__ == "FigureWidget")
    initial = _drawn_data(figure)
    menus = [w for w in parts if isinstance(w, W.Dropdown) and not w.disabled]
    if menus:
        menu = menus[0]
        at_end = menu.index == len(menu.options) - 1
        menu.index += -1 if at_end else 1
        keys = "ArrowUp" if at_end else "ArrowDown"
    else:
        slider = next(w for w in parts if isinstance(w, (W.IntSlider, W.FloatSlider)))
        moved = min(slider.max, slider.value + 3 * slider.step)
        slider.value = moved if isinstance(slider, W.IntSlider) else round(moved, 10)
        keys = "ArrowRight"
    return keys, initial, _drawn_data(figure)


def _assert_probe_labels_readable(plot):
    """The router's probe characters: on the page without hovering, at 14 px or more, no two overlapping."""
    labels = plot.evaluate(PROBE_LABELS_JS)
    assert len(labels) == 32, labels  # the probe window: 32 characters, one label each
    assert min(label["size"] for label in labels) >= 14
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            apart = (
                a["right"] <= b["left"] or b["right"] <= a["left"] or a["bottom"] <= b["top"] or b["bottom"] <= a["top"]
            )
            assert apart, f"probe labels {a} and {b} overlap"


def test_widget_responds_to_the_keyboard_with_the_right_figure(widget_page):
    """A menu gets ArrowDown (ArrowUp on its last option); otherwise the first slider ArrowRight,
    three times. The figure changes, and to exactly what the widget draws for that control value."""
    page, log, name = widget_page
    root = page.locator(".onemask-present")
    plot = root.locator(".js-plotly-plot").first
    if name == "router_animator":
        _assert_probe_labels_readable(plot)
    keys, initial, expected = _expected_after_the_move(name)
    drawn = _plain(json.loads(plot.evaluate(DRAWN_JS)))
    assert _difference(drawn, initial) is None, f"{name}: the page does not draw the gallery's defaults"
    assert _difference(drawn, expected) is not None, f"{name}: the move would not change the drawn data"
    before = plot.evaluate(f"(el) => {FIGURE}")
    selects = root.locator(".widget-dropdown select:not([disabled])")
    if selects.count():
        select = selects.first
        select.focus()
        at_end = select.evaluate("(s) => s.selectedIndex === s.options.length - 1")
        assert keys == ("ArrowUp" if at_end else "ArrowDown"), f"{name}: the page and this test move different controls"
        select.press(keys)
    else:
        assert keys == "ArrowRight", f"{name}: the page has no menu where the widget has one"
        handle = root.locator(".noUi-handle").first
        handle.focus()
        for _ in range(3):
            handle.press("ArrowRight")
    page.wait_for_function(f"([el, old]) => {FIGURE} !== old", arg=[plot.element_handle(), before], timeout=60_000)
    deadline, diff = time.time() + 60, "not compared"  # a slider's intermediate steps redraw first
    while time.time() < deadline:
        diff = _difference(_plain(json.loads(plot.evaluate(DRAWN_JS))), expected)
        if diff is None:
            break
        time.sleep(0.25)
    assert diff is None, f"{name}: after {keys}, {diff}"
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
