"""What the exercise-check tests share: the repository root, the lessons, a tool loader, a stub, and
the two assertions every check's tests make."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]-*.ipynb"))


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stub(*args):
    """An unsolved exercise: what the learner's function does before they write it."""
    raise NotImplementedError


def assert_passes_and_refuses_the_stub(check, solution):
    """`check` passes `solution` and reports the stub as not attempted (a hint, not a traceback)."""
    report = check(solution)
    assert report.passed, report
    report = check(stub)
    assert not report.passed and report.problem == "not attempted yet", report
    assert "NotImplementedError" in repr(report)


def assert_names_the_mistake(check, wrong, words):
    """`check` fails `wrong` with `words` in its problem or hint."""
    report = check(wrong)
    assert not report.passed and words in f"{report.problem} {report.hint}", report
