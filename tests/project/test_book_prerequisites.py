"""The lessons' prerequisites live in one place, book/prerequisites.yml: every lesson of the course
has an entry, each names only earlier lessons, and the course map's column says the same.
(The built lesson pages are checked in tests/browser/test_book.py.)"""

import re
from pathlib import Path

import yaml

from lib.course.lessons import LESSONS

BOOK = Path(__file__).resolve().parents[2] / "book"
PREREQUISITES = yaml.safe_load((BOOK / "prerequisites.yml").read_text())


def test_every_lesson_has_prerequisites_naming_only_earlier_lessons():
    numbers = [f"{lesson.number:02d}" for lesson in LESSONS]
    assert sorted(PREREQUISITES) == numbers
    for number, entries in PREREQUISITES.items():
        for entry in entries:
            assert set(entry) <= {"lesson", "for"}, entry
            assert entry["lesson"] in numbers and entry["lesson"] < number, (number, entry)
            assert entry.get("for"), f"lesson {number}: say what lesson {entry['lesson']} supplies"


def test_every_lesson_in_the_book_has_a_prerequisites_entry():
    toc = (BOOK / "_toc.yml").read_text()
    in_book = re.findall(r"file: lessons/(\d\d)-", toc)
    assert in_book and set(in_book) <= set(PREREQUISITES)


def test_course_map_column_matches_the_prerequisites_data():
    rows = re.findall(r"^\| (\d\d) \|.*\| ([^|]*) \|$", (BOOK / "course-map.md").read_text(), flags=re.M)
    assert [number for number, _ in rows] == sorted(PREREQUISITES)
    for number, cell in rows:
        expected = ", ".join(entry["lesson"] for entry in PREREQUISITES[number]) or "none"
        assert cell.strip() == expected, (
            f"course map, lesson {number}: {cell!r}, book/prerequisites.yml says {expected!r}"
        )
