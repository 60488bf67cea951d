"""A plotly figure as the page draws it and as Python builds it, in one comparable form: the
traces' x, y, z and text, and the title (shared by the gallery and JupyterLab browser tests)."""

from __future__ import annotations

import base64
import json
import math

import numpy as np

FIGURE = "JSON.stringify([el.data.map(t => [t.x, t.y, t.z, t.text]), el.layout.title])"
# The drawn figure's data as plain JSON: typed arrays as lists (plotly.js keeps what the widget sent)
DRAWN_JS = """(el) => {
  const plain = (v) => v === undefined ? null : ArrayBuffer.isView(v) ? Array.from(v)
                     : Array.isArray(v) ? v.map(plain) : v;
  const title = el.layout.title;
  return JSON.stringify({traces: el.data.map(t => ({x: plain(t.x), y: plain(t.y), z: plain(t.z), text: plain(t.text)})),
                         title: title === undefined ? null : (typeof title === 'string' ? title : title.text ?? null)});
}"""


def plain(value):
    """Plotly JSON values as lists, strings and floats (a base64 typed array decoded)."""
    if isinstance(value, dict) and "bdata" in value:
        shape = value.get("shape", -1)
        shape = [int(n) for n in shape.split(",")] if isinstance(shape, str) else shape  # "196, 38"
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"]).reshape(shape).tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def drawn_data(figure) -> dict:
    """A figure's (or FigureWidget's) data as the page's DRAWN_JS reads it."""
    from plotly.utils import PlotlyJSONEncoder

    return drawn_data_of_json(json.loads(json.dumps(figure.to_plotly_json(), cls=PlotlyJSONEncoder)))


def drawn_data_of_json(fig: dict) -> dict:
    """The same from a figure's JSON ({"data": [...], "layout": {...}}, as a kernel sends it)."""
    title = fig["layout"].get("title", {})
    return {
        "traces": [{k: plain(t.get(k)) for k in ("x", "y", "z", "text")} for t in fig["data"]],
        "title": title.get("text") if isinstance(title, dict) else title,
    }


def difference(drawn, expected, where="figure") -> str | None:
    """Where two figures' data first differ (numbers to 1e-9 relative), or None."""
    if isinstance(expected, dict) and isinstance(drawn, dict):
        for key in expected:
            if (diff := difference(drawn.get(key), expected[key], f"{where}.{key}")) is not None:
                return diff
        return None
    if isinstance(expected, list) and isinstance(drawn, list):
        if len(drawn) != len(expected):
            return f"{where}: {len(drawn)} items drawn, {len(expected)} expected"
        for i, (d, e) in enumerate(zip(drawn, expected)):
            if (diff := difference(d, e, f"{where}[{i}]")) is not None:
                return diff
        return None
    numbers = (int, float)
    if (
        isinstance(drawn, numbers)
        and isinstance(expected, numbers)
        and not isinstance(drawn, bool)
        and not isinstance(expected, bool)
        and math.isclose(drawn, expected, rel_tol=1e-9, abs_tol=1e-12)
    ):
        return None
    return None if drawn == expected else f"{where}: drawn {drawn!r}, expected {expected!r}"
