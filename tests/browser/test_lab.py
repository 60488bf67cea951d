"""Every lesson in a real JupyterLab: all cells run without an error output, the static figures
draw, and every live widget, when one of its controls moves, draws exactly what the kernel's
own widget says it must draw for the new value.

What runs here is each lesson's exercise version (lessons/exercises/NN-*.ipynb, generated from the
lesson: the same cells, with the exercise solutions replaced by stubs), so one execution checks
both the lesson's cells in a real browser and that unsolved exercises answer with a hint, not a
traceback. The lessons themselves, solutions included, run under nbval (`make test-lessons`),
which also compares their outputs with the stored ones.

Under `make test` the kernels get nbval's numerics and `lib.course.training_cache`'s directory
(`ONEMASK_LAB_KERNEL_ENV`, see conftest.py): every training run nbval has just made is replayed
here bit for bit (the same trained model, the same loss curve drawn again), so the suite trains
each lesson's models once. Run alone, this file trains them for real.
"""

import json
import time

import pytest
from drawn import DRAWN_JS, difference, drawn_data_of_json, plain
from lab_js import ALL_CELLS_RUN_JS

from lib.course.lessons import LESSONS

LANDED = [f"exercises/{lesson.stem}.ipynb" for lesson in LESSONS if lesson.landed()]

CELL_STATE_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cells = panel.content.model.cells;
  const errors = [], plotly = [], html = [], exercises = [];
  let unrun = 0;
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    if (cell.executionCount === null) unrun++;
    for (const o of cell.outputs.toJSON()) {
      if (o.output_type === 'error') errors.push(o.ename + ': ' + o.evalue);
      if (o.data && o.data['application/vnd.plotly.v1+json']) plotly.push(i);
      if (o.data && o.data['application/vnd.jupyter.widget-view+json']) html.push(i);
    }
    const src = cell.sharedModel.getSource();
    if (src.includes('check_') && src.includes('def my_')) {
      exercises.push(cell.outputs.toJSON().map(o => (o.data && o.data['text/plain']) || o.text || '').join(''));
    }
  }
  return {errors, unrun, n: cells.length, plotly, widgets: html, exercises};
}"""

# Runs code in the notebook's own kernel (not in a cell) and returns what it printed, or the error.
KERNEL_JS = """async (code) => {
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  const future = kernel.requestExecute({code, silent: false, store_history: false});
  let out = '', err = '';
  future.onIOPub = (msg) => {
    if (msg.header.msg_type === 'stream') out += msg.content.text;
    if (msg.header.msg_type === 'error') err += msg.content.ename + ': ' + msg.content.evalue;
  };
  await future.done;
  return {out, err};
}"""

# The ipywidgets model id of the widget shown by code cell i (null when it shows none).
MODEL_ID_JS = """(i) => {
  const outputs = window.jupyterapp.shell.currentWidget.content.model.cells.get(i).outputs.toJSON();
  const view = outputs.map(o => o.data && o.data['application/vnd.jupyter.widget-view+json']).find(v => v);
  return view ? view.model_id : null;
}"""

# Kernel side: the live view behind the widget (widgets._base.live_view_of), the move this test
# makes (the first enabled menu to its next option, its previous one on the last; otherwise the
# first slider three steps right, left where that passes its end), and the figure the view says
# it draws after that move (`figure_for`, computed afresh from the move's known value).
PLAN_PY = """
def _onemask_plan(model_id):
    import json
    import ipywidgets as W
    from plotly.utils import PlotlyJSONEncoder
    from widgets._base import live_view_of
    view = live_view_of(model_id)
    if view is None:
        return print(json.dumps(None))
    def walk(w):
        yield w
        for child in getattr(w, "children", ()):
            yield from walk(child)
    parts = list(walk(view.widget))
    names = {id(c): n for n, c in view.controls.items()}
    menus = [w for w in parts if isinstance(w, W.Dropdown) and not w.disabled]
    sliders = [w for w in parts if isinstance(w, (W.IntSlider, W.FloatSlider))]
    if menus:
        menu = menus[0]
        index = menu.index - 1 if menu.index == len(menu.options) - 1 else menu.index + 1
        label, value = menu.options[index] if isinstance(menu.options[index], tuple) else (menu.options[index],) * 2
        plan = {"control": "menu", "label": str(label), "name": names[id(menu)]}
    else:
        slider = sliders[0]
        right = slider.value + 3 * slider.step <= slider.max
        value = slider.value + (3 if right else -3) * slider.step
        value = value if isinstance(slider, W.IntSlider) else round(value, 10)
        plan = {"control": "slider", "key": "ArrowRight" if right else "ArrowLeft", "name": names[id(slider)]}
    plan["value"] = value
    plan["figure"] = view.figure_for(plan["name"], value).to_plotly_json()
    print(json.dumps(plan, cls=PlotlyJSONEncoder))
"""


SCROLL_TO_JS = """async (i) => { const nb = window.jupyterapp.shell.currentWidget.content;
  nb.activeCellIndex = i; await nb.scrollToItem(i); }"""


@pytest.fixture(scope="module", params=LANDED)
def lab_page(request, lab_server, page_with_log):
    base, token = lab_server
    page, log = page_with_log(base, viewport=(1500, 1100))
    # A workspace of its own per lesson: otherwise JupyterLab restores the previous lesson's tab.
    workspace = request.param.replace(".ipynb", "").replace("/", "-")
    page.goto(f"{base}/lab/workspaces/{workspace}/tree/{request.param}?token={token}&reset")
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget "
        "&& window.jupyterapp.shell.currentWidget.context",
        timeout=90_000,
    )
    # Clear the stored outputs (so execution counts say what ran now), then run all cells; the
    # command's promise is not awaited, it can outlive the cells.
    n_cells = page.evaluate("""async () => {
      const panel = window.jupyterapp.shell.currentWidget;
      await panel.context.ready;
      await panel.sessionContext.ready;
      await window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs');
      window.jupyterapp.commands.execute('notebook:run-all-cells');
      return panel.content.model.cells.length;
    }""")
    assert n_cells > 20
    # Done when the kernel is idle again and every code cell has an execution count.
    page.wait_for_function(
        ALL_CELLS_RUN_JS,
        timeout=600_000,
        polling=1000,  # a lesson is budgeted at 90 s: room for a slow or busy runner
    )
    yield page, request.param
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:shutdown')")
    page.context.close()


def test_all_cells_run_without_error_outputs(lab_page):
    page, _ = lab_page
    state = page.evaluate(CELL_STATE_JS)
    assert state["unrun"] == 0
    assert state["errors"] == []


def test_unsolved_exercises_answer_with_a_hint(lab_page):
    page, _ = lab_page
    texts = page.evaluate(CELL_STATE_JS)["exercises"]
    assert texts, "every lesson has exercises"
    for text in texts:
        text = "".join(text) if isinstance(text, list) else text
        assert "not passed yet" in text and "not attempted yet" in text and "hint:" in text, text


def test_static_figures_render_in_lab(lab_page):
    """Each cell with a plotly output draws it (JupyterLab renders only cells in view, so each
    one is scrolled to first)."""
    page, _ = lab_page
    indices = page.evaluate(CELL_STATE_JS)["plotly"]
    assert len(indices) >= 2
    for i in indices:
        page.evaluate(SCROLL_TO_JS, i)
        page.wait_for_function(
            "(i) => !!window.jupyterapp.shell.currentWidget.content.widgets[i]"
            ".node.querySelector('.js-plotly-plot .main-svg')",
            arg=i,
            timeout=30_000,
        )


def _kernel(page, code: str) -> str:
    result = page.evaluate(KERNEL_JS, code)
    assert not result["err"], result["err"]
    return result["out"]


def test_every_live_widget_draws_the_right_figure_after_a_move(lab_page):
    """For each live widget (controls above a plotly FigureWidget): ask the kernel which control
    to move, to what value, and what the widget must then draw (its `figure_for` that value);
    move the control in the page as a student would (a menu's option, a slider's arrow keys);
    the page must then draw exactly that figure, and must not have drawn it before."""
    page, _ = lab_page
    _kernel(page, PLAN_PY)
    checked = 0
    for i in page.evaluate(CELL_STATE_JS)["widgets"]:
        page.evaluate(SCROLL_TO_JS, i)
        page.evaluate(
            "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
            ".setAttribute('data-onemask-cell', String(i))",
            i,
        )
        cell = page.locator(f"[data-onemask-cell='{i}']")
        # widgets render asynchronously
        page.wait_for_function(
            "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
            ".querySelector('.js-plotly-plot') !== null",
            arg=i,
            timeout=60_000,
        )
        controls = cell.locator(".widget-dropdown select:not([disabled]), .noUi-handle")
        plan = json.loads(_kernel(page, f"_onemask_plan({page.evaluate(MODEL_ID_JS, i)!r})"))
        if plan is None:
            assert controls.count() == 0, f"cell {i}: a widget with controls but no figure_for"
            continue  # a plot without controls (a loss curve)
        expected = drawn_data_of_json(plan["figure"])
        plot = cell.locator(".js-plotly-plot").first
        drawn = lambda: plain(json.loads(plot.evaluate(DRAWN_JS)))  # noqa: E731 (looked up afresh each time)
        assert difference(drawn(), expected) is not None, f"cell {i}: the move would not change the figure"
        if plan["control"] == "menu":
            cell.locator(".widget-dropdown select:not([disabled])").first.select_option(label=plan["label"])
        else:
            handle = cell.locator(".noUi-handle").first
            handle.focus()
            for _ in range(3):
                handle.press(plan["key"])
        deadline, diff = time.time() + 60, "not compared"  # a slider's intermediate steps redraw first
        while time.time() < deadline:
            diff = difference(drawn(), expected)
            if diff is None:
                break
            time.sleep(0.25)
        assert diff is None, f"cell {i}: after moving {plan['name']} to {plan['value']!r}: {diff}"
        checked += 1
    assert checked >= 1, "every lesson has at least one live widget"


def test_bertviz_views_render_in_lab(lab_page):
    """Cells whose output is a bertviz view draw their SVG (scripts run once the cell has run)."""
    page, lesson = lab_page
    indices = page.evaluate("""() => {
      const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
      const found = [];
      for (let i = 0; i < cells.length; i++) {
        const c = cells.get(i);
        const html = o => String(o.data && o.data['text/html'] || '');
        if (c.type === 'code' && c.outputs.toJSON().some(o => html(o).includes('bertviz-'))) found.push(i);
      }
      return found;
    }""")
    if lesson.startswith("exercises/02-"):
        assert len(indices) == 2  # head view and model view
    for i in indices:
        page.evaluate(SCROLL_TO_JS, i)
        page.wait_for_function(
            "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
            ".querySelectorAll('svg text').length > 5",
            arg=i,
            timeout=30_000,
        )
