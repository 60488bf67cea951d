"""lib.course's sizing: what a class needs, from the recorded peaks; the README's table is it."""

import json
import re
from pathlib import Path

import pytest

from lib.course import HEADROOM, LESSONS, class_needs, measured, sizing_markdown

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


def test_the_readme_sizing_table_is_generated_from_the_record():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- sizing:start[^>]*-->\n(.*?)\n<!-- sizing:end -->", readme, re.S)
    assert block, "README.md has a generated sizing section"
    assert block.group(1) == sizing_markdown(30), "run `make notebooks` (it rewrites the section)"
    runs = measured()
    assert all(lesson.stem in runs for lesson in LESSONS)
    for lesson in LESSONS:
        assert f"| {lesson.number:02d} {lesson.title} | {runs[lesson.stem]['seconds']:.0f} s |" in block.group(1)
