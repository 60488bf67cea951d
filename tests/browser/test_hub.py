"""A class on a real JupyterHub: the hub (PyPI `jupyterhub`) with its default proxy (npm
`configurable-http-proxy`, installed by `make setup`), both on 127.0.0.1, a class-list
authenticator (a password per student) and the local spawner, each student's server in a home
folder of its own. Two students log in from two browsers, each gets their own server, and both
run lesson 01 to the end at the same time with no error output; neither can open the other's
server or files; a wrong password and an unknown name get the login page's refusal; logging out
ends the session. The hub's database, cookie secret, proxy token and the homes live in the
test's temporary folder.

The spawner here starts every server as the same system user (`SimpleLocalProcessSpawner`): the
hub and the proxy refuse a student another's server, but the walls between their files are the
operating system's, which a real hub gets from one system user per student (`LocalProcessSpawner`)
or one container per student (Zero to JupyterHub)."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import time
from pathlib import Path

import pytest
from lab_js import ALL_CELLS_RUN_JS
from test_lab import CELL_STATE_JS

ROOT = Path(__file__).resolve().parents[2]
PROXY = Path(sys.prefix) / "share" / "onemask-chp" / "node_modules" / ".bin" / "configurable-http-proxy"
LESSON = ROOT / "lessons" / "01-masking-equation.ipynb"
STUDENTS = ("ada", "ben")

CONFIG = '''
import secrets

from jupyterhub.auth import Authenticator
from traitlets import Dict


class ClassList(Authenticator):
    """One password per student on the class list; anyone else is refused."""
    passwords = Dict(config=True)

    async def authenticate(self, handler, data):
        name = data["username"]
        if name in self.passwords and secrets.compare_digest(self.passwords[name], data["password"]):
            return name
        return None


c = get_config()
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.command = [{proxy!r}]
c.ConfigurableHTTPProxy.pid_file = {pid_file!r}
c.JupyterHub.db_url = "sqlite:///{db}"
c.JupyterHub.cookie_secret_file = {cookie_secret!r}
c.JupyterHub.shutdown_on_logout = True  # a student who logs out frees their server's memory
c.JupyterHub.authenticator_class = ClassList
c.ClassList.passwords = {passwords!r}
c.Authenticator.allowed_users = set({passwords!r})
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = {homes!r} + "/{{username}}"
c.Spawner.ip = "127.0.0.1"
c.Spawner.cmd = [{singleuser!r}]
c.Spawner.args = {args!r}
c.Spawner.default_url = "/lab"
c.Spawner.environment = {{"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}}
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
'''


@pytest.fixture(scope="module")
def hub(tmp_path_factory, server, unused_port):
    if not PROXY.exists():
        reason = (
            f"configurable-http-proxy is not installed at {PROXY}: run `bash tools/install_proxy.sh .venv` (needs npm)"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)  # CI's setup installs it: absent there is a broken setup, not a skip
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("hub")
    homes = work / "home"
    for student in STUDENTS:
        (homes / student).mkdir(parents=True)
        shutil.copy(LESSON, homes / student / LESSON.name)
    passwords = {s: secrets.token_urlsafe(12) for s in STUDENTS}
    port = unused_port()
    args = [
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.getuid() == 0:
        args.append("--allow-root")
    (work / "jupyterhub_config.py").write_text(
        CONFIG.format(
            port=port,
            hub_port=unused_port(),
            proxy_api_port=unused_port(),
            proxy=str(PROXY),
            pid_file=str(work / "proxy.pid"),
            db=work / "jupyterhub.sqlite",
            cookie_secret=str(work / "jupyterhub_cookie_secret"),
            passwords=passwords,
            homes=str(homes),
            singleuser=str(Path(sys.executable).parent / "jupyterhub-singleuser"),
            args=args,
        )
    )
    env = dict(
        os.environ,
        CONFIGPROXY_AUTH_TOKEN=secrets.token_hex(32),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jupyterhub", "-f", str(work / "jupyterhub_config.py")]
    with server(cmd, env, work, work / "hub.log", f"{base}/hub/api", "jupyterhub", 90):
        yield base, passwords, work
    # the hub stops the students' servers and its proxy as it exits
    for name in ("jupyterhub.sqlite", "jupyterhub_cookie_secret"):
        assert (work / name).exists()  # where the config put them: the test's folder
    shutil.rmtree(work)


def log_in(page, base: str, name: str, password: str) -> None:
    page.goto(f"{base}/hub/login")
    page.fill("#username_input", name)
    page.fill("#password_input", password)
    page.click("#login_submit")


@pytest.fixture(scope="module")
def classroom(hub, browser):
    """Both students logged in, each in a browser of their own, lesson 01 run to the end in
    each one's JupyterLab, the two kernels working at the same time."""
    base, passwords, _ = hub
    pages = {}
    for student in STUDENTS:
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        log_in(page, base, student, passwords[student])
        page.wait_for_url(f"**/user/{student}/lab**", timeout=180_000)
        page.goto(f"{base}/user/{student}/lab/tree/{LESSON.name}")
        page.wait_for_function(
            "() => window.jupyterapp && window.jupyterapp.shell.currentWidget "
            "&& window.jupyterapp.shell.currentWidget.context",
            timeout=120_000,
        )
        pages[student] = page
    for page in pages.values():
        n_cells = page.evaluate("""async () => {
          const panel = window.jupyterapp.shell.currentWidget;
          await panel.context.ready;
          await panel.sessionContext.ready;
          await window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs');
          window.jupyterapp.commands.execute('notebook:run-all-cells');
          return panel.content.model.cells.length;
        }""")
        assert n_cells > 20
    for page in pages.values():
        page.wait_for_function(ALL_CELLS_RUN_JS, timeout=600_000, polling=1000)
    yield pages
    for page in pages.values():
        page.context.close()


def test_two_students_run_lesson_01_on_their_own_servers(hub, classroom):
    _, _, work = hub
    for student, page in classroom.items():
        state = page.evaluate(CELL_STATE_JS)
        assert state["unrun"] == 0 and state["errors"] == [], (student, state)
        # the kernel runs in the student's own home, on the server the hub started for them
        cwd = page.evaluate("""async () => {
          const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
          const future = kernel.requestExecute({code: 'import os; print(os.getcwd())'});
          let out = '';
          future.onIOPub = (m) => { if (m.header.msg_type === 'stream') out += m.content.text; };
          await future.done;
          return out.trim(); }""")
        assert Path(cwd) == work / "home" / student


def test_a_student_cannot_open_another_students_server_or_files(hub, classroom):
    base, _, _ = hub
    ben = classroom["ben"]
    for path in ("lab", f"lab/tree/{LESSON.name}", f"files/{LESSON.name}", f"api/contents/{LESSON.name}"):
        response = ben.goto(f"{base}/user/ada/{path}")
        assert response.status == 403, (path, response.status, ben.url)
    # nor through his own server: its files stop at his home
    response = ben.goto(f"{base}/user/ben/api/contents/..%2Fada%2F{LESSON.name}")
    assert response.status in (400, 403, 404), response.status
    assert ben.goto(f"{base}/user/ben/api/contents/{LESSON.name}").status == 200


def test_wrong_password_and_unknown_name_are_refused_at_the_login(hub, browser):
    base, passwords, _ = hub
    page = browser.new_context().new_page()
    for name, password in (("ada", passwords["ben"]), ("mallory", passwords["ada"])):
        log_in(page, base, name, password)
        page.wait_for_load_state()
        assert "/hub/login" in page.url, (name, page.url)
        assert page.get_by_text("Invalid username or password").is_visible(), name
        # no session came of it: ada's running server refuses, mallory has none (the login page)
        response = page.goto(f"{base}/user/{name}/api/contents")
        assert response.status == 403 or "/hub/login" in page.url, (name, page.url)
    page.context.close()


def test_logging_out_ends_the_session(hub, browser):
    base, passwords, _ = hub
    page = browser.new_context().new_page()
    log_in(page, base, "ada", passwords["ada"])
    page.wait_for_url("**/user/ada/lab**", timeout=180_000)
    assert page.goto(f"{base}/user/ada/api/contents/{LESSON.name}").status == 200
    page.goto(f"{base}/hub/logout")
    assert "/hub/login" in page.url
    # Her server stops with the session (shutdown_on_logout; the hub stops it in the background,
    # and until then it may still honour the cookie it checked a moment ago), and for good.
    deadline = time.monotonic() + 60
    files = f"{base}/user/ada/api/contents/{LESSON.name}"
    while page.request.get(files, max_redirects=0).status == 200:
        assert time.monotonic() < deadline, "ada's files are still served a minute after logout"
        page.wait_for_timeout(500)
    page.goto(f"{base}/user/ada/lab")
    assert "/hub/login" in page.url, page.url  # her lab sends her to the login page
    page.context.close()
