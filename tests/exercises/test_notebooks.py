"""The generated exercise notebooks: current, unexecuted, a stub for every solution; each lesson's solutions pass their checks."""

import subprocess
import sys

import nbformat
import pytest

from exercise_helpers import ROOT, LESSONS, load_tool


def test_stub_generation_replaces_the_solution_block_at_its_indentation():
    tool = load_tool("make_exercises")
    src = "def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n\ncheck(f)"
    out = tool.stub_source(src, "test")
    assert "return x" not in out and "SOLUTION" not in out
    assert "    raise NotImplementedError" in out and out.endswith("check(f)")
    with pytest.raises(ValueError, match="without"):
        tool.stub_source("### BEGIN SOLUTION\nx = 1\n", "test")


def test_generated_exercise_notebooks_are_current():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_exercises.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def exercise_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code" and "check_" in c.source and "my_" in c.source]


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_holds_solutions_that_pass_their_checks(lesson):
    nb = nbformat.read(lesson, as_version=4)
    cells = exercise_cells(nb)
    assert cells, "every lesson has exercises"
    for cell in cells:
        assert "### BEGIN SOLUTION" in cell.source
        text = "".join(o.get("data", {}).get("text/plain", "") for o in cell.outputs)
        assert text.startswith("✔") and "passed all" in text, text


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_exercise_notebook_ships_unexecuted_with_stubs_for_every_solution(lesson):
    """The exercise version is the lesson with each solution replaced by a stub. It is executed in
    a real JupyterLab by tests/browser/test_lab.py, which checks every unsolved exercise answers
    with a hint and no cell raises (one execution there instead of a second one here)."""
    path = ROOT / "lessons" / "exercises" / lesson.name
    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "exercise notebooks ship unexecuted"
    assert "jupytext" not in nb.metadata, "no pairing: saving it must not create a .md"
    cells = exercise_cells(nb)
    assert cells and len(cells) == len(exercise_cells(nbformat.read(lesson, as_version=4)))
    for cell in cells:
        assert "### BEGIN SOLUTION" not in cell.source and "raise NotImplementedError" in cell.source
