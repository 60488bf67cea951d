"""What the exercise-check tests share: the repository root, the lessons, a tool loader, a stub."""

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
