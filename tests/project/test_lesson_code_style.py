"""Lesson code reads on a book page and a projector: no line wider than the content column,
one timer for the whole course, claim bookkeeping out of the way."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NBS = sorted((ROOT / "lessons").glob("[0-9][0-9]-*.ipynb"))
BUILD_NBS = sorted((ROOT / "lessons" / "build").glob("[0-9][0-9]-*.ipynb"))  # the build tracks, as students get them
MAX_LINE = 88  # black's width; wider lines scroll sideways in the book's content column


def code_cells(nb_path: Path) -> list[dict]:
    cells = json.loads(nb_path.read_text())["cells"]
    return [c for c in cells if c["cell_type"] == "code"]


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


@pytest.mark.parametrize("nb", NBS + BUILD_NBS, ids=lambda p: p.stem)
def test_no_lesson_code_line_is_wider_than_the_page(nb):
    wide = [
        (i, line) for i, cell in enumerate(code_cells(nb)) for line in source(cell).split("\n") if len(line) > MAX_LINE
    ]
    assert not wide, (
        f"{nb.name}: {len(wide)} code lines over {MAX_LINE} characters, the first "
        f"in code cell {wide[0][0]}: {wide[0][1]!r}"
    )


@pytest.mark.parametrize("nb", NBS, ids=lambda p: p.stem)
def test_lessons_time_with_the_course_timer(nb):
    """lib.course.bench.timer (stopwatch, seconds, side_by_side) is the one timer; no lesson rolls its own."""
    hand_timed = [
        i for i, cell in enumerate(code_cells(nb)) if re.search(r"\bperf_counter\b|\btime\.time\(\)", source(cell))
    ]
    assert not hand_timed, f"{nb.name}: code cells {hand_timed} time by hand; use lib.course.bench.timer"


@pytest.mark.parametrize("nb", NBS, ids=lambda p: p.stem)
def test_claim_bookkeeping_is_out_of_sight(nb):
    """A cell that registers a claim is collapsed in JupyterLab and shows only its verdict line
    in the book; the measurement it records stays in view, in the cells before it."""
    shown = [
        i
        for i, cell in enumerate(code_cells(nb))
        if re.search(r"\bclaim\(", source(cell))
        and not (
            "remove-input" in cell["metadata"].get("tags", [])
            and cell["metadata"].get("jupyter", {}).get("source_hidden")
        )
    ]
    assert not shown, (
        f"{nb.name}: code cells {shown} register a claim in view; "
        "give them `remove-input` and `jupyter: source_hidden: true`"
    )
