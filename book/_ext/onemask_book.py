"""A small Sphinx extension for the One Mask book.

Sphinx 7.4 with Jupyter Book 1.x lists some per-page scripts twice (MathJax and sphinx-thebe's
loader): two MathJax copies throw "Cannot set property Package" and two thebe loaders throw
"THEBE_JS_URL has already been declared" in the browser console. The book has no live kernel
(thebe would fetch its code from a CDN anyway), so this drops thebe's scripts and keeps one
copy of every other script.
"""

from __future__ import annotations


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


def setup(app):
    app.connect("html-page-context", _tidy_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
