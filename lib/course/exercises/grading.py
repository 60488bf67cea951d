"""Grading the exercise notebooks with nbgrader (a teacher's tool; it needs `pip install nbgrader`).

`tools/make_exercises.py` writes each lesson as an nbgrader source assignment in
`lessons/grading/source/lessonNN/`: the solution in an editable cell, then a locked graded cell
that runs the lesson's check on it (one point per exercise), every other cell locked.
`lessons/grading/nbgrader_config.py` makes that folder an nbgrader course directory and adds
`RestoreMissingCells` to autograding.

Why the extra step: nbgrader overwrites the locked cells a submission still has, but a cell the
student deleted is simply gone. Without its graded cell an exercise scores zero with no word
about why; without the solution cell before it, nbgrader's own `add_missing_cells` stops with a
KeyError for that student; without an import cell every later cell fails. So before nbgrader
checks the cells, each cell of the released assignment that the submission lacks is put back
where it was, as released (a solution cell comes back as the unsolved stub), after a markdown
note naming it, and the autograder's log names the student, the notebook and the cells.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
from nbgrader.converters import Autograde
from nbgrader.coursedir import CourseDirectory
from nbgrader.preprocessors import NbGraderPreprocessor, OverwriteCells

__all__ = ["RestoreMissingCells", "MISSING_NOTE", "grade_id", "sanitize_preprocessors"]

MISSING_NOTE = (
    "*This cell ({grade_id}) was missing from the submission; it was put back from "
    "the released assignment for grading.*"
)


def grade_id(cell) -> str | None:
    """The nbgrader id of a cell, or None for a cell nbgrader does not track."""
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


class RestoreMissingCells(NbGraderPreprocessor):
    """Put back every cell of the released notebook that a submission lacks, in its place."""

    def released_notebook(self, resources) -> Path:
        info = resources["nbgrader"]
        coursedir = CourseDirectory(config=self.config)
        folder = coursedir.format_path(coursedir.release_directory, ".", info["assignment"])
        return Path(folder) / f"{info['notebook']}.ipynb"

    def preprocess(self, nb, resources):
        path = self.released_notebook(resources)
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: the released assignment, which RestoreMissingCells compares each "
                "submission with; run `nbgrader generate_assignment` first"
            )
        released = nbformat.read(path, as_version=nbformat.NO_CONVERT)
        present = {grade_id(c) for c in nb.cells} - {None}
        missing = [grade_id(c) for c in released.cells if grade_id(c) and grade_id(c) not in present]
        if not missing:
            return nb, resources
        info = resources["nbgrader"]
        self.log.warning(
            "%s's %s (%s) lacks %d cell(s), put back as released: %s",
            info["student"],
            info["notebook"],
            info["assignment"],
            len(missing),
            ", ".join(missing),
        )
        cells, after = list(nb.cells), -1  # after: where the previous released cell now sits
        for cell in released.cells:
            name = grade_id(cell)
            if name is None:
                continue
            if name in present:
                after = next(i for i, c in enumerate(cells) if grade_id(c) == name)
                continue
            restored = copy.deepcopy(cell)
            if restored.cell_type == "code":
                restored.outputs, restored.execution_count = [], None
            note = nbformat.v4.new_markdown_cell(MISSING_NOTE.format(grade_id=name))
            cells[after + 1 : after + 1] = [note, restored]
            after += 2
        nb.cells = cells
        return nb, resources


def sanitize_preprocessors() -> list[type]:
    """nbgrader's autograde sanitizing steps with RestoreMissingCells before OverwriteCells."""
    steps = list(Autograde.class_traits()["sanitize_preprocessors"].default())
    if OverwriteCells not in steps:
        raise RuntimeError(
            f"nbgrader's Autograde.sanitize_preprocessors {steps} has no "
            "OverwriteCells to put RestoreMissingCells before: check the version"
        )
    steps.insert(steps.index(OverwriteCells), RestoreMissingCells)
    return steps
