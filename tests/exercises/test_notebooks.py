"""The generated exercise notebooks: current, unexecuted, a stub for every solution; each lesson's solutions
pass their checks."""

import importlib
import re
import subprocess
import sys

import nbformat
import pytest
from exercise_helpers import LESSONS, ROOT, load_tool

from lib.course.exercises import ANSWERED_BY


def test_stub_generation_replaces_the_solution_block_at_its_indentation():
    tool = load_tool("make_exercises")
    src = "def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n\ncheck(f)"
    out = tool.stub_source(src, "test")
    assert "return x" not in out and "SOLUTION" not in out
    assert "    raise NotImplementedError" in out and out.endswith("check(f)")
    with pytest.raises(ValueError, match="without"):
        tool.stub_source("### BEGIN SOLUTION\nx = 1\n", "test")


def test_generated_exercise_notebooks_are_current():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_exercises.py"), "--check"], capture_output=True, text=True
    )
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


def test_answer_cells_are_hidden_in_the_exercise_version_and_name_their_exercise(tmp_path):
    tool = load_tool("make_exercises")
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("### Exercise 9.1 · something (easy, ~5 min)"),
            nbformat.v4.new_code_cell(
                "def my_f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n\ncheck_f(my_f)"
            ),
            nbformat.v4.new_code_cell("print(inspect.getsource(f))", metadata={"tags": ["answer"]}),
            nbformat.v4.new_code_cell("print('after')"),
        ]
    )
    path = tmp_path / "09-x.ipynb"
    nbformat.write(nb, path)
    out = nbformat.reads(tool.exercise_notebook(path), as_version=4)
    assert not any("getsource" in c.source for c in out.cells), "the answer is hidden"
    notes = [c for c in out.cells if "Hidden in the exercise version" in c.source]
    assert len(notes) == 1 and notes[0].cell_type == "markdown" and "Exercise 9.1" in notes[0].source
    assert out.cells[-1].source == "print('after')"  # every other cell is kept, in order
    # An answer cell that defines something (a later cell may need it) or comes before any
    # exercise is refused, not silently hidden.
    nb.cells[2].source = "src = inspect.getsource(f)\nprint(src)"
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match="only shows"):
        tool.exercise_notebook(path)
    nb.cells[2].source = "print(inspect.getsource(f))"
    nb.cells = [nb.cells[2]] + nb.cells[:2]
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match="after the exercise"):
        tool.exercise_notebook(path)


GETSOURCE = re.compile(r"inspect\.getsource\(([\w.]+)\)")


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_each_exercise_comes_before_the_cell_that_prints_its_answer(lesson):
    """Predict, then reveal: a lesson cell printing the library code that answers an exercise
    (lib.course.exercises.ANSWERED_BY) comes after that exercise and is tagged `answer`, so the
    exercise notebook hides it."""
    answered = {}
    for check, (module, qualname) in ANSWERED_BY.items():
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)  # a renamed function fails here, not silently
        answered[qualname] = check
    nb = nbformat.read(lesson, as_version=4)
    seen_checks = set()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if "### BEGIN SOLUTION" in cell.source:
            seen_checks.update(re.findall(r"\b(check_\w+)\(", cell.source))
        for name in GETSOURCE.findall(cell.source):
            check = answered.get(name)
            if check is None or check not in "".join(c.source for c in nb.cells):
                continue  # shows code no exercise of this lesson asks for
            assert check in seen_checks, f"cell {i} prints {name}, the answer to {check}, before that exercise"
            assert "answer" in cell.metadata.get("tags", []), f"cell {i} prints {name}: tag it `answer`"
    exercise_nb = (ROOT / "lessons" / "exercises" / lesson.name).read_text()
    for name, check in answered.items():
        if check in "".join(c.source for c in nb.cells):
            assert f"getsource({name})" not in exercise_nb, f"the exercise version shows {name}"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_grading_notebook_is_an_nbgrader_source_with_one_graded_check_per_exercise(lesson):
    """The nbgrader source version (lessons/grading/source/lessonNN/): per exercise, an editable
    solution cell (nbgrader's BEGIN/END SOLUTION markers) then a locked autograded cell worth a
    point that calls the same check; every other cell locked; ids unique; nothing executed."""
    tool = load_tool("make_exercises")
    nb = nbformat.reads(tool.grading_path(lesson).read_text(), as_version=4)
    meta = [c.metadata.get("nbgrader", {}) for c in nb.cells]
    assert all(m.get("schema_version") == 3 for m in meta), "every cell is an nbgrader cell"
    ids = [m["grade_id"] for m in meta]
    assert len(ids) == len(set(ids))
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    solutions = [i for i, m in enumerate(meta) if m["solution"]]
    graded = [i for i, m in enumerate(meta) if m["grade"]]
    n_exercises = len(exercise_cells(nbformat.read(lesson, as_version=4)))
    assert len(solutions) == len(graded) == n_exercises
    for s, g in zip(solutions, graded):
        assert g == s + 1, "each check follows its solution"
        assert "### BEGIN SOLUTION" in nb.cells[s].source and not meta[s]["locked"]
        assert meta[g]["locked"] and meta[g]["points"] == 1
        check = re.search(r"\b(check_\w+)\(", nb.cells[g].source).group(1)
        assert f"{check}(my_" in nb.cells[g].source and "assert grade_report.passed" in nb.cells[g].source
        assert check not in nb.cells[s].source, "the check is in the graded cell only"
    assert all(m["locked"] for i, m in enumerate(meta) if i not in solutions)
    assert "getsource" not in "".join(c.source for c in nb.cells if "answer" in c.metadata.get("tags", []))


def test_graded_cells_pass_the_solution_and_fail_a_wrong_answer():
    """Run lesson 01's solution and graded cells as nbgrader's autograder would: the solutions
    pass every graded cell; a wrong answer makes its graded cell raise (zero points)."""
    import math

    import torch

    import lib.course.exercises.lesson01 as checks

    tool = load_tool("make_exercises")
    lesson = next(p for p in LESSONS if p.name.startswith("01-"))
    nb = nbformat.reads(tool.grading_path(lesson).read_text(), as_version=4)
    pairs = [
        (nb.cells[i], nb.cells[i + 1]) for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("solution")
    ]
    namespace = {"torch": torch, "math": math, **{n: getattr(checks, n) for n in dir(checks) if n.startswith("check_")}}
    for solution, graded in pairs:
        exec(solution.source, namespace)
        exec(graded.source, namespace)  # passes: no AssertionError
    namespace["my_causal_mask"] = lambda T: torch.zeros(T, T)  # no mask at all
    with pytest.raises(AssertionError, match="Exercise 1.1 is not solved yet"):
        exec(pairs[0][1].source, namespace)
