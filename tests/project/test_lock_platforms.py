"""Each lock resolves, as it is, on every platform and Python the course supports.

For Linux x86-64 and aarch64, macOS arm64 and Windows x86-64, and Python 3.11.0, 3.12 and
3.13, uv resolves requirements.lock (the student's) and requirements-dev.lock (the
contributor's) against PyPI without installing anything. A pin with no wheel or sdist for a
platform (triton without its Linux marker), or a pin whose Requires-Python excludes a Python
(soupsieve 4.1.3 on 3.11.0), fails here with the platform and the Python in the message. The
resolution must also add nothing the lock does not pin, except torch's CUDA runtime
(nvidia-*, cuda-*, which the locks leave to torch's own metadata): a platform-only dependency
(colorama on Windows, appnope on macOS) has to be in the lock with its marker.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ("requirements.lock", "requirements-dev.lock")
PLATFORMS = {
    "Linux x86-64": "x86_64-manylinux_2_28",
    "Linux aarch64": "aarch64-manylinux_2_28",
    "macOS arm64": "aarch64-apple-darwin",  # macOS 14 or newer: torch 2.13.0's wheels are macosx_14_0
    "Windows x86-64": "x86_64-pc-windows-msvc",
}
PYTHONS = ("3.11.0", "3.12", "3.13")
MACOS = "14.0"
LEFT_TO_TORCH = re.compile(r"^(nvidia-|cuda-)")
NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==")


def uv_binary() -> str:
    try:
        from uv import find_uv_bin
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("uv is not installed (it comes with requirements-dev.lock)")
    return find_uv_bin()


def names(text: str) -> set[str]:
    return {re.sub(r"[-_.]+", "-", m.group(1)).lower() for line in text.splitlines() if (m := NAME.match(line))}


def pypi_only_env() -> dict[str, str]:
    """The environment without uv's or pip's settings of this machine: PyPI, uv's default."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))} | {"NO_COLOR": "1"}


def resolve(uv: str, lock: Path, platform: str, python: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        # --python: build with this interpreter instead of searching the machine for a 3.12 (slow)
        [
            uv,
            "pip",
            "compile",
            str(lock),
            "--python",
            sys.executable,
            "--python-platform",
            platform,
            "--python-version",
            python,
            "--no-header",
            "--no-annotate",
            "--quiet",
            "--no-config",
            "--color",
            "never",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        # only PyPI: no index or find-links of this machine's own
        env=pypi_only_env() | {"MACOSX_DEPLOYMENT_TARGET": MACOS},
    )


def failures(locks: list[Path]) -> list[str]:
    uv = uv_binary()
    jobs = [
        (lock, label, platform, python) for lock in locks for label, platform in PLATFORMS.items() for python in PYTHONS
    ]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda job: resolve(uv, job[0], job[2], job[3]), jobs))
    problems = []
    for (lock, label, _, python), result in zip(jobs, results):
        where = f"{lock.name} on {label}, Python {python}"
        if result.returncode != 0:
            problems.append(f"{where} does not resolve:\n{result.stderr.strip()}")
            continue
        extra = sorted(n for n in names(result.stdout) - names(lock.read_text()) if not LEFT_TO_TORCH.match(n))
        if extra:
            problems.append(f"{where} needs packages the lock does not pin: {extra}")
    return problems


@pytest.mark.network
def test_every_lock_resolves_on_every_supported_platform_and_python():
    problems = failures([ROOT / name for name in LOCKS])
    assert not problems, "\n\n".join(problems)


@pytest.mark.network
def test_the_locks_and_environment_yml_are_what_make_lock_writes_from_pyproject(tmp_path):
    """Nobody edited a generated file by hand, and pyproject.toml did not change without a
    re-lock: tools/lock.sh, run on copies, rewrites all five files byte for byte."""
    files = (
        "pyproject.toml",
        "requirements.lock",
        "requirements-dev.lock",
        "environment.yml",
        "binder/requirements.txt",
        "requirements-hub.lock",
        "tools/lock.sh",
        "tools/make_binder.py",
    )
    for name in files:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    result = subprocess.run(
        ["bash", str(tmp_path / "tools" / "lock.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env=pypi_only_env() | {"UV": uv_binary(), "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr
    stale = [name for name in files[1:6] if (tmp_path / name).read_text() != (ROOT / name).read_text()]
    assert not stale, f"{stale} differ from what `make lock` writes from pyproject.toml: run make lock"
