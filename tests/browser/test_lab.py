"""Every lesson in a real JupyterLab: all cells run without an error output, the static figures
draw, and every live widget responds to a change of one of its controls.

What runs here is each lesson's exercise version (lessons/exercises/NN-*.ipynb, generated from the
lesson: the same cells, with the exercise solutions replaced by stubs), so one execution checks
both the lesson's cells in a real browser and that unsolved exercises answer with a hint, not a
traceback. The lessons themselves, solutions included, run under nbval (`make test-lessons`),
which also compares their outputs with the stored ones.

Under `make test` the kernels get nbval's numerics and `lib.training_cache`'s directory
(`ONEMASK_LAB_KERNEL_ENV`, see conftest.py): every training run nbval has just made is replayed
here bit for bit (the same trained model, the same loss curve drawn again), so the suite trains
each lesson's models once. Run alone, this file trains them for real.
"""

import pytest

from lib.course import LESSONS

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

# A live widget's plotted data as JSON (null until plotly has drawn it): the first plot inside
# the widget boxes of code cell i, found anew each time it is called.
PLOT_DATA_JS = """(i) => {
  const el = window.jupyterapp.shell.currentWidget.content.widgets[i].node.querySelector('.widget-vbox .js-plotly-plot');
  return el && el.data && el.data.length >= 1 ? JSON.stringify(el.data.map(t => [t.x, t.y, t.z, t.text])) : null;
}"""

SCROLL_TO_JS = """async (i) => { const nb = window.jupyterapp.shell.currentWidget.content;
  nb.activeCellIndex = i; await nb.scrollToItem(i); }"""


@pytest.fixture(scope="module", params=LANDED)
def lab_page(request, lab_server, page_with_log):
    base, token = lab_server
    page, log = page_with_log(base, viewport=(1500, 1100))
    # A workspace of its own per lesson: otherwise JupyterLab restores the previous lesson's tab.
    workspace = request.param.replace(".ipynb", "").replace("/", "-")
    page.goto(f"{base}/lab/workspaces/{workspace}/tree/{request.param}?token={token}&reset")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget "
                           "&& window.jupyterapp.shell.currentWidget.context", timeout=90_000)
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
        """() => {
          const panel = window.jupyterapp.shell.currentWidget;
          const status = panel.sessionContext.session?.kernel?.status;
          const cells = panel.content.model.cells;
          for (let i = 0; i < cells.length; i++) {
            const c = cells.get(i);
            if (c.type === 'code' && c.executionCount === null) return false;
          }
          return status === 'idle';
        }""",
        timeout=600_000, polling=1000,  # a lesson is budgeted at 90 s: room for a slow or busy runner
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
        page.wait_for_function("(i) => !!window.jupyterapp.shell.currentWidget.content.widgets[i]"
                               ".node.querySelector('.js-plotly-plot .main-svg')", arg=i, timeout=30_000)


def test_every_live_widget_responds_to_a_control(lab_page):
    """For each live widget (controls above a plotly FigureWidget): change one control and see the
    plotted data change. A dropdown gets another option; otherwise the last slider moves right."""
    page, _ = lab_page
    indices = page.evaluate(CELL_STATE_JS)["widgets"]
    checked = 0
    for i in indices:
        page.evaluate(SCROLL_TO_JS, i)
        page.evaluate("(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
                      ".setAttribute('data-onemask-cell', String(i))", i)
        cell = page.locator(f"[data-onemask-cell='{i}']")
        page.wait_for_function("(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
                               ".querySelector('.js-plotly-plot') !== null", arg=i, timeout=60_000)  # widgets render asynchronously
        page.evaluate("(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
                      ".setAttribute('data-onemask-cell', String(i))", i)
        box = cell.locator(".widget-vbox").filter(has=page.locator(".js-plotly-plot")).first
        if box.count() == 0:
            continue  # a widget without a plot (e.g. a loss curve's own cell is checked elsewhere)
        plot = box.locator(".js-plotly-plot").first
        plot.wait_for(timeout=60_000)
        # The plot is looked up afresh on every poll (PLOT_DATA_JS), never through a handle: a
        # widget may redraw into a new element after it first appears, most often on a busy runner.
        page.wait_for_function(f"(i) => ({PLOT_DATA_JS})(i) !== null", arg=i, timeout=60_000)
        before = page.evaluate(PLOT_DATA_JS, i)
        selects = box.locator(".widget-dropdown select")
        if selects.count():
            select = selects.first
            options = select.locator("option").all_inner_texts()
            current = select.evaluate("(s) => s.options[s.selectedIndex].text")
            select.select_option(next(o for o in options if o != current))
        else:
            handle = box.locator(".noUi-handle").last
            handle.focus()
            for _ in range(3):
                handle.press("ArrowRight")
        page.wait_for_function(f"([i, old]) => ({PLOT_DATA_JS})(i) !== old", arg=[i, before], timeout=60_000)
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
        if (c.type === 'code' && c.outputs.toJSON().some(o => o.data && String(o.data['text/html'] || '').includes('bertviz-'))) found.push(i);
      }
      return found;
    }""")
    if lesson.startswith("exercises/02-"):
        assert len(indices) == 2  # head view and model view
    for i in indices:
        page.evaluate(SCROLL_TO_JS, i)
        page.wait_for_function("(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node"
                               ".querySelectorAll('svg text').length > 5", arg=i, timeout=30_000)
