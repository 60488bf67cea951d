"""bertviz's head view and model view, rendering with no network access.

bertviz (Vig 2019) returns HTML that loads require.js, d3 5.7.0 and jQuery from a CDN, so in a
classroom without internet, in CI, and on the static book the views stay empty. Here the same
HTML is rewritten to be self-contained:
- d3 v5.7.0 (the exact version bertviz asks for) is inlined from the `mpld3` package (its file
  only) and jQuery 3.7.1 from `xstatic-jquery` (jQuery alone), both installed from PyPI by the setup;
- the require.js loader is replaced by a direct call of bertviz's own drawing function;
- bertviz's random element id becomes a hash of the content, so stored outputs are stable for
  `pytest --nbval`; attention weights are rounded to 2 decimals (line opacity has no finer steps worth
  storing), which keeps them stable across
  CPUs and keeps the notebook small.
The drawing code itself is bertviz's, unchanged.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["OfflineView", "head_view", "model_view"]

DIGITS = 2


def packaged_file(distribution: str, path: str) -> Path:
    """A file an installed distribution ships, found from its metadata, without importing it
    (mpld3 imports matplotlib, which the course installs without: requirements-weights.txt)."""
    from importlib import metadata

    try:
        found = Path(metadata.distribution(distribution).locate_file(path))
    except metadata.PackageNotFoundError:
        found = None
    if found is None or not found.is_file():
        raise ImportError(
            f"{path} comes from the package {distribution}, which is not installed here: run "
            f"`make lab`, or install requirements.lock, then requirements-weights.txt with --no-deps"
        )
    return found


@lru_cache(maxsize=1)
def _libraries() -> str:
    d3 = packaged_file("mpld3", "mpld3/js/d3.v5.min.js")
    jquery = packaged_file("xstatic-jquery", "xstatic/pkg/jquery/data/jquery.min.js")
    parts = []
    for name, path in (
        ("d3 v5.7.0 (from the mpld3 package)", d3),
        ("jQuery 3.7.1 (from the xstatic-jquery package)", jquery),
    ):
        # Hide any AMD/CommonJS loader so each library sets its window global.
        parts.append(
            f"<script>/* {name} */\n(function () {{ var define, module, exports;\n"
            f"{path.read_text(encoding='utf-8')}\n}}).call(window);</script>"
        )
    return "\n".join(parts)


_CDN_SCRIPT = re.compile(r'<script src="https://[^"]*require[^"]*"></script>\s*')
_REQUIRE_CONFIG = re.compile(r"require\.config\(\{.*?\}\);\s*", re.S)
_REQUIRE_CALL = re.compile(r"requirejs\(\['jquery', 'd3'\],\s*function\s*\(\$, d3\)\s*\{")
_BERTVIZ_ID = re.compile(r"bertviz-[0-9a-f]{32}")


def make_offline(html: str) -> str:
    """Rewrite bertviz's CDN-loading HTML into a self-contained, deterministic snippet."""
    if len(_REQUIRE_CALL.findall(html)) != 1 or not _REQUIRE_CONFIG.search(html):
        raise ValueError(
            "unexpected bertviz HTML: the loader this function rewrites was not found "
            "(was bertviz upgraded? its pin is in requirements-weights.txt)"
        )
    html = _CDN_SCRIPT.sub("", html)
    html = _REQUIRE_CONFIG.sub("", html)
    html = _REQUIRE_CALL.sub("(function ($, d3) {", html)
    end = html.rstrip().rfind("});")
    html = html[:end] + "})(window.jQuery, window.d3);" + html[end + 3 :]
    stable = "bertviz-" + hashlib.sha256(_BERTVIZ_ID.sub("", html).encode()).hexdigest()[:32]
    html = _BERTVIZ_ID.sub(stable, html)
    if "cdnjs" in html or "requirejs(" in html or "require.config" in html:
        raise ValueError("bertviz HTML still refers to a remote loader after the rewrite")
    return _libraries() + "\n" + html


class OfflineView:
    """A bertviz view as self-contained HTML; displays itself in JupyterLab and the book."""

    def __init__(self, html: str, kind: str):
        self.html, self.kind = html, kind

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return f"bertviz {self.kind} (offline; renders as HTML)"


def _prepare(attentions, tokens):
    if not isinstance(attentions, (list, tuple)) or not attentions:
        raise TypeError("attentions must be a non-empty list of per-layer tensors, each (B, H, T, T)")
    for i, a in enumerate(attentions):
        if not isinstance(a, torch.Tensor) or a.dim() != 4 or a.shape[-1] != a.shape[-2]:
            raise ValueError(
                f"attentions[{i}] must be a (B, H, T, T) tensor, got "
                f"{tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__}"
            )
    T = attentions[0].shape[-1]
    if len(tokens) != T:
        raise ValueError(f"tokens must name the T={T} positions, got {len(tokens)} tokens")
    # bertviz draws batch item 0; keep only it, rounded.
    return [a[:1].detach().cpu().double().round(decimals=DIGITS) for a in attentions], list(tokens)


def head_view(attentions, tokens, **kwargs) -> OfflineView:
    """bertviz.head_view for per-layer attention weights [(B, H, T, T), ...], offline."""
    from bertviz import head_view as _head_view

    atts, toks = _prepare(attentions, tokens)
    return OfflineView(make_offline(_head_view(atts, toks, html_action="return", **kwargs).data), "head view")


def model_view(attentions, tokens, **kwargs) -> OfflineView:
    """bertviz.model_view (every layer and head as a grid of thumbnails), offline."""
    from bertviz import model_view as _model_view

    atts, toks = _prepare(attentions, tokens)
    return OfflineView(make_offline(_model_view(atts, toks, html_action="return", **kwargs).data), "model view")
