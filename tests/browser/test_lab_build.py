"""The build tracks in a real JupyterLab: each student notebook (lessons/build/NN-build-topic.ipynb)
run unsolved, where every cell runs without an error output and every step answers with the
check's hint; and the same track solved (its source's solutions in, as build/solved/ in the lab's
scratch copy, see conftest.py), where every step's check passes. Lesson 08's track, solved, runs
beside the other solved tracks and assembles the student's parts of 03, 06 and 07 from them."""

from pathlib import Path

import pytest
from lab_js import ALL_CELLS_RUN_JS

ROOT = Path(__file__).resolve().parents[2]
TRACKS = sorted((ROOT / "lessons" / "build").glob("[0-9][0-9]-*.md"))
RUNS = [(f"build/{t.stem}.ipynb", "unsolved") for t in TRACKS] + [
    (f"build/solved/{t.stem}.ipynb", "solved") for t in TRACKS
]

STATE_JS = """() => {
  const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
  const errors = [], steps = [];
  let unrun = 0;
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    if (cell.executionCount === null) unrun++;
    const outputs = cell.outputs.toJSON();
    for (const o of outputs) if (o.output_type === 'error') errors.push(i + ': ' + o.ename + ': ' + o.evalue);
    const src = cell.sharedModel.getSource();
    if (/^check_\\w+\\(/m.test(src) && /(def my_|class My)/.test(src)) {
      steps.push(outputs.map(o => (o.data && o.data['text/plain']) || o.text || '').join(''));
    }
  }
  return {errors, unrun, steps};
}"""


@pytest.mark.parametrize("path, state", RUNS, ids=[f"{p.split('/')[-1][:2]}-{s}" for p, s in RUNS])
def test_build_track_runs_in_lab(path, state, lab_server, page_with_log):
    base, token = lab_server
    page, log = page_with_log(base, viewport=(1400, 1000))
    workspace = path.replace(".ipynb", "").replace("/", "-")
    page.goto(f"{base}/lab/workspaces/{workspace}/tree/{path}?token={token}&reset")
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget "
        "&& window.jupyterapp.shell.currentWidget.context",
        timeout=90_000,
    )
    page.evaluate("""async () => {
      const panel = window.jupyterapp.shell.currentWidget;
      await panel.context.ready;
      await panel.sessionContext.ready;
      window.jupyterapp.commands.execute('notebook:run-all-cells');
    }""")
    page.wait_for_function(ALL_CELLS_RUN_JS, timeout=300_000, polling=1000)
    result = page.evaluate(STATE_JS)
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:shutdown')")
    page.context.close()
    assert result["errors"] == [] and result["unrun"] == 0, result
    assert len(result["steps"]) >= 3, result
    for text in result["steps"]:
        if state == "unsolved":
            assert "✘" in text and "not attempted yet" in text and "hint:" in text, text
        else:
            assert "✔" in text and "passed" in text and "✘" not in text, text
    assert log.page_errors == []
