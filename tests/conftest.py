"""Shared test setup: deterministic hypothesis, Triton's interpreter where there is no GPU, and
the cores shared out between xdist's workers."""

import os

import torch
from hypothesis import settings

# Kernels (lesson 05 on) run under Triton's interpreter on CPU-only machines; lib.kernels.runtime
# decides it when lib is first imported, which must come before anything imports triton.
import lib  # noqa: E402, F401

# Under xdist each worker takes its share of the cores, and so do the kernels and tools its tests
# start (OMP_NUM_THREADS): torch's default, a thread per core in every worker, puts four threads on
# two cores under `make test`'s two workers, which made the unit suite take about 1.5 times as long.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)

# Same examples on every run and machine; no per-example deadline on a loaded 2-core box.
settings.register_profile("onemask", derandomize=True, max_examples=40, deadline=None, print_blob=True)
settings.load_profile("onemask")


_PYPI: dict = {}


def _pypi_problem() -> str | None:
    """None when PyPI answers (through any proxy the environment names), else why not; asked once."""
    if "answer" not in _PYPI:
        import urllib.request

        try:
            urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
            _PYPI["answer"] = None
        except OSError as err:
            _PYPI["answer"] = f"PyPI is unreachable from here ({err})"
    return _PYPI["answer"]


def pytest_runtest_setup(item):
    """Tests marked `network` resolve against PyPI: offline they skip, saying so; under CI
    (CI=true), which always has PyPI, an unreachable PyPI fails them instead."""
    import os

    import pytest

    if item.get_closest_marker("network") is None:
        return
    problem = _pypi_problem()
    if problem is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{problem}, under CI, where these tests must run")
        pytest.skip(f"{problem}: this test resolves packages against PyPI")
