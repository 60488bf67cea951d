"""Re-execute lessons into their committed .ipynb, deterministically.

    python tools/execute_lessons.py                 # every lessons/NN-*.md
    python tools/execute_lessons.py lessons/01-masking-equation.md

For each MyST source: update the paired .ipynb from it (jupytext keeps outputs of unchanged
cells), execute it in place with widget state and timing metadata left out (both change on
every run and would bloat the file), then normalise what the kernel leaves behind so two runs
write the same bytes. Lessons run in parallel processes, at most one per two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
BIN = Path(sys.executable).parent


def normalise(nb_path: Path) -> None:
    """Keep metadata that matters (kernelspec, jupytext pairing, tags); drop run-to-run noise."""
    nb = json.loads(nb_path.read_text())
    nb["metadata"] = {k: v for k, v in nb["metadata"].items() if k in ("jupytext", "kernelspec", "language_info")}
    li = nb["metadata"].get("language_info")
    if li:
        nb["metadata"]["language_info"] = {"name": li.get("name", "python")}
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"cell-{i:03d}"  # stable ids instead of fresh random ones
        meta = cell.get("metadata", {})
        cell["metadata"] = {k: v for k, v in meta.items() if k in ("tags", "editable", "slideshow")}
        if cell["cell_type"] == "code":
            for out in cell.get("outputs", []):
                out.get("metadata", {}).pop("execution", None)
    nb_path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def execute(md: Path) -> tuple[Path, int, str, float]:
    start = time.perf_counter()
    nb = md.with_suffix(".ipynb")
    env = dict(os.environ, PYTHONHASHSEED="0", TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    steps = [
        [str(BIN / "jupytext"), "--to", "ipynb", "--update", str(md)],
        [str(BIN / "jupyter"), "nbconvert", "--to", "notebook", "--execute", "--inplace",
         "--ExecutePreprocessor.store_widget_state=False", "--ExecutePreprocessor.record_timing=False",
         "--ExecutePreprocessor.timeout=600", str(nb)],
    ]
    for cmd in steps:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            return md, proc.returncode, proc.stdout[-4000:] + proc.stderr[-4000:], time.perf_counter() - start
    normalise(nb)
    return md, 0, "", time.perf_counter() - start


def main(argv: list[str]) -> int:
    mds = [Path(a).resolve() for a in argv] or sorted(LESSONS.glob("[0-9][0-9]-*.md"))
    failed = 0
    # Lessons run one at a time per 2 cores: each kernel's torch uses every core, and two training
    # lessons side by side on 2 cores slowed each other down tenfold (threads waiting on each other).
    workers = max(1, min(len(mds), (os.cpu_count() or 1) // 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for md, rc, log, seconds in pool.map(execute, mds):
            print(f"{'ok  ' if rc == 0 else 'FAIL'} {md.relative_to(ROOT)}  ({seconds:.0f} s, including kernel start)")
            if rc:
                failed += 1
                print(log)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
