"""Write the hosted-notebook setup cell into every lesson, from pyproject.toml's [tool.onemask].

    python tools/sync_setup_cell.py           # insert or update the cell in lessons/NN-*.md
    python tools/sync_setup_cell.py --check   # exit 1 if a lesson lacks the current cell

The cell comes just before the lesson's capability check (`from lib.course import doctor`). Where `lib`
imports (the course's own JupyterLab, nbval, the book build) it does nothing and prints nothing.
Elsewhere it clones the repository named in [tool.onemask] into ~/one-mask and runs
lib/course/hosted.py from it; while no repository is set, it says how to get the files instead.
Then `make notebooks` carries the cell into the .ipynb files and the exercise notebooks.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
FIRST_LINE = "# Colab, Kaggle, a JupyterHub, VS Code: get the course's files where they are missing."
# only for hosted notebooks: the book leaves it out (its hide-input toggle failed the axe scan:
# a <summary> whose text is not in its accessible name)
TAGS = "remove-cell"
DOCTOR = "```{code-cell} ipython3\n:tags: [nbval-ignore-output]\n\nfrom lib.course import doctor\n"
CELL = re.compile(
    r"```\{code-cell\} ipython3\n(?::tags: \[[^\]]*\]\n)?\n" + re.escape(FIRST_LINE) + r"\n.*?\n```\n\n", re.S
)


def repository(root: Path = ROOT) -> str:
    """The course's git repository, from [tool.onemask] in pyproject.toml ("" while unset)."""
    return tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("onemask", {}).get("repository", "")


def setup_source(url: str) -> str:
    """The cell's code: short, read by students; the work is in lib/course/hosted.py."""
    if not isinstance(url, str) or any(c in url for c in "\"'\\{}\n "):
        raise ValueError(
            f"[tool.onemask] repository must be a plain URL (no quotes, braces, spaces or backslashes), got {url!r}"
        )
    head = [FIRST_LINE, "# In the course's own JupyterLab (`make lab`), or once installed, this does nothing."]
    if not url:
        return "\n".join(
            head
            + [
                "import importlib.util",
                "",
                'if importlib.util.find_spec("lib") is None:',
                "    raise SystemExit(",
                '        "This lesson needs the course\'s files: download the course (git clone, "',
                '        "or its zip unpacked here), run `python lib/course/hosted.py` in its "',
                '        "folder (it installs only what this Python lacks and keeps its torch), "',
                '        "then restart the kernel and run this notebook again."',
                "    )",
            ]
        )
    return "\n".join(
        head
        + [
            "import importlib.util, os, runpy, shutil, subprocess",
            "",
            'if importlib.util.find_spec("lib") is None:',
            f'    REPOSITORY = "{url}"',
            '    COURSE = os.path.expanduser("~/one-mask")',
            '    fetch = ["git", "clone", "--quiet", "--depth=1", REPOSITORY, COURSE]',
            '    no_git = shutil.which("git") is None',
            "    if not os.path.isdir(COURSE) and (no_git or subprocess.run(fetch).returncode):",
            "        raise SystemExit(",
            '            f"Could not download {REPOSITORY} (no network, or no git?). Copy the "',
            '            f"course here another way, unpacked into {COURSE}, and run this cell again."',
            "        )",
            "    # installs what is missing",
            '    hosted = os.path.join(COURSE, "lib", "course", "hosted.py")',
            '    runpy.run_path(hosted, run_name="__main__")',
        ]
    )


def setup_cell(url: str) -> str:
    return f"```{{code-cell}} ipython3\n:tags: [{TAGS}]\n\n{setup_source(url)}\n```\n\n"


def synced(text: str, url: str, where: str = "lesson") -> str:
    """The lesson's MyST text with exactly one current setup cell, just before its doctor cell."""
    text = CELL.sub("", text)
    if text.count(DOCTOR) != 1:
        raise ValueError(f"{where}: expected one capability-check cell starting {DOCTOR!r}")
    return text.replace(DOCTOR, setup_cell(url) + DOCTOR)


def main(argv: list[str]) -> int:
    url = repository()
    stale = []
    for md in sorted(LESSONS.glob("[0-9][0-9]-*.md")):
        text = md.read_text()
        new = synced(text, url, md.name)
        if new != text:
            stale.append(md.relative_to(ROOT))
            if "--check" not in argv:
                md.write_text(new)
                print(f"updated {md.relative_to(ROOT)}")
    if stale and "--check" in argv:
        print(
            "lessons without the current setup cell (run `python tools/sync_setup_cell.py`, then "
            "`make notebooks`):\n  " + "\n  ".join(map(str, stale))
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
