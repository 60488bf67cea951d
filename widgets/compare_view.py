"""Lesson 08's results explorer: one measurement of the four architectures at a time.

    compare_figure(results, metric)   the static face: a plain plotly figure of one metric
    CompareView(results)              the live face: a metric menu above the same figure
    seed_range_figure(lines, ...)     accuracies of several seeds: each line at the mean over its
                                      seeds, a bar from the lowest seed to the highest

`results` maps a metric name (a key of METRICS) to {architecture: (xs, ys)}, numbers measured by
lib.course.compare (lesson 08 passes its committed record, `lib.course.bench.compare.explorer_results`). Each y
is a number or a list of one number per seed: a line then runs through the mean, with a bar from
the lowest seed to the highest. `overlay` (the same shape, one run) is drawn dotted beside it, each
trace named with `label` and `overlay_label`. No model code here. Each architecture keeps one
colour and one marker symbol in every view, so the lines are told apart without colour too.
"""

from __future__ import annotations

import plotly.graph_objects as go

from widgets._render import OKABE_ITO, live_mimebundle, redraw

__all__ = ["METRICS", "CompareView", "compare_figure", "seed_range_figure"]

# metric: (title, x axis, y axis, x log?, y log?)
METRICS = {
    "recall": (
        "Associative recall: accuracy against the number of stored pairs",
        "key-value pairs P",
        "answer accuracy",
        False,
        False,
    ),
    "copy": (
        "Selective copying: accuracy against sequence length",
        "sequence length T (tokens)",
        "answer accuracy",
        True,
        False,
    ),
    "flops": ("Forward FLOPs against sequence length", "sequence length T (tokens)", "FLOPs per forward", True, True),
    "memory": (
        "Decoding state against context length (fp32, batch 1)",
        "context length S (tokens)",
        "bytes",
        True,
        True,
    ),
}
SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "cross"]


def _check(results, metric: str):
    if not isinstance(results, dict) or not results:
        raise ValueError(
            f"results must be a non-empty dict {{metric: {{architecture: (xs, ys)}}}}, got {type(results).__name__}"
        )
    unknown = [m for m in results if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metrics {unknown}: results keys must be among {list(METRICS)}")
    if metric not in results:
        raise ValueError(f"metric must be one of the measured {list(results)}, got {metric!r}")
    for name, series in results[metric].items():
        xs, ys = series
        if len(xs) != len(ys) or not xs:
            raise ValueError(
                f"results[{metric!r}][{name!r}] must be (xs, ys) of one non-zero length, got {len(xs)} and {len(ys)}"
            )
        for y in ys:
            vs = list(y) if isinstance(y, (list, tuple)) else [y]
            if not vs or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vs):
                raise ValueError(
                    f"results[{metric!r}][{name!r}] ys must be numbers or non-empty lists of numbers "
                    f"(one per seed), got {y!r}"
                )


def _spread(ys) -> tuple[list[float], dict | None]:
    """Each y's mean over its seeds, and plotly error bars from the lowest seed to the highest (None
    where every y is a single number)."""
    seeds = [list(y) if isinstance(y, (list, tuple)) else [y] for y in ys]
    mean = [float(f"{sum(v) / len(v):.4g}") for v in seeds]
    if all(len(v) == 1 for v in seeds):
        return mean, None
    return mean, dict(
        type="data",
        symmetric=False,
        array=[float(f"{max(v) - m:.4g}") for v, m in zip(seeds, mean)],
        arrayminus=[float(f"{m - min(v):.4g}") for v, m in zip(seeds, mean)],
    )


def compare_figure(
    results: dict,
    metric: str = "recall",
    *,
    overlay: dict | None = None,
    label: str | None = None,
    overlay_label: str = "this page's run",
) -> go.Figure:
    """One metric, one line per architecture at the mean over its seeds, a bar from the lowest seed
    to the highest (values rounded to 4 significant digits); `overlay`'s lines dotted beside them,
    where it measured the metric. Trace names: the architecture, then `label` or `overlay_label` in
    brackets (the architecture alone where `label` is None)."""
    _check(results, metric)
    title, x_title, y_title, x_log, y_log = METRICS[metric]
    fig = go.Figure()
    for i, (name, (xs, ys)) in enumerate(results[metric].items()):
        mean, bars = _spread(ys)
        fig.add_scatter(
            x=list(xs),
            y=mean,
            name=name if label is None else f"{name} ({label})",
            mode="lines+markers",
            line=dict(color=OKABE_ITO[i % len(OKABE_ITO)]),
            marker=dict(symbol=SYMBOLS[i % len(SYMBOLS)], size=9),
            error_y=bars,
            legendgroup=name,
        )
    if overlay is not None and metric in overlay:
        _check(overlay, metric)
        colour = {name: OKABE_ITO[i % len(OKABE_ITO)] for i, name in enumerate(results[metric])}
        for i, (name, (xs, ys)) in enumerate(overlay[metric].items()):
            mean, bars = _spread(ys)
            fig.add_scatter(
                x=list(xs),
                y=mean,
                name=f"{name} ({overlay_label})",
                mode="lines+markers",
                line=dict(color=colour.get(name, OKABE_ITO[i % len(OKABE_ITO)]), dash="dot", width=1.5),
                marker=dict(symbol=SYMBOLS[i % len(SYMBOLS)], size=6, opacity=0.6),
                error_y=bars,
                legendgroup=name,
            )
    fig.update_layout(
        title=title,
        xaxis_title=x_title,
        yaxis_title=y_title,
        height=420,
        xaxis_type="log" if x_log else "linear",
        yaxis_type="log" if y_log else "linear",
        legend_title_text="architecture",
    )
    if not y_log:
        fig.update_yaxes(range=[0, 1.02])
    return fig


class CompareView:
    """Live face: a menu of the measured metrics above the figure, redrawn in place."""

    def __init__(
        self,
        results: dict,
        metric: str | None = None,
        *,
        overlay: dict | None = None,
        label: str | None = None,
        overlay_label: str = "this page's run",
    ):
        import ipywidgets as W

        if metric is None and isinstance(results, dict) and results:
            metric = next(iter(results))  # the first measured metric
        _check(results, metric)
        if overlay is not None:
            for m in overlay:
                _check(overlay, m)
        self.results, self.overlay = results, overlay
        self._labels = dict(label=label, overlay_label=overlay_label)
        self.menu = W.Dropdown(
            options=[(METRICS[m][0], m) for m in results],
            value=metric,
            description="measurement",
            style={"description_width": "initial"},
            layout=W.Layout(width="640px"),
        )
        self.figure = go.FigureWidget(self._figure(metric))
        self.menu.observe(self._on_change, names="value")
        self.controls = {"metric": self.menu}
        self.widget = W.VBox([self.menu, self.figure])

    def figure_for(self, name: str, value) -> go.Figure:
        """The figure drawn once the menu (`name="metric"`) shows `value`, the widget untouched."""
        if name != "metric":
            raise ValueError(f"name must be 'metric' (the measurement menu), got {name!r}")
        _check(self.results, value)
        return self._figure(value)

    def _figure(self, metric: str) -> go.Figure:
        return compare_figure(self.results, metric, overlay=self.overlay, **self._labels).update_layout(width=900)

    def _on_change(self, change) -> None:
        new = self.figure_for("metric", change["new"])
        if len(new.data) == len(self.figure.data):
            redraw(self.figure, new)
            return
        # an overlay covers some metrics only: the number of traces changes, so replace them
        with self.figure.batch_update():
            self.figure.data = ()
            self.figure.add_traces(list(new.data))
            self.figure.layout.update(new.layout.to_plotly_json(), overwrite=True)

    def _repr_mimebundle_(self, **kwargs):
        return live_mimebundle(self.widget, "CompareView", **kwargs)


def _per_seed(label, values) -> dict[int, list[float]]:
    """{x: [one value per seed]} from {x: value or [values]}; x may be an int or its string."""
    if not isinstance(values, dict) or not values:
        raise ValueError(f"lines[{label!r}] must be a non-empty dict {{x: value or [one per seed]}}, got {values!r}")
    out = {}
    for x, v in values.items():
        vs = list(v) if isinstance(v, (list, tuple)) else [v]
        if not vs or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in vs):
            raise ValueError(f"lines[{label!r}][{x!r}] must be a number or a non-empty list of numbers, got {v!r}")
        try:
            out[int(x)] = [float(a) for a in vs]
        except (TypeError, ValueError):
            raise ValueError(f"lines[{label!r}] keys must be integers (or their strings), got {x!r}") from None
    return out


def seed_range_figure(
    lines: dict,
    *,
    title: str,
    x_title: str,
    y_title: str = "answer accuracy",
    log_x: bool = False,
    styles: dict | None = None,
) -> go.Figure:
    """One line per entry of `lines` ({label: {x: value, or [one value per seed]}}): the mean over the
    seeds, with a bar from the lowest seed to the highest where there are several. `styles` gives a
    label its plotly line style (dict(color=..., dash=...)). Values are rounded to 3 decimals."""
    if not isinstance(lines, dict) or not lines:
        raise ValueError(f"lines must be a non-empty dict {{label: {{x: value or [one per seed]}}}}, got {lines!r}")
    styles = styles or {}
    fig = go.Figure()
    for i, (label, values) in enumerate(lines.items()):
        seeds = _per_seed(label, values)
        xs = sorted(seeds)
        mean = [sum(seeds[x]) / len(seeds[x]) for x in xs]
        spread = any(len(seeds[x]) > 1 for x in xs)
        fig.add_scatter(
            x=xs,
            y=[round(m, 3) for m in mean],
            name=label,
            mode="lines+markers",
            line=styles.get(label, dict(color=OKABE_ITO[i % len(OKABE_ITO)])),
            marker=dict(symbol=SYMBOLS[i % len(SYMBOLS)], size=8),
            error_y=dict(
                type="data",
                symmetric=False,
                array=[round(max(seeds[x]) - m, 3) for x, m in zip(xs, mean)],
                arrayminus=[round(m - min(seeds[x]), 3) for x, m in zip(xs, mean)],
            )
            if spread
            else None,
        )
    fig.update_layout(
        title=title,
        xaxis_title=x_title,
        yaxis_title=y_title,
        xaxis_type="log" if log_x else "linear",
        yaxis_range=[0, 1.05],
        height=420,
    )
    return fig
