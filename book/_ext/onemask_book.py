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
    app.connect("html-page-context", _tidy_scripts, priority=900)
    app.connect("build-finished", _write_root_favicon)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
