"""lib.course.lessons's sizing: what a class needs, from the recorded peaks (the teachers' page's table is it),
and the README's lesson table, generated from the lessons and their recorded compute times."""

import json
import re
from pathlib import Path

import pytest

from lib.course.lessons import (
    HEADROOM,
    LESSONS,
    READING_WPM,
    build_minutes,
    class_needs,
    lessons_markdown,
    measured,
    sizing_markdown,
    study_minutes,
)

ROOT = Path(__file__).resolve().parents[2]


def _root_with(tmp_path, runs: dict) -> Path:
    (tmp_path / "lessons").mkdir()
    (tmp_path / "lessons" / "run_times.json").write_text(json.dumps({"lessons": runs}))
    return tmp_path


def _run(seconds, peak):
    return {"seconds": seconds, "peak_rss_mib": peak, "machine": {"cpu": "Test CPU", "cores": 2}}


def test_class_needs_cover_the_largest_peak_with_headroom(tmp_path):
    root = _root_with(tmp_path, {"01-masking-equation": _run(5.0, 700), "03-gpt": _run(60.0, 1300)})
    need = class_needs(30, root)
    assert need["largest_peak_mib"] == 1300
    assert need["per_student_mib"] % 256 == 0
    assert 1300 * HEADROOM <= need["per_student_mib"] < 1300 * HEADROOM + 256
    assert need["total_gib"] == pytest.approx(30 * need["per_student_mib"] / 1024)
    assert need["cores"] == 60 and need["slowest_seconds"] == 60.0
    assert class_needs(1, root)["per_student_mib"] == need["per_student_mib"]  # per student, not per class


def test_class_needs_refuse_bad_input_and_missing_records(tmp_path):
    with pytest.raises(ValueError, match="n_students"):
        class_needs(0)
    with pytest.raises(ValueError, match="n_students"):
        class_needs(2.5)
    with pytest.raises(ValueError, match="make notebooks"):
        class_needs(30, _root_with(tmp_path, {"01-masking-equation": _run(5.0, None)}))
    assert measured(tmp_path / "nowhere") == {}


def test_the_teachers_sizing_table_is_generated_from_the_record():
    page = (ROOT / "book" / "teaching.md").read_text()
    block = re.search(r"<!-- sizing:start[^>]*-->\n(.*?)\n<!-- sizing:end -->", page, re.S)
    assert block, "book/teaching.md has a generated sizing section"
    assert block.group(1) == sizing_markdown(30), (
        "run `make notebooks`, or `python tools/execute_lessons.py --tables` (it rewrites the section)"
    )
    runs = measured()
    assert all(lesson.stem in runs for lesson in LESSONS)
    for lesson in LESSONS:
        assert f"| {lesson.number:02d} {lesson.title} | {runs[lesson.stem]['seconds']:.0f} s |" in block.group(1)


def test_the_readme_lesson_table_is_generated_and_links_what_exists():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- lessons:start[^>]*-->\n(.*?)\n<!-- lessons:end -->", readme, re.S)
    assert block, "README.md has a generated lesson table"
    assert block.group(1) == lessons_markdown(), (
        "run `python tools/execute_lessons.py --tables` after editing a lesson (it rewrites the table)"
    )
    assert readme.index("<!-- lessons:start") < readme.index("## One command"), "the table comes first"
    for target in re.findall(r"\]\((lessons/[^)]+)\)", block.group(1)):
        assert (ROOT / target).is_file(), target


def test_study_time_is_the_words_read_plus_the_exercises_stated_minutes(tmp_path):
    lesson = LESSONS[0]
    (tmp_path / "lessons").mkdir()
    words = " ".join(["word"] * (READING_WPM * 40))  # 40 minutes of reading
    source = words + "\n### Exercise 1.1 · a mask (easy, ~5 min)\n### Exercise 1.2 · more (medium, ~20 min)\n"
    (tmp_path / "lessons" / f"{lesson.stem}.md").write_text(source)
    extra_words = len(source.split()) - READING_WPM * 40  # the headings' own words
    assert extra_words < READING_WPM  # under a minute: 40 + 25 + < 1 minutes -> 75
    assert study_minutes(lesson, tmp_path) == 75
    (tmp_path / "lessons" / f"{lesson.stem}.md").write_text(words)
    assert study_minutes(lesson, tmp_path) == 45  # 40 minutes, rounded up to the quarter hour


def test_build_minutes_sum_the_steps_stated_and_the_table_links_the_track(tmp_path):
    lesson = LESSONS[0]
    assert build_minutes(lesson, tmp_path) is None  # no track
    (tmp_path / "lessons" / "build").mkdir(parents=True)
    (tmp_path / "lessons" / "build" / "01-build-attention.md").write_text(
        "# t\n### Step 1.1 · scores (easy, ~5 min, 1 point)\nx\n### Step 1.2 · softmax (medium, ~15 min, 2 points)\n"
        "### Exercise 1.9 · not a step (easy, ~30 min)\n"
    )
    assert build_minutes(lesson, tmp_path) == 20
    (tmp_path / "lessons" / f"{lesson.stem}.md").write_text("word")
    for other in LESSONS[1:]:
        (tmp_path / "lessons" / f"{other.stem}.md").write_text("word")
    table = lessons_markdown(tmp_path)
    assert "[attention](lessons/build/01-build-attention.ipynb), 20 min" in table
    assert table.count("not yet") == len(LESSONS) - 1
