"""Where Triton is not installed (it has wheels for Linux only), the kernel lessons run and say so."""

import json
import os
from pathlib import Path

import pytest

from lib.kernels.no_triton import NO_TRITON, tl, triton

ROOT = Path(__file__).resolve().parents[2]

# A sitecustomize that makes `import triton` fail, as on macOS or Windows.
BLOCK_TRITON = """
import importlib.abc, sys
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoTriton())
"""


def test_a_kernel_defined_with_the_stand_ins_refuses_to_launch_with_the_message():
    @triton.jit
    def kernel(X, OUT, n_cols, BLOCK: tl.constexpr):
        tl.store(OUT, tl.load(X))

    with pytest.raises(RuntimeError, match="wheels for Linux only"):
        kernel[(4,)](None, None, 3, BLOCK=4)
    with pytest.raises(RuntimeError, match="WSL2"):
        triton.next_power_of_2(5)
    assert kernel.fn.__name__ == "kernel"


def test_the_triton_exercise_check_says_what_is_missing(monkeypatch):
    from lib.course.exercises.lesson05 import check_row_logsumexp
    from lib.kernels import runtime

    monkeypatch.setattr(runtime, "kernel_mode", lambda: "unavailable")
    report = check_row_logsumexp(lambda x: x.logsumexp(dim=1))
    assert not report.passed and report.problem == NO_TRITON and "WSL2" in report.hint


def test_lesson_05_runs_without_triton_and_says_so(tmp_path):
    """Execute the attention-kernels lesson in a kernel where `import triton` fails: no cell errors,
    and the cells that would run our kernel print NO_TRITON."""
    nbclient = pytest.importorskip("nbclient")
    import nbformat

    (tmp_path / "sitecustomize.py").write_text(BLOCK_TRITON)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    nb = nbformat.read(ROOT / "lessons" / "05-attention-kernels.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    old = dict(os.environ)
    os.environ.update(env)
    try:
        nbclient.NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "lessons")}}
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = json.dumps([o.get("text", "") for o in outputs])
    assert text.count("wheels for Linux only") >= 3, "the kernel cells say why they did not run"
