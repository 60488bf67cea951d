"""A small Sphinx extension for the One Mask book.

Every lesson page opens with a "Before you start" box: the lesson's prerequisites (kept as data
in book/prerequisites.yml), links to download the executed notebook and its exercise version
(both copied into the built site beside the page, so the links work offline), and how to open
them in JupyterLab. Only lessons listed in _toc.yml get a page, so a lesson that is still being
written may already have prerequisites without breaking the build.

Accessibility (checked by tests/browser/test_a11y.py with axe-core): plotly figures get a role and
a name from their titles, and bertviz's layer menu gets a label. Two theme buttons are overridden
in book/_templates.

Sphinx 7.4 with Jupyter Book 1.x lists some per-page scripts twice (MathJax and sphinx-thebe's
loader): two MathJax copies throw "Cannot set property Package" and two thebe loaders throw
"THEBE_JS_URL has already been declared" in the browser console. The book has no live kernel
(thebe would fetch its code from a CDN anyway), so this drops thebe's scripts and keeps one
copy of every other script.
"""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

import yaml
from docutils import nodes
from sphinx.util import logging

logger = logging.getLogger(__name__)

PREREQUISITES = "prerequisites.yml"  # in the book's source folder
LESSON_DOC = re.compile(r"^lessons/(?P<number>\d\d)-[\w-]+$")  # a lesson page's docname


def _lesson_docs(env) -> dict[str, str]:
    """Lesson number -> docname, for the lessons this build has (those in _toc.yml)."""
    found = {}
    for docname in sorted(env.found_docs):
        m = LESSON_DOC.match(docname)
        if m:
            found[m["number"]] = docname
    return found


def _load_prerequisites(app) -> None:
    path = Path(app.srcdir) / PREREQUISITES
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    app.env.onemask_prerequisites = {str(k): list(v or []) for k, v in data.items()}


def _lessons_outdated_by_prerequisites(app, env, added, changed, removed) -> list[str]:
    """An incremental build rewrites every lesson page when book/prerequisites.yml changes."""
    text = (Path(app.srcdir) / PREREQUISITES).read_text(encoding="utf-8")
    if getattr(env, "onemask_prerequisites_text", None) == text:
        return []
    env.onemask_prerequisites_text = text
    return list(_lesson_docs(env).values())


def _exercise_path(app, docname: str) -> Path:
    return Path(app.srcdir) / "lessons" / "exercises" / f"{Path(docname).name}.ipynb"


def _build_path(app, docname: str) -> Path | None:
    """The lesson's build track, the student's notebook lessons/build/NN-build-topic.ipynb (None if absent)."""
    found = sorted((Path(app.srcdir) / "lessons" / "build").glob(f"{Path(docname).name[:2]}-build-*.ipynb"))
    return found[0] if found else None


def _before_you_start(app, docname: str, number: str) -> str:
    """The HTML of a lesson page's "Before you start" box."""
    env, builder = app.env, app.builder
    stem = Path(docname).name
    lessons = _lesson_docs(env)
    prerequisites = env.onemask_prerequisites.get(number)
    if prerequisites is None:
        logger.warning(f"lesson {number} has no entry in book/{PREREQUISITES}", location=docname)
        prerequisites = []
    items = []
    for entry in prerequisites:
        other, why = f"{int(entry['lesson']):02d}", entry.get("for", "")
        if other in lessons:
            title = env.titles[lessons[other]].astext()
            href = html.escape(builder.get_relative_uri(docname, lessons[other]))
            link = f'<a class="reference internal" href="{href}">{html.escape(title)}</a>'
        else:
            link = f"lesson {other}"
        items.append(f"<li>{link}{': ' + html.escape(why) if why else ''}</li>")
    if items:
        prereq_html = (
            "<p><strong>Prerequisites.</strong> Read these lessons first:</p>\n"
            f'<ul class="onemask-prerequisites">{"".join(items)}</ul>'
        )
    else:
        prereq_html = (
            '<p class="onemask-prerequisites"><strong>Prerequisites.</strong> None: the course starts here.</p>'
        )

    def download(href: str, what: str) -> str:
        return f'<li><a class="reference download" href="{href}" download=""><code>{href}</code></a>: {what}</li>'

    downloads = [download(f"{stem}.ipynb", "the lesson as executed for this page, with its outputs")]
    if _exercise_path(app, docname).exists():
        downloads.append(
            download(f"exercises/{stem}.ipynb", "the exercise version, solutions left out, with checks that give hints")
        )
    else:
        logger.warning(
            f"no exercise notebook lessons/exercises/{stem}.ipynb for this lesson (run `make exercises`)",
            location=docname,
        )
    build = _build_path(app, docname)
    if build is not None:
        downloads.append(
            download(
                f"build/{build.name}",
                "build it yourself: the lesson's component written by you, "
                "step by step, each step checked against the library (and a real model's weights "
                "where there is one)",
            )
        )
    else:
        logger.warning(
            f"no build track lessons/build/{stem[:2]}-build-*.ipynb for this lesson (run `make exercises`)",
            location=docname,
        )
    build_open = f", or <code>build/{build.name}</code> to build its component yourself" if build else ""
    return f"""<div class="admonition note onemask-lesson-box">
<p class="admonition-title">Before you start</p>
{prereq_html}
<p><strong>Notebooks.</strong> Download them:</p>
<ul class="onemask-downloads">{"".join(downloads)}</ul>
<p><strong>Open in JupyterLab.</strong> The notebooks import the course's <code>lib</code>, so run them from a clone
of the course repository: <code>make lab</code> sets everything up and opens JupyterLab on <code>lessons/</code>;
there, open <code>{stem}.ipynb</code>, <code>exercises/{stem}.ipynb</code> to do the exercises{build_open}.</p>
</div>"""


def _add_lesson_box(app, doctree, docname) -> None:
    m = LESSON_DOC.match(docname)
    if app.builder.format != "html" or not m:
        return
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None or not isinstance(section[0], nodes.title):
        return
    box = nodes.raw("", _before_you_start(app, docname, m["number"]), format="html")
    section.insert(1, box)  # right under the page's title


# bertviz's head view draws "Layer: <select id="layer">" with no label element; wrapped in a
# <label>, the menu gets its accessible name (axe: select-name, critical). The views' script
# finds the menu by id, so wrapping it changes nothing else.
_UNLABELLED_SELECT = re.compile(r'(?<!<label>)\b([A-Z][a-z]+): (<select id="[\w-]+"></select>)')


def _label_bertviz_menus(app, doctree, docname) -> None:
    for raw in doctree.findall(nodes.raw):
        text = raw.astext()
        if "html" in raw.get("format", "").split() and "bertviz-" in text and "<select" in text:
            labelled = _UNLABELLED_SELECT.sub(r"<label>\1: \2</label>", text)
            if labelled != text:
                raw.children = [nodes.Text(labelled)]


# A plotly figure reaches the page as a bare <div> that plotly.js fills with SVG: a screen reader
# meets unlabelled shapes. Each figure div gets role="figure" and a name made of its title and
# axis titles, read from the figure's own JSON in the script beside it. (role="img" would hide
# the figure's buttons and sliders from assistive technology; "figure" keeps them reachable.)
_PLOTLY_CALL = re.compile(r'Plotly\.newPlot\(\s*"(?P<id>fig-[0-9a-f]+)",\s*')
_COMMA = re.compile(r"\s*,\s*")


def _text(title) -> str:
    text = title.get("text", "") if isinstance(title, dict) else (title or "")
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", str(text))).strip()


def _figure_name(layout: dict) -> str:
    name = _text(layout.get("title"))
    axes = [
        f"{key[0]} {_text(axis.get('title'))}"
        for key, axis in sorted(layout.items())
        if re.fullmatch(r"[xy]axis\d*", key) and isinstance(axis, dict) and _text(axis.get("title"))
    ]
    axes = list(dict.fromkeys(axes))  # subplots often repeat an axis title
    if axes:
        name = f"{name or 'Figure'} (axes: {'; '.join(axes)})"
    return name


def _name_plotly_figures(app, doctree, docname) -> None:
    decoder = json.JSONDecoder()
    for raw in doctree.findall(nodes.raw):
        text = raw.astext()
        if "html" not in raw.get("format", "").split() or 'class="plotly-graph-div"' not in text:
            continue
        named = text
        for call in _PLOTLY_CALL.finditer(text):
            try:
                _, end = decoder.raw_decode(text, call.end())  # the traces
                layout, _ = decoder.raw_decode(text, _COMMA.match(text, end).end())  # then the layout
            except (ValueError, AttributeError):
                continue
            name = _figure_name(layout) if isinstance(layout, dict) else ""
            tag = f'<div id="{call["id"]}" class="plotly-graph-div"'
            if name and tag in named:
                named = named.replace(tag, f'{tag} role="figure" aria-label="{html.escape(name)}"', 1)
        if named != text:
            raw.children = [nodes.Text(named)]


def _copy_notebooks(app, exception) -> None:
    """Put each lesson's executed notebook beside its page, its exercise version in exercises/
    and its build track in build/ beside that: the layout of lessons/ in the repository, so
    links stay relative."""
    if exception is not None or app.builder.format != "html":
        return
    for docname in _lesson_docs(app.env).values():
        target = Path(app.outdir) / f"{docname}.ipynb"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(app.srcdir) / f"{docname}.ipynb", target)
        exercise = _exercise_path(app, docname)
        if exercise.exists():
            (target.parent / "exercises").mkdir(exist_ok=True)
            shutil.copyfile(exercise, target.parent / "exercises" / exercise.name)
        build = _build_path(app, docname)
        if build is not None:  # lesson 08's track reads 03, 06 and 07's beside it: all of them go
            (target.parent / "build").mkdir(exist_ok=True)
            shutil.copyfile(build, target.parent / "build" / build.name)


def _tidy_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for js in scripts:
        filename = str(getattr(js, "filename", js) or "")
        body = str(getattr(js, "attributes", {}).get("body", ""))
        key = filename or body
        if "thebe" in filename.lower() or "THEBE_JS_URL" in body:
            continue
        if key and key in seen:
            continue
        seen.add(key)
        kept.append(js)
    context["script_files"] = kept
    css = context.get("css_files")
    if css:
        context["css_files"] = [c for c in css if "thebe" not in str(getattr(c, "filename", c)).lower()]


def _png_square(size: int, rgb: tuple[int, int, int]) -> bytes:
    """A solid square as PNG bytes (made here: the book ships no binary assets)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes(rgb) * size for _ in range(size))  # filter byte 0, then RGB pixels
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _write_root_favicon(app, exception) -> None:
    """Browsers ask for /favicon.ico on pages without a favicon link (the root index.html, which
    only redirects); without this file that request is a 404 in the console."""
    if exception is not None or app.builder.format != "html":
        return
    import struct
    from pathlib import Path

    png = _png_square(16, (0x00, 0x72, 0xB2))  # the course's blue (Okabe-Ito)
    icon = struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(png), 22) + png
    (Path(app.outdir) / "favicon.ico").write_bytes(icon)


def setup(app):
    app.connect("builder-inited", _load_prerequisites)
    app.connect("env-get-outdated", _lessons_outdated_by_prerequisites)
    app.connect("doctree-resolved", _add_lesson_box)
    app.connect("doctree-resolved", _label_bertviz_menus)
    app.connect("doctree-resolved", _name_plotly_figures)
    app.connect("html-page-context", _tidy_scripts, priority=900)
    app.connect("build-finished", _write_root_favicon)
    app.connect("build-finished", _copy_notebooks)
    # Sphinx does not notice edits to this file: bump env_version after changing what it writes,
    # so that an existing book/_build is rebuilt from scratch.
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
