"""JavaScript the JupyterLab tests share."""

# True once every code cell of the open notebook has an execution count and its kernel is idle:
# "Run All" has finished (its command's promise can resolve before the cells do).
ALL_CELLS_RUN_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cells = panel.content.model.cells;
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type === 'code' && c.executionCount === null) return false;
  }
  return panel.sessionContext.session?.kernel?.status === 'idle';
}"""
