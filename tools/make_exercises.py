"""Generate the exercise version of each lesson: the solutions replaced by stubs.

    python tools/make_exercises.py           # write lessons/exercises/NN-name.ipynb and the
                                             # nbgrader source lessons/grading/source/lessonNN/
    python tools/make_exercises.py --check   # exit 1 if any generated file is missing or stale

In a lesson, an exercise is a code cell whose solution sits between `### BEGIN SOLUTION` and
`### END SOLUTION` lines. The exercise notebook keeps every cell but replaces those lines (markers
included) with a stub at the same indentation, clears all outputs (students run it themselves)
and drops the jupytext pairing, so saving it in JupyterLab never creates a stray .md file.

A build track (lessons/build/NN-build-topic.md, MyST) is written the same way, its exercises
headed `### Step N.k · what (difficulty, ~M min, P points)`; from it come the student's notebook
lessons/build/NN-build-topic.ipynb (stubs, no outputs, no pairing) and its nbgrader source
lessons/grading/source/buildNN/, each step's graded cell worth the heading's points.

Predict, then reveal: an exercise comes before the lesson cell that shows its answer (the
library's source, printed), and that cell carries the tag `answer`. The exercise notebook
replaces it with a note naming the exercise it would give away; the student reads the
library's version in the lesson after solving it. An answer cell may only show (print,
import, display): it defines nothing, so hiding it cannot break a later cell.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
OUT = LESSONS / "exercises"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = ["# YOUR CODE HERE: replace the next line", "raise NotImplementedError"]
ANSWER = "answer"  # the tag of a cell that shows an exercise's answer
GRADING = LESSONS / "grading"  # an nbgrader course directory: source/lessonNN/NN-name.ipynb
POINTS = 1  # an exercise's check is worth one point unless its heading says "N points"
EXERCISE = re.compile(r"^#+ (?:Exercise|Step) (\d+\.\d+)\b", re.M)
HEADING_POINTS = re.compile(r"^#+ (?:Exercise|Step) (\d+\.\d+)\b.*?\b(\d+) points?\b", re.M)
BUILD = LESSONS / "build"  # the build tracks: NN-build-topic.md (solutions in) -> NN-build-topic.ipynb (stubs)


def only_shows(source: str) -> bool:
    """True when a cell's code only imports and calls (print, display): it binds no name
    that a later cell could need."""
    try:
        body = ast.parse("\n".join(l for l in source.split("\n") if not l.lstrip().startswith(("%", "!")))).body
    except SyntaxError:
        return False
    return all(isinstance(node, (ast.Expr, ast.Import, ast.ImportFrom)) for node in body)


def hidden_answer(cell: dict, exercise: str | None, where: str) -> dict:
    """The note that stands in the exercise notebook where the lesson shows an answer."""
    source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    if cell["cell_type"] != "code" or not only_shows(source):
        raise ValueError(
            f"{where}: a cell tagged {ANSWER!r} must be a code cell that only shows "
            "(imports, print, display): hiding it must not break a later cell"
        )
    if exercise is None:
        raise ValueError(f"{where}: a cell tagged {ANSWER!r} must come after the exercise it answers")
    return {
        "cell_type": "markdown",
        "id": cell.get("id", "answer") + "-hidden",
        "metadata": {},
        "source": (
            f"*Hidden in the exercise version: here the lesson shows the library's own answer to "
            f"Exercise {exercise}. Solve the exercise above first, then compare with "
            f"this cell in the lesson itself.*"
        ),
    }


def stub_source(source: str, where: str) -> str:
    """Replace every BEGIN/END SOLUTION block in one cell's source with the stub."""
    out, inside, indent = [], False, ""
    for line in source.split("\n"):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"{where}: nested {BEGIN}")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out.extend(indent + s for s in STUB)
        elif stripped == END:
            if not inside:
                raise ValueError(f"{where}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN} without {END}")
    return "\n".join(out)


def load_notebook(path: Path) -> dict:
    """A lesson's executed .ipynb as JSON, or a build track's MyST .md read by jupytext (cell ids
    made deterministic, so that `--check` compares like with like)."""
    if path.suffix == ".ipynb":
        return json.loads(path.read_text())
    nb = json.loads(jupytext.writes(jupytext.read(path), fmt="ipynb"))
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"{path.stem[:2]}-{i:03d}"
    return nb


def is_build(path: Path) -> bool:
    return path.parent.name == "build"


def exercise_notebook(lesson: Path) -> str:
    nb = load_notebook(lesson)
    n_exercises = 0
    cells = []
    last_exercise = None
    for i, cell in enumerate(nb["cells"]):
        cell = dict(cell)
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown":
            last_exercise = (EXERCISE.findall(source) or [last_exercise])[-1]
        if ANSWER in cell.get("metadata", {}).get("tags", []):
            cells.append(hidden_answer(cell, last_exercise, f"{lesson.name} cell {i}"))
            continue
        if cell["cell_type"] == "code":
            if BEGIN in source:
                n_exercises += 1
                source = stub_source(source, f"{lesson.name} cell {i}")
            cell["outputs"], cell["execution_count"] = [], None
        cell["source"] = source
        cells.append(cell)
    if n_exercises == 0:
        raise ValueError(f"{lesson.name} has no exercise (no {BEGIN} block)")
    if is_build(lesson):
        text = (
            f"> **Build it yourself.** Work in this notebook and keep its name. Each step's cell holds a "
            "stub: replace the `raise NotImplementedError` line with your code and run the cell; the check "
            "under it compares your code with the course's library (and, where there is one, a real model's "
            "weights or Hugging Face's implementation) and names the mistake it sees. Lesson 08's track "
            "assembles your parts of tracks 03, 06 and 07 from their notebooks beside this one. This "
            f"notebook is generated from `{lesson.name}` beside it, which holds the solutions: look there "
            "once you are done."
        )
    else:
        text = (
            f"> **Exercise version** of `lessons/{lesson.name}`, generated by `tools/make_exercises.py`; "
            "do not edit by hand. Each exercise cell holds a stub: replace the `raise NotImplementedError` "
            "line with your code and run the cell; the check under it says what is right or gives a hint. "
            "The solutions are in the lesson itself."
        )
    banner = {"cell_type": "markdown", "id": "exercise-banner", "metadata": {}, "source": text}
    metadata = {k: v for k, v in nb["metadata"].items() if k != "jupytext"}
    out = dict(nb, cells=[banner] + cells, metadata=metadata)
    return json.dumps(out, indent=1, ensure_ascii=False) + "\n"


def split_check(source: str, where: str) -> tuple[str, str]:
    """An exercise cell as (its solution part, its closing `check_...(...)` call)."""
    body = ast.parse(source).body
    last = body[-1] if body else None
    if not (
        isinstance(last, ast.Expr)
        and isinstance(last.value, ast.Call)
        and isinstance(last.value.func, ast.Name)
        and last.value.func.id.startswith("check_")
    ):
        raise ValueError(f"{where}: an exercise cell must end with its check_...(...) call")
    lines = source.split("\n")
    return "\n".join(lines[: last.lineno - 1]).rstrip(), "\n".join(lines[last.lineno - 1 : last.end_lineno])


def _nbgrader(grade_id: str, *, solution=False, grade=False, locked=True, points=POINTS) -> dict:
    meta = {
        "grade": grade,
        "grade_id": grade_id,
        "locked": locked,
        "schema_version": 3,
        "solution": solution,
        "task": False,
    }
    if grade:
        meta["points"] = points
    return {"nbgrader": meta}


def grading_notebook(lesson: Path) -> str:
    """The lesson as an nbgrader source notebook: each exercise's solution in an editable
    solution cell (nbgrader's own BEGIN/END SOLUTION markers, which the lessons use), its check
    in a locked autograded cell worth one point, or the points its heading states (the check's
    report, then an assert on it), every other cell locked, answer cells hidden as in the exercise
    version, outputs cleared."""
    nb = load_notebook(lesson)
    cells, last_exercise, points = [], None, {}
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        where = f"{lesson.name} cell {i}"
        if cell["cell_type"] == "markdown":
            last_exercise = (EXERCISE.findall(source) or [last_exercise])[-1]
            points.update({n: int(p) for n, p in HEADING_POINTS.findall(source)})
        if ANSWER in cell.get("metadata", {}).get("tags", []):
            cell = hidden_answer(cell, last_exercise, where)
            source = cell["source"]
        base = {"cell_type": cell["cell_type"], "id": f"cell-{i:03d}", "source": source}
        if cell["cell_type"] == "code" and BEGIN in source:
            ex = last_exercise.replace(".", "-")
            solution, call = split_check(source, where)
            cells.append(
                dict(
                    base,
                    source=solution,
                    metadata=_nbgrader(f"exercise-{ex}-solution", solution=True, locked=False),
                    outputs=[],
                    execution_count=None,
                )
            )
            kind = "Step" if is_build(lesson) else "Exercise"
            check = (
                f"grade_report = {call}\nprint(grade_report)\n"
                f'assert grade_report.passed, "{kind} {last_exercise} is not solved yet"'
            )
            cells.append(
                {
                    "cell_type": "code",
                    "id": f"cell-{i:03d}-check",
                    "source": check,
                    "metadata": _nbgrader(f"exercise-{ex}-check", grade=True, points=points.get(last_exercise, POINTS)),
                    "outputs": [],
                    "execution_count": None,
                }
            )
            continue
        meta = _nbgrader(f"cell-{i:03d}")
        if cell["cell_type"] == "code":
            cells.append(dict(base, metadata=meta, outputs=[], execution_count=None))
        else:
            cells.append(dict(base, metadata=meta))
    metadata = {k: v for k, v in nb["metadata"].items() if k != "jupytext"}
    return json.dumps(dict(nb, cells=cells, metadata=metadata), indent=1, ensure_ascii=False) + "\n"


def grading_path(lesson: Path) -> Path:
    """nbgrader's source/<assignment>/<notebook>: lessonNN for a lesson, buildNN for its build track."""
    kind = "build" if is_build(lesson) else "lesson"
    return GRADING / "source" / f"{kind}{lesson.name[:2]}" / f"{lesson.stem}.ipynb"


def exercise_path(lesson: Path) -> Path:
    """Where the student's notebook goes: lessons/exercises/NN-name.ipynb for a lesson, and
    lessons/build/NN-build-topic.ipynb beside its source for a build track."""
    return lesson.with_suffix(".ipynb") if is_build(lesson) else OUT / lesson.name


def sources() -> list[Path]:
    """Every notebook with exercises: the executed lessons, then the build tracks' sources."""
    return sorted(LESSONS.glob("[0-9][0-9]-*.ipynb")) + sorted(BUILD.glob("[0-9][0-9]-*.md"))


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for lesson in sources():
        for target, text in (
            (exercise_path(lesson), exercise_notebook(lesson)),
            (grading_path(lesson), grading_notebook(lesson)),
        ):
            if check:
                if not target.exists() or target.read_text() != text:
                    stale.append(str(target.relative_to(ROOT)))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
                print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print("stale or missing exercise notebooks (run `python tools/make_exercises.py`):\n  " + "\n  ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
