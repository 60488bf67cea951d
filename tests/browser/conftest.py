"""Real Chromium, driven by Playwright, for the JupyterLab and book tests.

The browser is Debian's chromium where it exists (as `make test`'s setup installs it when run as
root), `$ONEMASK_CHROMIUM` if set, else Playwright's own build. Missing all three is a failure,
not a skip: `make test` never skips the browser tests silently.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.browser)


def chromium_path() -> str | None:
    for candidate in (os.environ.get("ONEMASK_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    return None  # Playwright's own build (installed by `playwright install chromium`)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(argv, env, cwd, log_path, ready_url: str, what: str, timeout_s: float):
    """Run a server process (its output to log_path) until ready_url answers; stop it afterwards."""
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(ready_url, timeout=2)
            break
        except Exception:
            if proc.poll() is not None:
                pytest.fail(f"{what} exited: {Path(log_path).read_text()[-3000:]}")
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"{what} did not start within {timeout_s} s")
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def server():
    """`serve` for test modules: `with server(argv, env, cwd, log_path, ready_url, what, timeout_s):`."""
    return serve


@pytest.fixture(scope="session")
def unused_port():
    """`free_port` for test modules."""
    return free_port


@pytest.fixture(scope="session")
def page_log():
    """`PageLog` for test modules that open pages in a browser context of their own."""
    return PageLog


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=ARGS)
        yield b
        b.close()


class PageLog:
    """Everything a page did that a test may want to assert on."""

    def __init__(self, page, origin: str):
        self.origin, self.console_errors, self.page_errors, self.requests, self.failed = origin, [], [], [], []
        page.on("console", lambda m: m.type == "error" and self.console_errors.append(m.text))
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("response", lambda r: r.status >= 400 and self.failed.append(f"{r.status} {r.url}"))

    def outside_requests(self) -> list[str]:
        local = (
            self.origin,
            self.origin.replace("http", "ws", 1),
            "data:",
            "blob:",
            "about:",
        )  # ws: the site's own kernels
        return [u for u in self.requests if not u.startswith(local)]


@pytest.fixture(scope="session")
def page_with_log(browser):
    def make(origin: str, viewport=(1400, 1000)):
        context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        page = context.new_page()
        return page, PageLog(page, origin)

    return make


class _QuietServer(ThreadingHTTPServer):
    """A page that closes while a file is still being sent is the browser's business, not an error."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


@pytest.fixture(scope="session")
def book_server():
    html = ROOT / "book" / "_build" / "html"
    if not (html / "index.html").exists():
        pytest.fail("the book is not built: run `make book` first (make test does)")
    port = free_port()
    handler = partial(type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None}), directory=str(html))
    server = _QuietServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    server.shutdown()


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with a token, serving a scratch copy of lessons/ (so autosave
    and executed outputs never touch the committed notebooks).

    `ONEMASK_LAB_KERNEL_ENV` ("NAME=value NAME=value", as `make test-browser` sets it) goes into
    the kernels' environment: nbval's numerics and `lib.course.training_cache`'s directory, so that the
    lessons' trainings replay what nbval recorded instead of running a second time."""
    work = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "lessons", work / "lessons", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    # The build tracks as a student who solved them would have saved them (lesson 08's assembles
    # 03, 06 and 07's parts from the notebooks beside it): build/solved/NN-build-topic.ipynb.
    import jupytext
    import nbformat

    (work / "lessons" / "build" / "solved").mkdir(parents=True)
    for track in sorted((ROOT / "lessons" / "build").glob("[0-9][0-9]-*.md")):
        nbformat.write(jupytext.read(track), work / "lessons" / "build" / "solved" / f"{track.stem}.ipynb")
    port, token = free_port(), "onemask-test-token"
    env = dict(
        os.environ,
        JUPYTER_RUNTIME_DIR=str(work / "runtime"),
        JUPYTER_CONFIG_DIR=str(work / "config"),
        PYTHONHASHSEED="0",
    )
    for item in shlex.split(os.environ.get("ONEMASK_LAB_KERNEL_ENV", "")):
        name, sep, value = item.partition("=")
        if not sep or not name:
            pytest.fail(f"ONEMASK_LAB_KERNEL_ENV must hold NAME=value pairs, got {item!r}")
        env[name] = value
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={work / 'lessons'}",
        "--LabApp.expose_app_in_browser=True",
        f"--LabApp.workspaces_dir={work / 'workspaces'}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.getuid() == 0:
        cmd.append("--allow-root")
    with serve(
        cmd, env, work, work / "lab.log", f"http://127.0.0.1:{port}/api/status?token={token}", "jupyter lab", 90
    ):
        yield f"http://127.0.0.1:{port}", token
