"""The project's own invariants: pins agree everywhere, lessons are paired and executed, stored
notebooks are small and deterministic, lessons import lib instead of redefining it."""

import ast
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lib.course import LESSONS

ROOT = Path(__file__).resolve().parent.parent
MDS = sorted((ROOT / "lessons").glob("[0-9][0-9]-*.md"))
NBS = [md.with_suffix(".ipynb") for md in MDS]
PIN = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)")


def pins(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        m = PIN.match(line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def test_pyproject_pins_match_the_lock_and_environment_yml():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = pins(project["dependencies"] + sum(project["optional-dependencies"].values(), []))
    lock = pins((ROOT / "requirements.lock").read_text().splitlines())
    env_lines = [line.strip().lstrip("- ") for line in (ROOT / "environment.yml").read_text().splitlines()]
    env = pins(env_lines)
    assert direct["torch"] == "2.13.0" and lock["torch"] == "2.13.0"  # never another torch
    for name, version in direct.items():
        assert lock.get(name) == version, f"{name}: pyproject {version}, lock {lock.get(name)}"
        assert env.get(name) == version, f"{name}: pyproject {version}, environment.yml {env.get(name)}"
    assert "python=3.11" in (ROOT / "environment.yml").read_text()


def test_installed_versions_are_the_locked_ones():
    from importlib.metadata import version

    lock = pins((ROOT / "requirements.lock").read_text().splitlines())
    for name in ("torch", "numpy", "plotly", "ipywidgets", "jupyterlab", "nbval", "jupytext", "jupyter-book"):
        assert version(name).split("+")[0] == lock[name], name


def test_every_lesson_is_paired_and_in_sync(tmp_path):
    """The .ipynb holds exactly the cells of its MyST source (jupytext --update changes nothing)."""
    assert MDS, "no lessons found"
    jupytext = Path(sys.executable).parent / "jupytext"
    for md, nb in zip(MDS, NBS):
        assert nb.exists(), f"{nb.name} is missing: run make notebooks"
        shutil.copy(md, tmp_path / md.name)
        shutil.copy(nb, tmp_path / nb.name)
        subprocess.run([str(jupytext), "--to", "ipynb", "--update", str(tmp_path / md.name)],
                       check=True, capture_output=True)
        cells = lambda p: [(c["cell_type"], "".join(c["source"])) for c in json.loads(p.read_text())["cells"]]  # noqa: E731
        assert cells(tmp_path / nb.name) == cells(nb), f"{md.name} and {nb.name} differ: run make notebooks"


@pytest.mark.parametrize("nb", NBS, ids=lambda p: p.stem)
def test_stored_notebook_is_executed_small_and_free_of_run_noise(nb):
    raw = nb.read_text()
    data = json.loads(raw)
    assert len(raw.encode()) < 2_000_000
    assert "application/vnd.jupyter.widget-state+json" not in raw and "widgets" not in data["metadata"]
    assert "cdn.plot.ly" not in raw and "plotly.min.js" not in raw and "Plotly.newPlot" in raw  # no embedded plotly.js
    assert not re.search(r"at 0x[0-9a-f]{6,}", raw), "object reprs with addresses change every run"
    code = [c for c in data["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), "every code cell has been executed"
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), "executed top to bottom once"
    for c in code:
        for out in c["outputs"]:
            assert out["output_type"] != "error"
            assert "execution" not in out.get("metadata", {})
    ignored = [c for c in code if "nbval-ignore-output" in c["metadata"].get("tags", [])]
    # hardware, timings, live plots, memory measured on this machine, benchmark runs
    # cpu_kernel_status: whether this machine's C compiler built lesson 06's loop, and its maths library's rounding
    machine_dependent = ("doctor", "perf_counter", "seconds", "LossCurve", "peak_rss", "bench.run(", "cpu_kernel_status")
    assert all(any(word in "".join(c["source"]) for word in machine_dependent) for c in ignored), \
        "only machine-dependent cells (hardware, timings, live progress) may skip nbval's comparison"


@pytest.mark.parametrize("md", MDS, ids=lambda p: p.stem)
def test_lessons_import_lib_instead_of_redefining_it(md):
    lib_names = set()
    for path in (ROOT / "lib").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                lib_names.add(node.name)
    text = md.read_text()
    redefined = sorted(n for n in lib_names if re.search(rf"^\s*(def|class) {n}\b", text, re.M))
    assert not redefined, f"{md.name} redefines lib's {redefined}: import them (or show and assert equal)"
    assert "sys.path" not in text


def test_lib_never_imports_widgets():
    for path in (ROOT / "lib").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "widgets" for n in names), path


def test_readme_and_book_list_every_lesson():
    readme = (ROOT / "README.md").read_text()
    course_map = (ROOT / "book" / "course-map.md").read_text()
    toc = (ROOT / "book" / "_toc.yml").read_text()
    for lesson in LESSONS:
        assert lesson.title in readme and lesson.title in course_map, lesson.title
        assert (f"lessons/{lesson.stem}" in toc) == lesson.landed(), f"book toc vs lesson {lesson.stem}"
    assert "make lab" in readme and "make test" in readme


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
