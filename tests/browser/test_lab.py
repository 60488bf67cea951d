"""Lesson 01 in a real JupyterLab: every cell runs without an error, the static figures and the
live mask explorer render, and changing one control changes the plotted data."""

import json

import pytest

LESSON = "01-masking-equation.ipynb"

NOTEBOOK_ERRORS_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cells = panel.content.model.cells;
  const found = [];
  let unrun = 0;
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    if (cell.executionCount === null) unrun++;
    const outs = cell.outputs.toJSON();
    for (const o of outs) if (o.output_type === 'error') found.push(o.ename + ': ' + o.evalue);
  }
  return {errors: found, unrun: unrun, n: cells.length};
}"""

EXPLORER_Z_JS = """(el) => JSON.stringify(el.data[2].z)"""


@pytest.fixture(scope="module")
def lab_page(lab_server, page_with_log):
    base, token = lab_server
    page, log = page_with_log(base, viewport=(1500, 1100))
    page.goto(f"{base}/lab/tree/{LESSON}?token={token}")
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
        timeout=180_000, polling=1000,
    )
    return page, log


def test_all_cells_run_without_error_outputs(lab_page):
    page, _ = lab_page
    result = page.evaluate(NOTEBOOK_ERRORS_JS)
    assert result["n"] > 20
    assert result["unrun"] == 0
    assert result["errors"] == []


def test_static_figures_render_in_lab(lab_page):
    """Each cell with a plotly output draws it (JupyterLab renders only cells in view, so each
    one is scrolled to first)."""
    page, _ = lab_page
    indices = page.evaluate("""() => {
      const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
      const found = [];
      for (let i = 0; i < cells.length; i++) {
        const c = cells.get(i);
        if (c.type === 'code' && c.outputs.toJSON().some(o => o.data && o.data['application/vnd.plotly.v1+json'])) found.push(i);
      }
      return found;
    }""")
    assert len(indices) >= 2
    for i in indices:
        page.evaluate("async (i) => { const nb = window.jupyterapp.shell.currentWidget.content;"
                      " nb.activeCellIndex = i; await nb.scrollToItem(i); }", i)
        page.wait_for_function("(i) => !!window.jupyterapp.shell.currentWidget.content.widgets[i]"
                               ".node.querySelector('.js-plotly-plot .main-svg')", arg=i, timeout=30_000)


def test_live_explorer_renders_and_responds_to_a_control(lab_page):
    page, _ = lab_page
    widget = page.locator(".jp-OutputArea-output .widget-vbox").filter(has=page.locator(".widget-dropdown")).first
    widget.scroll_into_view_if_needed()
    plot = widget.locator(".js-plotly-plot").first
    plot.wait_for(timeout=60_000)
    page.wait_for_function("(el) => el.data && el.data.length >= 3", arg=plot.element_handle(), timeout=30_000)
    before_json = plot.evaluate(EXPLORER_Z_JS)
    select = widget.locator(".widget-dropdown select").first  # the "mask" dropdown
    select.select_option("causal (GPT)")
    page.wait_for_function("([el, old]) => JSON.stringify(el.data[2].z) !== old",
                           arg=[plot.element_handle(), before_json], timeout=30_000)
    before, after = json.loads(before_json), json.loads(plot.evaluate(EXPLORER_Z_JS))
    assert after != before
    T = len(after)
    assert all(after[i][j] == 0 for i in range(T) for j in range(i + 1, T))  # causal: the future is exactly 0
