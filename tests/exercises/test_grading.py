"""nbgrader grades the generated assignments (lessons/grading/): the real `nbgrader generate_assignment`
and `nbgrader autograde`, in a copy of the course directory, on submissions made from the released
notebook the way a student makes them: solved, partly solved (the other exercises untouched), and with
cells deleted."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from exercise_helpers import ROOT

pytest.importorskip("nbgrader")  # in the dev lock; a student's install has no grader

from nbgrader.api import Gradebook  # noqa: E402

from lib.course.exercises.grading import MISSING_NOTE, grade_id  # noqa: E402

GRADING = ROOT / "lessons" / "grading"


def notebook_name(assignment: str) -> str:
    return next((GRADING / "source" / assignment).glob("*.ipynb")).stem


def course(tmp_path: Path, assignment: str) -> Path:
    """A course directory in tmp_path with the course's config and one generated source
    assignment, released with nbgrader (so the gradebook knows its cells)."""
    root = tmp_path / "course"
    (root / "source").mkdir(parents=True)
    shutil.copy(GRADING / "nbgrader_config.py", root)
    shutil.copytree(GRADING / "source" / assignment, root / "source" / assignment)
    nbgrader(root, "generate_assignment", assignment)
    return root


def nbgrader(root: Path, *args: str) -> str:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",  # two test workers share two cores
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ERROR" not in log, log
    return log


def solutions(assignment: str) -> dict[str, str]:
    """grade id -> the lesson's solution, for each solution cell of the source assignment."""
    nb = nbformat.read(GRADING / "source" / assignment / f"{notebook_name(assignment)}.ipynb", 4)
    return {grade_id(c): c.source for c in nb.cells if c.metadata["nbgrader"]["solution"]}


def submit(root: Path, assignment: str, student: str, solved=(), deleted=()) -> None:
    """The released notebook as a student hands it in: the solution cells named in `solved`
    written (the lesson's solution), the cells named in `deleted` removed, the rest untouched."""
    name = notebook_name(assignment)
    nb = nbformat.read(root / "release" / assignment / f"{name}.ipynb", 4)
    answers = solutions(assignment)
    assert set(solved) <= set(answers) and set(deleted) <= {grade_id(c) for c in nb.cells}
    for cell in nb.cells:
        if grade_id(cell) in solved:
            cell.source = answers[grade_id(cell)]
    nb.cells = [c for c in nb.cells if grade_id(c) not in deleted]
    folder = root / "submitted" / student / assignment
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / f"{name}.ipynb")


def scores(root: Path, assignment: str, student: str) -> dict[str, float]:
    """grade id -> points the autograder gave, for each graded cell."""
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        sub = gb.find_submission_notebook(notebook_name(assignment), assignment, student)
        return {g.name: g.score for g in sub.grades}


def check_of(solution_id: str) -> str:
    return solution_id.replace("-solution", "-check")


def test_autograde_gives_full_and_partial_marks_and_puts_back_deleted_cells(tmp_path):
    """One autograde of lesson01 for four students. cy solved every other exercise: a point for
    each solved one, none for the rest (untouched stubs run and score zero). dee, eli and fay
    solved all and deleted cells: a deleted graded cell is put back and run (the student keeps
    the point); a deleted exercise (solution and check) scores zero while the rest is graded; a
    deleted locked cell (the imports) is put back too. Each restored cell follows a note, and the
    log names it."""
    assignment = "lesson01"
    root = course(tmp_path, assignment)
    ids = sorted(solutions(assignment))
    assert len(ids) >= 2
    partial = ids[::2]  # the first, third ... exercises solved
    submit(root, assignment, "cy", solved=partial)
    first_code = next(
        grade_id(c)
        for c in nbformat.read(root / "release" / assignment / f"{notebook_name(assignment)}.ipynb", 4).cells
        if c.cell_type == "code"
    )
    lost = {"dee": {check_of(ids[1])}, "eli": {ids[1], check_of(ids[1])}, "fay": {first_code}}
    for student, deleted in lost.items():
        submit(root, assignment, student, solved=ids, deleted=deleted)
    log = nbgrader(root, "autograde", assignment)
    graded = {check_of(i) for i in ids}
    assert scores(root, assignment, "cy") == {g: float(g in {check_of(i) for i in partial}) for g in graded}
    assert scores(root, assignment, "dee") == {g: 1.0 for g in graded}
    assert scores(root, assignment, "eli") == {g: float(g != check_of(ids[1])) for g in graded}
    assert scores(root, assignment, "fay") == {g: 1.0 for g in graded}
    released = [
        grade_id(c)
        for c in nbformat.read(root / "release" / assignment / f"{notebook_name(assignment)}.ipynb", 4).cells
    ]
    for student, deleted in lost.items():
        line = next(x for x in log.splitlines() if f"{student}'s" in x)
        assert "put back as released" in line and all(d in line for d in deleted), line
        nb = nbformat.read(root / "autograded" / student / assignment / f"{notebook_name(assignment)}.ipynb", 4)
        order = [grade_id(c) for c in nb.cells]
        assert [i for i in order if i] == released  # every cell back, in its place
        for d in deleted:
            at = order.index(d)
            assert nb.cells[at - 1].source == MISSING_NOTE.format(grade_id=d)
    eli = nbformat.read(root / "autograded" / "eli" / assignment / f"{notebook_name(assignment)}.ipynb", 4)
    stub = next(c for c in eli.cells if grade_id(c) == ids[1])
    assert "raise NotImplementedError" in stub.source  # the exercise comes back unsolved
    check = next(c for c in eli.cells if grade_id(c) == check_of(ids[1]))
    assert any("is not solved yet" in o.get("evalue", "") for o in check.outputs), check.outputs


def test_autograde_gives_full_and_partial_marks_where_kernels_run(tmp_path):
    """lesson05, whose exercises run the Triton kernels (in the interpreter on a CPU): ada solved
    all and gets every point; cy solved every other exercise and gets exactly those."""
    assignment = "lesson05"
    root = course(tmp_path, assignment)
    ids = sorted(solutions(assignment))
    assert len(ids) >= 2
    partial = ids[::2]
    submit(root, assignment, "ada", solved=ids)
    submit(root, assignment, "cy", solved=partial)
    nbgrader(root, "autograde", assignment)
    graded = {check_of(i) for i in ids}
    assert scores(root, assignment, "ada") == {g: 1.0 for g in graded}
    assert scores(root, assignment, "cy") == {g: float(g in {check_of(i) for i in partial}) for g in graded}


def test_autograde_grades_a_build_track_with_each_steps_points(tmp_path):
    """A build track's nbgrader source (buildNN): each step's graded cell is worth the points its
    heading states; a solved track gets them all, and a student who wrote only the first two steps
    (which use no earlier step) gets exactly those two steps' points and none of the others."""
    assignment = "build01"
    root = course(tmp_path, assignment)
    nb = nbformat.read(GRADING / "source" / assignment / f"{notebook_name(assignment)}.ipynb", 4)
    points = {grade_id(c): c.metadata["nbgrader"]["points"] for c in nb.cells if c.metadata["nbgrader"]["grade"]}
    ids = [grade_id(c) for c in nb.cells if c.metadata["nbgrader"]["solution"]]  # in step order
    assert len(ids) >= 3 and len(set(points.values())) > 1, "steps carry different points"
    submit(root, assignment, "ada", solved=ids)
    submit(root, assignment, "cy", solved=ids[:2])
    nbgrader(root, "autograde", assignment)
    assert scores(root, assignment, "ada") == {g: float(p) for g, p in points.items()}
    first_two = {check_of(i) for i in ids[:2]}
    assert scores(root, assignment, "cy") == {g: float(p) * (g in first_two) for g, p in points.items()}
