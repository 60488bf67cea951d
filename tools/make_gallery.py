"""Write the classroom gallery that `make demo` serves with Voilà: one notebook per widget.

    python tools/make_gallery.py [OUT]                      # default OUT: .demo (gitignored)
    python tools/make_gallery.py [OUT] --serve [--port P]   # then serve it (what `make demo` runs)

OUT/notebooks/  index.ipynb (links to every widget, with what to notice) and NN-name.ipynb, one
                per entry of widgets.gallery.GALLERY: a navigation bar (previous, index, next)
                and one cell, `present(name)`. Voilà hides the code and shows the widget.
OUT/share/      a Jupyter data directory holding the Voilà template `onemask`
                (tools/gallery_template/ plus Font Awesome 4.7 copied from the installed xstatic-font-awesome
                package): Voilà's own template links its icon font from a CDN; this one serves it
                locally, so the gallery works with no network. Point JUPYTER_PATH at it:

    JUPYTER_PATH=OUT/share voila OUT/notebooks --template=onemask --no-browser --port 8866
"""

from __future__ import annotations

import argparse
import html
import os
import secrets
import shutil
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_SRC = ROOT / "tools" / "gallery_template"
TEMPLATE_NAME = "onemask"
DEFAULT_PORT = 8866  # Voilà's own default; `make demo DEMO_PORT=...` changes it
# The only lab extensions a gallery page loads: Voilà's widget manager (it keeps the one matching the
# installed ipywidgets), JupyterLab's, and the two the figures render with. Voilà otherwise loads
# every extension installed for JupyterLab, and some cannot run outside it (nbgrader's and
# Notebook 7's fail on shared modules that only JupyterLab provides).
EXTENSION_ALLOWLIST = [
    "@voila-dashboards/widgets-manager8",
    "@voila-dashboards/widgets-manager7",
    "@jupyter-widgets/jupyterlab-manager",
    "jupyterlab-plotly",
    "anywidget",
]
KEYS = (
    "Keys: <kbd>Tab</kbd> moves between controls, arrow keys move a focused slider, <kbd>N</kbd> / "
    "<kbd>P</kbd> go to the next / previous widget, <kbd>I</kbd> back to this index."
)


def notebook_name(position: int, name: str) -> str:
    return f"{position:02d}-{name}.ipynb"


def _nav(prev: tuple[str, str] | None, nxt: tuple[str, str] | None) -> str:
    """The bar above a widget: plain links (Tab reaches them), with rel for the N / P / I keys."""
    parts = []
    if prev:
        parts.append(f'<a rel="prev" href="{prev[0]}">← {html.escape(prev[1])}</a>')
    parts.append('<a rel="index" href="index.ipynb">gallery index</a>')
    if nxt:
        parts.append(f'<a rel="next" href="{nxt[0]}">{html.escape(nxt[1])} →</a>')
    return '<nav class="onemask-nav">' + " ".join(parts) + "</nav>"


def _notebook(cells) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def gallery_notebooks() -> dict[str, nbformat.NotebookNode]:
    """File name -> notebook, the index first."""
    from lib.course.lessons import LESSONS
    from widgets.gallery import GALLERY

    titles = {lesson.stem: lesson.title for lesson in LESSONS}
    entries = [(notebook_name(i, name), exhibit) for i, (name, exhibit) in enumerate(GALLERY.items(), start=1)]
    rows = "\n".join(
        f"| {i} | [{exhibit.title}]({file}) | {html.escape(titles.get(exhibit.lesson, exhibit.lesson))} | "
        f"{exhibit.notice} |"
        for i, (file, exhibit) in enumerate(entries, start=1)
    )
    first = entries[0]
    index = _notebook(
        [
            new_markdown_cell(
                f'<nav class="onemask-nav"><a rel="next" href="{first[0]}">start: '
                f"{html.escape(first[1].title)} →</a></nav>\n\n"
                "# One Mask: the widget gallery\n\n"
                "Every live widget of the course, one per page, sized for a projector. Each page builds its widget "
                "when it opens; the ones that show a trained model train a small one first (up to about 20 "
                "seconds).\n\n"
                f"| # | widget | lesson | what to notice |\n|---|---|---|---|\n{rows}\n\n"
                f'<p class="onemask-keys">{KEYS}</p>\n\n'
                'From a notebook: `from widgets.gallery import present; present("kv_calculator")`.'
            )
        ]
    )
    out = {"index.ipynb": index}
    for i, (file, exhibit) in enumerate(entries):
        prev = (entries[i - 1][0], entries[i - 1][1].title) if i > 0 else None
        nxt = (entries[i + 1][0], entries[i + 1][1].title) if i + 1 < len(entries) else None
        out[file] = _notebook(
            [
                new_markdown_cell(_nav(prev, nxt)),
                new_code_cell(f"from widgets.gallery import present\n\npresent({exhibit.name!r})"),
            ]
        )
    return out


def write_template(share: Path) -> Path:
    """The Voilà template `onemask` under share/voila/templates, with a local icon font."""
    dest = share / "voila" / "templates" / TEMPLATE_NAME
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(TEMPLATE_SRC, dest)
    from importlib import metadata

    # Font Awesome 4.7's css/ and fonts/, as the xstatic-font-awesome package ships them
    font_awesome = Path(metadata.distribution("xstatic-font-awesome").locate_file("xstatic/pkg/font_awesome/data"))
    for part in ("css", "fonts"):
        shutil.copytree(font_awesome / part, dest / "static" / "font-awesome" / part)
    return dest


def write_gallery(out: Path) -> Path:
    """Write the notebooks and the template under `out`; returns the notebooks' folder."""
    notebooks = out / "notebooks"
    if notebooks.exists():
        shutil.rmtree(notebooks)
    notebooks.mkdir(parents=True)
    written = gallery_notebooks()
    for file, nb in written.items():
        nbformat.write(nb, notebooks / file)
    template = write_template(out / "share")
    print(f"wrote {len(written)} notebooks into {notebooks} and the Voilà template into {template}")
    return notebooks


def voila_command(out: Path, port: int, token: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that serve the gallery written under `out` on 127.0.0.1:`port`."""
    voila = Path(sys.executable).parent / "voila"
    argv = [
        str(voila) if voila.exists() else "voila",
        str(out / "notebooks"),
        f"--template={TEMPLATE_NAME}",
        "--no-browser",
        "--Voila.ip=127.0.0.1",
        f"--port={port}",
        "--Voila.port_retries=0",
        f"--Voila.token={token}",
        "--show_tracebacks=True",
        *(f"--VoilaConfiguration.extension_allowlist={name}" for name in EXTENSION_ALLOWLIST),
    ]
    # the template is found through the Jupyter data path; keep whatever the caller had after it
    path = os.pathsep.join(p for p in (str(out / "share"), os.environ.get("JUPYTER_PATH", "")) if p)
    return argv, {**os.environ, "JUPYTER_PATH": path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / ".demo")
    parser.add_argument("--serve", action="store_true", help="then serve the gallery with Voilà")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = parser.parse_args()
    out = args.out.resolve()
    write_gallery(out)
    if args.serve:
        token = secrets.token_hex(24)
        argv, env = voila_command(out, args.port, token)
        print(
            f"\n  One Mask gallery in Voilà: http://127.0.0.1:{args.port}/voila/render/index.ipynb?token={token}\n",
            flush=True,
        )
        os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main()
