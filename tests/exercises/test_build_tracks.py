"""The build tracks (lessons/build/NN-build-topic.md): one per lesson, every step stated
(difficulty, minutes, points), the solutions passing every check when the whole track runs in
a kernel, the student's generated notebook running unsolved without a traceback and answering
every step with a hint, one graded cell per step in the nbgrader source, and every step's check
shown failing on at least three plausible wrong versions (tests/exercises/test_buildNN.py)."""

import importlib
import re

import jupytext
import nbformat
import pytest
from exercise_helpers import ROOT, assert_names_the_mistake, assert_passes_and_refuses_the_stub, load_tool
from nbclient import NotebookClient

from lib.course.lessons import LESSONS

BUILD = ROOT / "lessons" / "build"
TRACKS = sorted(BUILD.glob("[0-9][0-9]-*.md"))
STEP = re.compile(r"^### Step (\d+)\.(\d+) · (.+) \((easy|medium|hard)[^)]*?~(\d+) min, (\d+) points?\)$", re.M)
MIN_WRONG_VERSIONS = 3


def track_modules():
    """(NN, lib.course.exercises.buildNN, tests/exercises/test_buildNN) for every track: the checks, and
    the module that holds their SOLUTIONS and WRONG_VERSIONS."""
    return [
        (
            t.name[:2],
            importlib.import_module(f"lib.course.exercises.build{t.name[:2]}"),
            importlib.import_module(f"test_build{t.name[:2]}"),
        )
        for t in TRACKS
    ]


SOLVED = [
    pytest.param(getattr(checks, name), solution, id=f"{nn}-{name}")
    for nn, checks, tests in track_modules()
    for name, solution in tests.SOLUTIONS.items()
]
WRONG = [
    pytest.param(getattr(checks, name), wrong, words, id=f"{nn}-{name}-{i}-{getattr(wrong, '__name__', 'wrong')}")
    for nn, checks, tests in track_modules()
    for name, versions in tests.WRONG_VERSIONS.items()
    for i, (wrong, words) in enumerate(versions)
]


def steps(track):
    return STEP.findall(track.read_text())


def step_cells(nb):
    return [
        c
        for c in nb.cells
        if c.cell_type == "code"
        and re.search(r"^check_\w+\(", c.source, re.M)
        and ("### BEGIN SOLUTION" in c.source or "raise NotImplementedError" in c.source)
    ]


def outputs_text(cell):
    return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", []))


def errors(nb):
    return [
        f"cell {i}: {o['ename']}: {o['evalue']}"
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]


def test_every_lesson_has_a_build_track():
    assert {t.name[:2] for t in TRACKS} == {f"{lesson.number:02d}" for lesson in LESSONS}
    assert all(t.stem[3:].startswith("build-") for t in TRACKS), "named NN-build-topic.md"


@pytest.mark.parametrize("track", TRACKS, ids=lambda p: p.stem)
def test_each_step_states_difficulty_minutes_and_points_and_holds_one_checked_solution(track):
    found = steps(track)
    assert len(found) >= 3, f"{track.name}: a build track takes the component in at least three steps"
    numbers = [(int(a), int(b)) for a, b, *_ in found]
    assert all(a == int(track.name[:2]) for a, _ in numbers) and [b for _, b in numbers] == list(
        range(1, len(found) + 1)
    )
    for *_, title, _level, minutes, points in found:
        assert 5 <= int(minutes) <= 20, f"{title}: a step takes 5-20 minutes"
        assert int(points) >= 1
    nb = jupytext.read(track)
    cells = step_cells(nb)
    assert len(cells) == len(found), "each step has exactly one solution cell ending with its check"
    module = importlib.import_module(f"lib.course.exercises.build{track.name[:2]}")
    called = {re.search(r"^(check_\w+)\(", c.source, re.M).group(1) for c in cells}
    assert called == set(module.__all__), "the track calls every check of its module, and only those"


@pytest.mark.parametrize("track", TRACKS, ids=lambda p: p.stem)
def test_the_track_test_module_shows_each_check_failing_on_three_wrong_versions(track):
    module = importlib.import_module(f"lib.course.exercises.build{track.name[:2]}")
    tests = importlib.import_module(f"test_build{track.name[:2]}")
    assert set(tests.SOLUTIONS) == set(module.__all__), "a solution per check"
    for name in module.__all__:
        versions = tests.WRONG_VERSIONS.get(name, [])
        assert len(versions) >= MIN_WRONG_VERSIONS, f"{name}: {len(versions)} wrong versions tested"
        assert all(words for _, words in versions), f"{name}: each wrong version's report must name the mistake"


@pytest.mark.parametrize("check, solution", SOLVED)
def test_every_check_passes_its_solution_and_refuses_the_stub(check, solution):
    assert_passes_and_refuses_the_stub(check, solution)


@pytest.mark.parametrize("check, wrong, words", WRONG)
def test_every_check_names_the_mistake_of_each_wrong_version(check, wrong, words):
    assert_names_the_mistake(check, wrong, words)


def solved_notebooks(tmp_path):
    """Every track with its solutions in, as the .ipynb a student who solved it would have saved."""
    for track in TRACKS:
        nbformat.write(jupytext.read(track), tmp_path / f"{track.stem}.ipynb")
    return tmp_path


def execute(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    return nb


@pytest.mark.parametrize("track", TRACKS, ids=lambda p: p.stem)
def test_solved_track_runs_and_passes_every_check(track, tmp_path):
    """The solutions, run top to bottom in a kernel beside the other solved tracks (lesson 08's
    track assembles the student's parts of 03, 06 and 07 from their saved notebooks)."""
    nb = execute(solved_notebooks(tmp_path) / f"{track.stem}.ipynb")
    assert not errors(nb), errors(nb)
    for cell in step_cells(nb):
        text = outputs_text(cell)
        assert "✔" in text and "passed" in text and "✘" not in text, text


@pytest.mark.parametrize("track", TRACKS, ids=lambda p: p.stem)
def test_unsolved_track_runs_without_a_traceback_and_every_step_hints(track, tmp_path):
    for other in TRACKS:  # the other tracks' notebooks unsolved beside it, as a new student has them
        (tmp_path / f"{other.stem}.ipynb").write_text(other.with_suffix(".ipynb").read_text())
    nb = execute(tmp_path / f"{track.stem}.ipynb")
    assert not errors(nb), errors(nb)
    cells = step_cells(nb)
    assert len(cells) == len(steps(track))
    for cell in cells:
        assert "raise NotImplementedError" in cell.source and "### BEGIN SOLUTION" not in cell.source
        text = outputs_text(cell)
        assert "✘" in text and "not attempted yet" in text and "hint:" in text, text


@pytest.mark.parametrize("track", TRACKS, ids=lambda p: p.stem)
def test_student_notebook_ships_unexecuted_and_unpaired(track):
    nb = nbformat.read(track.with_suffix(".ipynb"), as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    assert "jupytext" not in nb.metadata, "no pairing: saving it must not overwrite the source with the solutions"
    assert "Build it yourself" in nb.cells[0].source


@pytest.mark.parametrize("track", TRACKS, ids=lambda p: p.stem)
def test_grading_source_grades_each_step_with_its_points(track):
    tool = load_tool("make_exercises")
    nb = nbformat.reads(tool.grading_path(track).read_text(), as_version=4)
    assert tool.grading_path(track).parent.name == f"build{track.name[:2]}"
    meta = [c.metadata["nbgrader"] for c in nb.cells]
    graded = [m for m in meta if m["grade"]]
    assert [m["points"] for m in graded] == [int(s[-1]) for s in steps(track)]
    assert len([m for m in meta if m["solution"]]) == len(graded)
    assert all(m["locked"] for m in meta if not m["solution"])
