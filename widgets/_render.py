"""How figures leave a kernel: one deterministic renderer for JupyterLab, nbval and the book.

A figure is displayed as two outputs of the same data:
- `application/vnd.plotly.v1+json`, which JupyterLab draws with its plotly extension;
- `text/html` with a `<div>` whose id is a hash of the figure (not a random uuid) and no
  plotly.js inside: the Jupyter Book page serves plotly.js once from its own `_static/`.
Both are byte-for-byte the same on every run, so `pytest --nbval` can compare them, and a
notebook with ten figures stays tens of kilobytes instead of tens of megabytes. JupyterLab,
Jupyter Notebook 7 (built on JupyterLab) and VS Code draw the plotly JSON.

Colab shows each output in a sandbox that draws neither: there (and in Kaggle) figures go
through plotly's own renderer for that site, which loads plotly.js from its CDN.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import plotly.graph_objects as go
import plotly.io as pio
from plotly.io._base_renderers import MimetypeRenderer

RENDERER = "onemask_html"

# Colour-blind-safe scales (viridis family and a purple-orange diverging scale).
SEQUENTIAL = "Viridis"
DIVERGING = "PuOr"
MASKED_COLOUR = "#2b2b2b"  # a blocked (−inf) cell; also carries a "−∞" label, never colour alone
OPEN_COLOUR = "#f2f2f2"
# Okabe & Ito's colour-blind-safe palette for lines and bars.
OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
TEMPLATE = "onemask"


class StableHtmlRenderer(MimetypeRenderer):
    """text/html with a content-hashed div id and no embedded plotly.js."""

    def to_mimebundle(self, fig_dict):
        payload = json.dumps(fig_dict, sort_keys=True, default=str).encode()
        div_id = "fig-" + hashlib.sha256(payload).hexdigest()[:16]
        html = pio.to_html(
            fig_dict,
            include_plotlyjs=False,
            include_mathjax=False,
            full_html=False,
            div_id=div_id,
            validate=False,
            default_width="100%",
            config={"displaylogo": False, "responsive": True},
            # An animated figure waits for its ▶ button (or the keyboard) instead of playing on
            # load: nothing on a page moves unless the reader asks (WCAG 2.2.2, pause/stop/hide).
            auto_play=False,
        )
        return {"text/html": html}


def environment() -> str:
    """Where this kernel's figures are shown: "colab", "kaggle", or "jupyter" (JupyterLab,
    Notebook 7, VS Code, and the course's own runs: nbval and the book)."""
    if "google.colab" in sys.modules:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
        return "kaggle"
    return "jupyter"


def use_stable_renderer() -> None:
    """Register the renderer and make `fig.show()` emit the plotly JSON + stable HTML pair (in
    Colab and Kaggle: plotly's renderer for the site); new figures use the course template
    (white background, colour-blind-safe colours)."""
    pio.renderers[RENDERER] = StableHtmlRenderer()
    where = environment()
    pio.renderers.default = where if where != "jupyter" else f"plotly_mimetype+{RENDERER}"
    if where == "colab":  # the live widgets (anywidget, plotly's FigureWidget) need Colab's widget manager
        from google.colab import output

        output.enable_custom_widget_manager()
    template = go.layout.Template(pio.templates["plotly_white"])
    template.layout.colorway = OKABE_ITO
    pio.templates[TEMPLATE] = template
    pio.templates.default = TEMPLATE


def redraw(figure, new) -> None:
    """Replace a live FigureWidget's traces and layout with a new figure's, in one batch (the
    widget keeps its identity, so the page updates in place). Both have the same traces."""
    with figure.batch_update():
        for old_trace, new_trace in zip(figure.data, new.data):
            old_trace.update(new_trace.to_plotly_json(), overwrite=True)
        figure.layout.update(new.layout.to_plotly_json(), overwrite=True)


def live_mimebundle(widget, name: str, **kwargs) -> dict:
    """A live widget's display bundle with a stable text/plain (no ids that change per run)."""
    bundle = widget._repr_mimebundle_(**kwargs)
    bundle["text/plain"] = f"{name} (a live widget: run this cell in JupyterLab to use it)"
    return bundle
