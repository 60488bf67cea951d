"""Router view: where a mixture-of-experts router sends its tokens, and how the per-expert load
moves over training, for runs that differ by the load-balancing coefficient α (lesson 07).

The widget draws numbers; it computes none. The lesson trains with `lib.moe_lm.train_moe_lm` and
passes each run's record as plain data (or the record itself: anything with the same attributes):

    runs = {"α = 0": {"load": rec0.load, "loss": rec0.loss, "aux_loss": rec0.aux_loss},
            "α = 0.01": rec1}                     # load (steps, L, E); loss, aux_loss (steps,)
    router_figure(runs, run="α = 0.01")           # static face: frames over steps, play and slider
    RouterView(runs).widget                       # live face: run and layer dropdowns, step slider

A run may also hold "assignments" (S, n_tokens) or (S, L, n_tokens): the expert each token of a
fixed probe batch was sent to first, at the steps "assignment_steps" (S,); and "tokens", the
probe's token strings, written on the strip's cells in 16 px, black or white against each cell's
colour (blanks as ␣ and ↵; a token longer
than two characters cut to its first and "…", whole in the hover text) so that a projected page
reads without hovering. The strip shows the sampled step nearest at or before the current one (or
the first sample, before it).

Dimensions: S steps, L MoE layers, E experts. Load is the share of a layer's routed assignments
each expert got, so an even router puts 1/E on every expert (the dashed line). One y-scale for
every run and frame, so α's effect is seen in the heights; every value is in the hover text.
"""

from __future__ import annotations

import html
from typing import Mapping

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from widgets._base import as_array, rounded
from widgets._render import OKABE_ITO, live_mimebundle, redraw

__all__ = ["RouterView", "balance_figure", "check_router_runs", "router_figure"]

MAX_FRAMES = 40  # animation frames in the static figure: enough to watch, small enough for a page
MAX_LINE_POINTS = 500  # over-training curves are drawn at most this many steps (evenly strided)
STRIP_WIDTH = 32  # probe tokens per row of the assignment strip
LABEL_FONT = 16  # px: the probe's characters, readable on a projector without hovering
LABEL_RISE = 0.28  # a character sits this far (in cell heights) above its cell's centre, the expert id at it
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥"}  # blanks drawn as visible marks
# Okabe-Ito with grey for black: the strip's dark digits must stay readable on every expert's colour
EXPERT_COLOURS = OKABE_ITO[:7] + ["#999999"]
DASHES = ["solid", "dash", "dot", "dashdot"]  # with E > 8 colours repeat; the dash tells lines apart
RECORD_KEYS = ("load", "loss", "aux_loss", "assignments", "assignment_steps", "tokens")


def _as_record(name: str, run) -> dict:
    """A mapping, or a record object with the same attributes (e.g. lib.moe_lm.MoETrainRecord)."""
    if isinstance(run, Mapping):
        return dict(run)
    if hasattr(run, "load"):
        return {k: getattr(run, k) for k in RECORD_KEYS if getattr(run, k, None) is not None}
    raise ValueError(f"runs[{name!r}] must be a dict with keys 'load', 'loss', 'aux_loss', got {type(run).__name__}")


def _check_assignments(name: str, rec: dict, S: int, L: int, E: int) -> dict:
    if "assignment_steps" in rec and "assignments" not in rec:
        raise ValueError(f"runs[{name!r}] has 'assignment_steps' but no 'assignments'")
    if "assignments" not in rec:
        return {}
    a = as_array(f"runs[{name!r}]['assignments']", rec["assignments"])
    if a.ndim == 2:
        a = a[:, None, :]  # (S', n) -> (S', 1, n): one layer's routing
    if a.ndim != 3 or a.shape[1] not in (1, L) or a.shape[0] < 1 or a.shape[2] < 1:
        raise ValueError(
            f"runs[{name!r}]['assignments'] must have shape (S', n_tokens) or (S', L={L}, n_tokens), "
            f"got {tuple(np.shape(rec['assignments']))}"
        )
    if (a != np.round(a)).any() or a.min() < 0 or a.max() > E - 1:
        raise ValueError(f"runs[{name!r}]['assignments'] must be expert ids, ints in [0, {E - 1}]")
    if "assignment_steps" in rec:
        steps = as_array(f"runs[{name!r}]['assignment_steps']", rec["assignment_steps"])
    elif a.shape[0] == S:
        steps = np.arange(S, dtype=np.float64)
    else:
        raise ValueError(f"runs[{name!r}] has {a.shape[0]} assignment rows for {S} steps: give 'assignment_steps'")
    if steps.shape != (a.shape[0],):
        raise ValueError(
            f"runs[{name!r}]['assignment_steps'] must have shape ({a.shape[0]},), one step per "
            f"assignments row, got {steps.shape}"
        )
    if (steps != np.round(steps)).any() or steps.min() < 0 or steps.max() > S - 1 or (np.diff(steps) <= 0).any():
        raise ValueError(f"runs[{name!r}]['assignment_steps'] must be increasing step indices in [0, {S - 1}]")
    tokens = rec.get("tokens")
    if tokens is not None:
        tokens = [str(t) for t in tokens]
        if len(tokens) != a.shape[2]:
            raise ValueError(f"runs[{name!r}]['tokens'] must name the {a.shape[2]} probe tokens, got {len(tokens)}")
    return {"assignments": a.astype(np.int64), "assignment_steps": steps.astype(np.int64), "tokens": tokens}


def check_router_runs(runs: Mapping[str, Mapping]) -> dict[str, dict]:
    """Validate and convert to numpy: every run has load (S, L, E) >= 0 and loss, aux_loss (S,),
    all finite; one (L, E) for every run (S may differ); optional assignments as documented above."""
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError(
            "runs must be a non-empty mapping label -> {'load': (steps, L, E), 'loss': (steps,), 'aux_loss': (steps,)}"
        )
    out, le = {}, None
    for name, run in runs.items():
        rec = _as_record(name, run)
        missing = [k for k in ("load", "loss", "aux_loss") if k not in rec]
        if missing:
            raise ValueError(f"runs[{name!r}] is missing {missing}: it needs 'load', 'loss' and 'aux_loss'")
        load = as_array(f"runs[{name!r}]['load']", rec["load"])
        if load.ndim != 3 or 0 in load.shape:
            raise ValueError(
                f"runs[{name!r}]['load'] must have shape (steps, L, E), all >= 1, got {load.shape}"
                + (" (one layer? add an axis: load[:, None, :])" if load.ndim == 2 else "")
            )
        if (load < 0).any():
            raise ValueError(f"runs[{name!r}]['load'] holds negative loads: a load is a share of assignments, >= 0")
        S, L, E = load.shape
        curves = {}
        for key in ("loss", "aux_loss"):
            curves[key] = as_array(f"runs[{name!r}][{key!r}]", rec[key])
            if curves[key].shape != (S,):
                raise ValueError(
                    f"runs[{name!r}][{key!r}] must have shape (steps,) = ({S},) to match 'load' "
                    f"{load.shape}, got {curves[key].shape}: steps mismatch"
                )
        if le is not None and (L, E) != le:
            raise ValueError(f"every run must have one (L, E); {name!r} has {(L, E)}, another {le}")
        le = (L, E)
        out[str(name)] = {"load": load, **curves, **_check_assignments(name, rec, S, L, E)}
    return out


def _frame_steps(S: int, step: int) -> list[int]:
    """At most MAX_FRAMES steps, evenly spread from first to last, always including `step`."""
    picks = sorted(set(np.linspace(0, S - 1, min(S, MAX_FRAMES)).round().astype(int).tolist()))
    if step not in picks:
        picks[int(np.argmin([abs(p - step) for p in picks]))] = step
    return sorted(set(picks))


def _sampled_row(rec: dict, step: int) -> int:
    """The assignment row for `step`: the last sample at or before it, else the first."""
    return max(int(np.searchsorted(rec["assignment_steps"], step, side="right")) - 1, 0)


def _strip(rec: dict | None, layer: int, step: int) -> dict:
    """Heatmap fields for the probe strip: expert id per token, wrapped STRIP_WIDTH to a row."""
    if rec is None or "assignments" not in rec:
        return {"z": [[None]], "text": [[""]], "customdata": [[""]]}
    a = rec["assignments"][_sampled_row(rec, step), min(layer, rec["assignments"].shape[1] - 1)]  # (n,)
    n, rows = a.size, -(-a.size // STRIP_WIDTH)
    tokens = rec["tokens"] or [f"#{i}" for i in range(n)]
    z, text, hover = [], [], []
    for r in range(rows):
        ids = a[r * STRIP_WIDTH : (r + 1) * STRIP_WIDTH].tolist()
        pad = STRIP_WIDTH - len(ids) if rows > 1 else 0
        z.append(ids + [None] * pad)
        text.append([str(e) for e in ids] + [""] * pad)
        hover.append(
            [f"token {r * STRIP_WIDTH + i} {tokens[r * STRIP_WIDTH + i]!r}" for i in range(len(ids))] + [""] * pad
        )
    return {"z": z, "text": text, "customdata": hover}


def _label(token: str) -> str:
    """A probe token as at most two glyphs that plotly draws literally: blanks made visible,
    longer tokens cut (the whole token is in the hover text), HTML's special characters escaped."""
    shown = "".join(VISIBLE.get(c, c) for c in token) or "∅"
    if len(shown) > 2:
        shown = shown[0] + "…"
    return html.escape(shown, quote=False)


def _ink(background: str) -> str:
    """Black or white, whichever contrasts more with a "#rrggbb" background (WCAG luminance)."""
    channels = [int(background[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "#000000" if (luminance + 0.05) / 0.05 >= 1.05 / (luminance + 0.05) else "#ffffff"


def _strip_labels(rec: dict | None, layer: int, step: int, colours: list[str]) -> dict:
    """Scatter fields for the probe's characters: one label per cell, in the upper part of the cell
    (the expert id is at its centre), in black or white against the cell's colour at this step. No
    labels without recorded tokens: the x axis numbers the cells."""
    if rec is None or "assignments" not in rec or not rec.get("tokens"):
        return {"x": [], "y": [], "text": [], "textfont": {"color": "#000000"}}
    a = rec["assignments"][_sampled_row(rec, step), min(layer, rec["assignments"].shape[1] - 1)]  # (n,)
    positions = np.arange(a.size)
    return {
        "x": (positions % STRIP_WIDTH).tolist(),
        "y": (positions // STRIP_WIDTH - LABEL_RISE).tolist(),
        "text": [_label(t) for t in rec["tokens"]],
        "textfont": {"color": [_ink(colours[e]) for e in a.tolist()]},
    }


def _strip_title(rec: dict | None, layer: int) -> str:
    if rec is None or "assignments" not in rec:
        return "no probe assignments recorded for this run"
    lay = min(layer, rec["assignments"].shape[1] - 1)
    return f"probe tokens: the expert each is sent to first (layer {lay}; the number is the expert id)"


def _title(label: str, rec: dict, layer: int, step: int, with_strip: bool) -> str:
    load_now = rec["load"][step, layer]  # (E,)
    S, E = rec["load"].shape[0], load_now.size
    dead = int((load_now == 0).sum())
    text = (
        f"{label}, layer {layer}, step {step} of {S - 1}: the busiest expert gets "
        f"{load_now.max() * E:.2f}× the even share 1/E; {dead} of {E} expert{'s' if E > 1 else ''} got no token"
    )
    if with_strip and "assignments" in rec:
        text += f"<br>probe tokens as routed at step {int(rec['assignment_steps'][_sampled_row(rec, step)])}"
    return text


def _moving_traces(rec: dict, layer: int, step: int, E: int, ytop: float) -> list:
    """The traces a frame replaces, in figure order: bars, step marker, loss and aux markers."""
    load_now = rec["load"][step, layer]  # (E,)
    bar_text = [f"{v:.3g}" for v in rounded(load_now)]
    return [
        go.Bar(y=rounded(load_now), text=bar_text, customdata=rounded(load_now * E)),
        go.Scatter(x=[step, step], y=[0, ytop], text=[f"step {step}", f"step {step}"]),
        go.Scatter(x=[step], y=rounded(rec["loss"][step : step + 1]), text=[f"{rec['loss'][step]:.3f}"]),
        go.Scatter(x=[step], y=rounded(rec["aux_loss"][step : step + 1]), text=[f"{rec['aux_loss'][step]:.3f}"]),
    ]


def router_figure(
    runs: Mapping[str, Mapping],
    *,
    run: str | None = None,
    layer: int = 0,
    step: int | None = None,
    animate: bool = True,
    _strip_row: bool | None = None,
) -> go.Figure:
    """One run (default: the first): expert load at `step` (default: the last) as bars against the
    even share 1/E; each expert's load over training with a marker at `step`; the loss and aux loss;
    and, if recorded, the probe tokens' experts. `animate` adds up to MAX_FRAMES frames over steps."""
    runs = check_router_runs(runs)
    label = next(iter(runs)) if run is None else run
    if label not in runs:
        raise ValueError(f"run must be one of {list(runs)}, got {run!r}")
    rec = runs[label]
    S, L, E = rec["load"].shape
    for what, value, top in (("layer", layer, L - 1), ("step", S - 1 if step is None else step, S - 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= top:
            raise ValueError(f"{what} must be an int in [0, {top}], got {value!r}")
    layer, step = int(layer), S - 1 if step is None else int(step)
    with_strip = "assignments" in rec if _strip_row is None else _strip_row
    # one scale for every run and step of this layer, so runs and frames compare by height
    ytop = 1.08 * max(max(float(r["load"][:, layer].max()) for r in runs.values()), 1.0 / E)
    loss_range = [
        min(float(r["loss"].min()) for r in runs.values()),
        max(float(r["loss"].max()) for r in runs.values()),
    ]
    aux_range = [
        min(float(r["aux_loss"].min()) for r in runs.values()),
        max(float(r["aux_loss"].max()) for r in runs.values()),
    ]

    rows = 3 if with_strip else 2
    fig = make_subplots(
        rows=rows,
        cols=2,
        vertical_spacing=0.13 if with_strip else 0.16,
        horizontal_spacing=0.1,
        row_heights=[0.45, 0.27, 0.28] if with_strip else [0.6, 0.4],
        specs=[[{}, {}], [{}, {}]] + ([[{"colspan": 2}, None]] if with_strip else []),
        subplot_titles=[
            "expert load at this step (dashed: the even share 1/E)",
            "expert load over training",
            "next-token loss",
            "load-balancing (aux) loss",
        ]
        + ([_strip_title(rec, layer)] if with_strip else []),
    )
    colours = [EXPERT_COLOURS[e % len(EXPERT_COLOURS)] for e in range(E)]
    bars, marker, loss_dot, aux_dot = _moving_traces(rec, layer, step, E, ytop)
    bars.update(
        x=list(range(E)),
        marker_color=colours,
        textposition="outside" if E <= 16 else "none",
        showlegend=False,
        cliponaxis=False,
        hovertemplate="expert %{x}: load %{y:.4g} (%{customdata:.2f}× the even share)<extra></extra>",
    )
    fig.add_trace(bars, row=1, col=1)
    uniform = 1.0 / E
    fig.add_trace(
        go.Scatter(
            x=[-0.5, E - 0.5],
            y=[uniform, uniform],
            mode="lines",
            name=f"even share 1/E = {uniform:.4g}",
            line={"dash": "dash", "color": "#000000", "width": 1.5},
            showlegend=False,
            hovertemplate=f"even share 1/E = {uniform:.4g}<extra></extra>",
        ),
        row=1,
        col=1,
    )
    # over-training curves, strided to at most MAX_LINE_POINTS steps (the last step always kept)
    xs = np.unique(np.r_[np.arange(0, S, -(-S // MAX_LINE_POINTS)), S - 1])
    line_mode = "lines" if S > 1 else "markers"  # a one-step run has no line to draw
    step_range = [0, S - 1] if S > 1 else [-0.5, 0.5]
    for e in range(E):
        dash = DASHES[(e // len(EXPERT_COLOURS)) % len(DASHES)]
        fig.add_trace(
            go.Scatter(
                x=xs.tolist(),
                y=rounded(rec["load"][xs, layer, e]),
                mode=line_mode,
                name=f"expert {e}",
                line={"color": colours[e], "dash": dash, "width": 1.5},
                legendgroup="experts",
                hovertemplate=f"expert {e}, step %{{x}}: load %{{y:.4g}}<extra></extra>",
            ),
            row=1,
            col=2,
        )
    fig.add_trace(
        go.Scatter(
            x=step_range,
            y=[uniform, uniform],
            mode="lines",
            showlegend=False,
            line={"dash": "dash", "color": "#000000", "width": 1.5},
            hovertemplate=f"even share 1/E = {uniform:.4g}<extra></extra>",
        ),
        row=1,
        col=2,
    )
    marker.update(
        mode="lines",
        line={"color": "#555555", "dash": "dot", "width": 1.5},
        showlegend=False,
        hovertemplate="%{text}<extra>current step</extra>",
    )
    fig.add_trace(marker, row=1, col=2)
    for col, key, dot, name, colour in (
        (1, "loss", loss_dot, "loss (nats/token)", OKABE_ITO[0]),
        (2, "aux_loss", aux_dot, "aux loss", OKABE_ITO[5]),
    ):
        fig.add_trace(
            go.Scatter(
                x=xs.tolist(),
                y=rounded(rec[key][xs]),
                mode=line_mode,
                line={"color": colour},
                showlegend=False,
                hovertemplate=f"step %{{x}}: {name} %{{y:.4g}}<extra></extra>",
            ),
            row=2,
            col=col,
        )
        dot.update(
            mode="markers+text",
            textposition="top right",
            cliponaxis=False,
            marker={"color": "#000000", "size": 9, "symbol": "circle-open"},
            showlegend=False,
            hovertemplate=f"step %{{x}}: {name} %{{y:.4g}}<extra>current step</extra>",
        )
        fig.add_trace(dot, row=2, col=col)
    if with_strip:
        fig.add_trace(
            go.Heatmap(
                **_strip(rec, layer, step),
                zmin=-0.5,
                zmax=E - 0.5,
                colorscale=_expert_scale(colours),
                showscale=False,
                xgap=1,
                ygap=1,
                texttemplate="%{text}",
                textfont={"size": LABEL_FONT - 2},
                hovertemplate="%{customdata}: expert %{z}<extra></extra>",
            ),
            row=3,
            col=1,
        )
        # the probe's characters, written on their cells (above the expert id): readable without hover
        labels = go.Scatter(
            **_strip_labels(rec, layer, step, colours),
            mode="text",
            textposition="middle center",
            cliponaxis=False,
            showlegend=False,
            name="probe tokens",
            hoverinfo="skip",
        )
        labels.textfont.size = LABEL_FONT
        fig.add_trace(labels, row=3, col=1)
        fig.update_yaxes(autorange="reversed", showticklabels=False, row=3, col=1)
        fig.update_xaxes(title_text="probe token (position in the batch)", row=3, col=1)

    fig.update_xaxes(
        title_text="expert id", tickmode="linear" if E <= 32 else "auto", range=[-0.5, E - 0.5], row=1, col=1
    )
    fig.update_yaxes(title_text="load (share)", range=[0, ytop], row=1, col=1)
    fig.update_xaxes(title_text="training step", range=step_range, row=1, col=2)
    fig.update_yaxes(title_text="load (share)", range=[0, ytop], row=1, col=2)
    for col, (lo, hi), unit in ((1, loss_range, "nats/token"), (2, aux_range, "aux loss (K when even)")):
        pad = 0.08 * (hi - lo) or 0.05 * abs(hi) or 0.1
        fig.update_yaxes(title_text=unit, range=[lo - pad, hi + 2 * pad], row=2, col=col)
        fig.update_xaxes(title_text="training step", range=step_range, row=2, col=col)
    fig.add_annotation(
        x=E - 0.5,
        y=uniform,
        xref="x",
        yref="y",
        text=f"1/E = {uniform:.3g}",
        showarrow=False,
        xanchor="left",
        yanchor="middle",
        font={"size": 11},
    )  # right of the bars: never over one
    for a in fig.layout.annotations:
        a.font.size = 12
    fig.update_layout(
        title={"text": _title(label, rec, layer, step, with_strip), "font": {"size": 13}},
        height=720 if with_strip else 560,
        plot_bgcolor="white",
        bargap=0.2,
        legend={"title": {"text": "expert"}, "tracegroupgap": 0},
        meta={
            "onemask": "router_view",
            "run": label,
            "runs": list(runs),
            "layer": layer,
            "step": step,
            "shape": [S, L, E],
        },
    )
    if animate and S > 1:
        moving = [0, 2 + E + 1, 2 + E + 3, 2 + E + 5] + ([2 + E + 6, 2 + E + 7] if with_strip else [])  # traces
        frames, slider_steps = [], []
        for s in _frame_steps(S, step):
            data = _moving_traces(rec, layer, s, E, ytop)
            if with_strip:
                strip = _strip(rec, layer, s)
                data.append(go.Heatmap(z=strip["z"], text=strip["text"]))
                # the characters stay; their ink follows the cell's colour
                data.append(go.Scatter(textfont=_strip_labels(rec, layer, s, colours)["textfont"]))
            frames.append(
                go.Frame(
                    name=str(s),
                    data=data,
                    traces=moving,
                    layout={"title": {"text": _title(label, rec, layer, s, with_strip)}},
                )
            )
            slider_steps.append(
                {
                    "label": str(s),
                    "method": "animate",
                    "args": [[str(s)], {"mode": "immediate", "frame": {"duration": 0, "redraw": True}}],
                }
            )
        fig.frames = frames
        fig.update_layout(
            sliders=[
                {
                    "active": [f.name for f in frames].index(str(step)),
                    "steps": slider_steps,
                    "currentvalue": {"prefix": "training step: ", "font": {"size": 12}},
                    "x": 0.08,
                    "len": 0.92,
                    "y": 0,
                    "yanchor": "top",
                    "pad": {"t": 50},
                    "font": {"size": 9},
                }
            ],
            updatemenus=[
                {
                    "type": "buttons",
                    "showactive": False,
                    "x": 0.08,
                    "y": 0,
                    "xanchor": "right",
                    "yanchor": "top",
                    "pad": {"t": 62, "r": 10},
                    "buttons": [
                        {
                            "label": "▶ play",
                            "method": "animate",
                            "args": [None, {"frame": {"duration": 250, "redraw": True}, "fromcurrent": False}],
                        }
                    ],
                }
            ],
            height=(720 if with_strip else 560) + 100,
        )
        fig.layout.meta["frame_steps"] = [int(f.name) for f in frames]
    return fig


def _expert_scale(colours: list[str]) -> list:
    """A discrete colour scale: expert e's colour on [e - 0.5, e + 0.5] of zmin..zmax."""
    n, scale = len(colours), []
    for e, c in enumerate(colours):
        scale += [[e / n, c], [(e + 1) / n, c]]
    return scale


class RouterView:
    """Live face: a dropdown for the run (when there are several), one for the layer (when L > 1),
    and the training-step slider last; the figure is redrawn in place."""

    def __init__(self, runs: Mapping[str, Mapping], *, run: str | None = None, layer: int = 0, step: int = 0):
        import ipywidgets as W

        self.runs = check_router_runs(runs)
        self.strip = any("assignments" in r for r in self.runs.values())  # one trace layout for every run
        label = next(iter(self.runs)) if run is None else run
        first = router_figure(self.runs, run=label, layer=layer, step=step, animate=False, _strip_row=self.strip)
        S, L, _ = self.runs[label]["load"].shape
        style = {"description_width": "initial"}
        self.controls = {}
        if len(self.runs) > 1:
            self.controls["run"] = W.Dropdown(options=list(self.runs), value=label, description="run", style=style)
        if L > 1:
            self.controls["layer"] = W.Dropdown(
                options=[(f"layer {i}", i) for i in range(L)], value=layer, description="MoE layer", style=style
            )
        self.controls["step"] = W.IntSlider(
            value=step,
            min=0,
            max=S - 1,
            description="training step",
            style=style,
            continuous_update=True,
            layout={"width": "60%"},
        )
        for c in self.controls.values():
            c.observe(self._on_change, names="value")
        self.figure = go.FigureWidget(first)
        dropdowns = [c for k, c in self.controls.items() if k != "step"]
        self.widget = W.VBox(([W.HBox(dropdowns)] if dropdowns else []) + [self.controls["step"], self.figure])

    @property
    def state(self) -> dict:
        c = self.controls
        return {
            "run": c["run"].value if "run" in c else next(iter(self.runs)),
            "layer": c["layer"].value if "layer" in c else 0,
            "step": c["step"].value,
        }

    def _on_change(self, change) -> None:
        slider = self.controls["step"]
        if change["owner"] is self.controls.get("run"):  # runs may differ in length: keep the step in range
            S = self.runs[change["new"]]["load"].shape[0]
            with slider.hold_trait_notifications():
                slider.value = min(slider.value, S - 1)
                slider.max = S - 1
        s = self.state
        self.show(s["run"], s["layer"], s["step"])

    def figure_for(self, name: str, value) -> go.Figure:
        """The figure drawn once control `name` ("run", "layer" or "step") is at `value`, the
        others as they are (a shorter run's last step where the step is beyond it), computed
        afresh, the widget untouched."""
        if name not in self.controls:
            raise ValueError(f"name must be one of this widget's controls {sorted(self.controls)}, got {name!r}")
        options = self.controls[name].options if name != "step" else None
        if options is not None and value not in [o[1] if isinstance(o, tuple) else o for o in options]:
            raise ValueError(f"value must be one of the {name} menu's values, got {value!r}")
        s = dict(self.state, **{name: value})
        s["step"] = min(s["step"], self.runs[s["run"]]["load"].shape[0] - 1)
        return router_figure(
            self.runs, run=s["run"], layer=s["layer"], step=s["step"], animate=False, _strip_row=self.strip
        )

    def show(self, run: str, layer: int, step: int) -> None:
        """Redraw for `run`, `layer` and training step `step` (0-based)."""
        redraw(
            self.figure, router_figure(self.runs, run=run, layer=layer, step=step, animate=False, _strip_row=self.strip)
        )

    def _repr_mimebundle_(self, **kwargs):
        return live_mimebundle(self.widget, "RouterView", **kwargs)


def balance_figure(curves: Mapping[str, Mapping], *, title: str | None = None) -> go.Figure:
    """Load f and mean router probability P, drawn apart: for each run, the busiest expert's load
    over the even share (left) and the largest mean probability over the even share (right), over
    training. A layer's aux loss E·Σ f_i P_i reads its even value K whenever its P is flat (right
    panel at 1), whatever f does (left panel); pooled over layers (Hugging Face's form), opposite
    imbalances of two layers cancel too. The two panels show whether the balance is real.

    curves: label -> {"steps": (n,), "busiest": (n,), "busiest_prob": (n,)}, each value >= 1
    (a maximum over E shares that sum to 1 is at least 1/E; 1 = even). A run may be given as its
    record (lib.moe_lm.MoETrainRecord: `imbalance` and `prob_imbalance` are used, every step)."""
    if not isinstance(curves, Mapping) or not curves:
        raise ValueError("curves must be a non-empty mapping label -> {'steps', 'busiest', 'busiest_prob'}")
    checked = {}
    for name, c in curves.items():
        if not isinstance(c, Mapping) and hasattr(c, "prob_imbalance"):
            c = {"steps": list(range(len(c.imbalance))), "busiest": c.imbalance, "busiest_prob": c.prob_imbalance}
        if not isinstance(c, Mapping) or any(k not in c for k in ("steps", "busiest", "busiest_prob")):
            raise ValueError(f"curves[{name!r}] must be a dict with 'steps', 'busiest' and 'busiest_prob'")
        arrays = {k: as_array(f"curves[{name!r}][{k!r}]", c[k]) for k in ("steps", "busiest", "busiest_prob")}
        n = arrays["steps"].shape
        if len(n) != 1 or n[0] < 1 or any(a.shape != n for a in arrays.values()):
            raise ValueError(
                f"curves[{name!r}]: 'steps', 'busiest' and 'busiest_prob' must be 1-D of one length "
                f"(>= 1), got {[a.shape for a in arrays.values()]}"
            )
        if (arrays["busiest"] < 1 - 1e-6).any() or (arrays["busiest_prob"] < 1 - 1e-6).any():
            raise ValueError(f"curves[{name!r}]: a busiest share over the even share is >= 1, got a smaller value")
        checked[str(name)] = arrays
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.1,
        subplot_titles=["load f: busiest expert / even share", "router probability P: largest mean / even"],
    )
    top = 1.05 * max(max(a["busiest"].max(), a["busiest_prob"].max()) for a in checked.values())
    for i, (name, a) in enumerate(checked.items()):
        colour, dash = OKABE_ITO[i % len(OKABE_ITO)], DASHES[(i // len(OKABE_ITO)) % len(DASHES)]
        mode = "lines" if a["steps"].size > 1 else "markers"
        for col, key, what in ((1, "busiest", "busiest f"), (2, "busiest_prob", "largest P")):
            fig.add_trace(
                go.Scatter(
                    x=a["steps"].tolist(),
                    y=rounded(a[key]),
                    mode=mode,
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    line={"color": colour, "dash": dash, "width": 2},
                    hovertemplate=f"{name}, step %{{x}}: {what} %{{y:.3g}}× even<extra></extra>",
                ),
                row=1,
                col=col,
            )
    for col in (1, 2):
        fig.add_hline(y=1.0, line={"dash": "dash", "color": "#000000", "width": 1.5}, row=1, col=col)
        fig.update_yaxes(title_text="× the even share (1 = even)", range=[0.9, top], row=1, col=col)
        fig.update_xaxes(title_text="training step", row=1, col=col)
    fig.update_layout(
        title={"text": title or "Balanced in the loss's eyes (P) or in fact (f)?", "font": {"size": 13}},
        height=420,
        plot_bgcolor="white",
        legend={"title": {"text": "run"}},
        meta={"onemask": "balance_figure", "runs": list(checked)},
    )
    return fig
