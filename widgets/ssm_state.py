"""SSM state animator: the hidden state h_t (channels × state size) and the step size Δ_t of a
state-space scan, token by token, for several runs side by side (lesson 06: selective vs not).

The widget draws numbers; it computes none. The lesson runs `lib.mamba` on a sequence, records the
states and step sizes of each run, and passes them here:

    runs = {"selective": (h, delta), "fixed Δ, B, C": (h2, delta2)}   # h (L, D, N), delta (L, D)
    ssm_state_figure(tokens, runs)          # static face: frames over t, play button and slider
    masked_attention_figure(tokens, decay, weights)   # the same layer as a masked attention (lib.ssd)
    SSMStateView(tokens, runs, recompute=fn).widget   # live face: a step slider (and, given
                                                      # `recompute(text) -> (tokens, runs)`, a text box)

Under each run, Δ over the whole sequence for a few channels (`delta_channels`, by default the
four whose Δ varies most in the first run), the tokens on the x axis and the current step marked:
where a selective model slows down or speeds up is read off as the play button moves. The Δ_t bars
above colour those channels as their lines.

Colours: one diverging scale per figure, symmetric about 0 and fixed across frames, so a state
that fades is seen to fade; it spans the 98th percentile of |h| (rarer, larger entries saturate);
every cell's value is in its hover text, never colour alone.
"""

from __future__ import annotations

import html
from typing import Callable, Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from widgets._base import as_array, rounded
from widgets._render import DIVERGING, MASKED_COLOUR, OKABE_ITO, OPEN_COLOUR, SEQUENTIAL, live_mimebundle, redraw

__all__ = ["SSMStateView", "check_runs", "masked_attention_figure", "pick_delta_channels", "ssm_state_figure"]

MAX_STEPS = 512  # frames beyond this make the static figure too heavy for a page
DELTA_CHANNELS = 4  # channels drawn over the whole sequence: few enough to tell the lines apart
DELTA_COLOURS = [OKABE_ITO[i] for i in (0, 5, 2, 3, 1, 4)]  # one per shown channel, colour-blind safe
DASHES = ["solid", "dash", "dot", "dashdot"]  # and a dash, so no line is told apart by colour alone
TICK_FONT = 14  # px: the token labels under the Δ panel, readable on a projector without hovering
PAGE_WIDTH = 760  # px of plotting width assumed when choosing how many token labels fit


def check_runs(tokens: Sequence[str], runs: Mapping[str, tuple]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Validate and convert: every run is (h (L, D, N), delta (L, D)) with one L = len(tokens) and one D."""
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError("runs must be a non-empty mapping name -> (h (L, D, N), delta (L, D))")
    tokens = [str(t) for t in tokens]
    L = len(tokens)
    if not 1 <= L <= MAX_STEPS:
        raise ValueError(f"tokens must hold 1..{MAX_STEPS} tokens, got {L}")
    out, shape = {}, None
    for name, run in runs.items():
        if not (isinstance(run, (tuple, list)) and len(run) == 2):
            raise ValueError(f"runs[{name!r}] must be a pair (h (L, D, N), delta (L, D))")
        h, delta = as_array(f"runs[{name!r}] h", run[0]), as_array(f"runs[{name!r}] delta", run[1])
        if h.ndim != 3 or h.shape[0] != L:
            raise ValueError(f"runs[{name!r}] h must have shape (L={L}, D, N), got {h.shape}")
        if delta.shape != h.shape[:2]:
            raise ValueError(f"runs[{name!r}] delta must have shape (L, D) = {h.shape[:2]}, got {delta.shape}")
        if shape is not None and h.shape != shape:
            raise ValueError(f"every run must have one shape (L, D, N); {name!r} has {h.shape}, another {shape}")
        shape = h.shape
        out[str(name)] = (h, delta)
    return out


def _sequence_text(tokens: list[str], t: int) -> str:
    shown = [f"<b>[{tok}]</b>" if i == t else tok for i, tok in enumerate(tokens)]
    lo = max(0, t - 20)
    return ("… " if lo else "") + " ".join(shown[lo : t + 21]) + (" …" if t + 21 < len(tokens) else "")


def pick_delta_channels(runs: Mapping[str, tuple], n: int = DELTA_CHANNELS) -> list[int]:
    """The `n` channels (at most D) whose Δ varies most over the sequence in the first run, in
    channel order: where a selective model's step size follows the token (ties: lower index)."""
    delta = as_array("delta", next(iter(runs.values()))[1])  # (L, D)
    spread = delta.std(axis=0)  # (D,)
    order = sorted(range(spread.size), key=lambda d: (-spread[d], d))
    return sorted(order[: min(n, spread.size)])


def _check_channels(channels, D: int) -> list[int]:
    chans = [int(c) for c in channels] if channels is not None else []
    if (
        not chans
        or len(set(chans)) != len(chans)
        or len(chans) > len(DELTA_COLOURS)
        or any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c < D for c in channels)
    ):
        raise ValueError(
            f"delta_channels must be 1..{len(DELTA_COLOURS)} distinct channel indices in [0, {D - 1}], got {channels!r}"
        )
    return chans


def _token_ticks(tokens: list[str], n_cols: int) -> dict:
    """Every token as a tick label on the Δ panel's x axis, or every k-th one when they would not
    fit side by side at TICK_FONT px in a panel's share of PAGE_WIDTH (the hover names every token)."""
    longest = max(len(t) for t in tokens)
    room = PAGE_WIDTH / n_cols / (0.62 * TICK_FONT * longest + 5)  # labels that fit across one panel
    stride = max(1, -(-len(tokens) // max(int(room), 1)))
    ticks = list(range(0, len(tokens), stride))
    return {
        "tickmode": "array",
        "tickvals": ticks,
        "ticktext": [html.escape(tokens[i], quote=False) for i in ticks],
        "tickfont": {"size": TICK_FONT},
        "tickangle": 0,
    }


def _frame_traces(runs: dict, t: int, chans: list[int], bottom: float, top: float) -> list:
    """The traces a frame replaces, in order: each run's state and Δ_t bars, then each run's
    current-step line and dots on the Δ panel."""
    traces = []
    for h, delta in runs.values():
        traces.append(go.Heatmap(z=rounded(h[t])))  # (D, N)
        traces.append(go.Bar(y=rounded(delta[t])))  # (D,)
    for _, delta in runs.values():
        traces.append(go.Scatter(x=[t, t], y=[bottom, top]))
        traces.append(go.Scatter(x=[t] * len(chans), y=rounded(delta[t, chans])))
    return traces


def ssm_state_figure(
    tokens: Sequence[str],
    runs: Mapping[str, tuple],
    *,
    step: int | None = None,
    animate: bool = True,
    delta_channels: Sequence[int] | None = None,
) -> go.Figure:
    """h_t as a (D × N) heatmap over Δ_t per channel, one column per run, and below them Δ over the
    whole sequence for a few channels (`delta_channels`, default `pick_delta_channels`: at most
    four), tokens on the x axis, the current step marked. `step` (default: the last token) is shown
    first; `animate` adds one frame per token with a play button and slider."""
    tokens = [str(t) for t in tokens]
    runs = check_runs(tokens, runs)
    L, D, N = next(iter(runs.values()))[0].shape
    t = L - 1 if step is None else step
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < L:
        raise ValueError(f"step must be an int in [0, {L - 1}], got {step!r}")
    t = int(t)
    chans = _check_channels(pick_delta_channels(runs) if delta_channels is None else delta_channels, D)
    names = list(runs)
    # one scale for every frame and run, set by the 98th percentile of |h|: a few large entries would
    # otherwise wash every other cell out to the middle colour (they saturate; hover gives the value)
    zmax = float(np.percentile(np.abs(np.concatenate([h.ravel() for h, _ in runs.values()])), 98)) or 1.0
    dmax = max(float(d.max()) for _, d in runs.values()) or 1.0
    shown_deltas = np.stack([d[:, chans] for _, d in runs.values()])  # (runs, L, channels shown)
    lo, hi = float(shown_deltas.min()), float(shown_deltas.max())
    # Δ spans decades across channels (softplus of a log-uniform init): a log axis keeps every line
    # readable; a linear one when the values are close or not all positive
    log = lo > 0 and hi / lo > 10
    bottom, top = (lo / 1.25, hi * 1.25) if log else (min(lo, 0.0), 1.08 * hi or 1.0)  # the Δ panel's range
    fig = make_subplots(
        rows=3,
        cols=len(names),
        row_heights=[0.46, 0.2, 0.34],
        vertical_spacing=0.12,
        horizontal_spacing=0.08,
        subplot_titles=[f"{n}: state h_t" for n in names]
        + [f"{n}: step size Δ_t" for n in names]
        + [f"{n}: Δ over the tokens" for n in names],
    )
    bar_colours = ["#BBBBBB"] * D  # a shown channel's bar takes its line's colour
    for i, c in enumerate(chans):
        bar_colours[c] = DELTA_COLOURS[i]
    for col, (name, (h, delta)) in enumerate(runs.items(), start=1):
        fig.add_trace(
            go.Heatmap(
                z=rounded(h[t]),
                zmin=-zmax,
                zmax=zmax,
                zmid=0,
                colorscale=DIVERGING,
                showscale=col == len(names),
                colorbar={"title": {"text": "h"}, "len": 0.45, "y": 0.78},
                hovertemplate="channel %{y}, state %{x}: h = %{z:.3f}<extra>" + name + "</extra>",
            ),
            row=1,
            col=col,
        )
        fig.add_trace(
            go.Bar(
                y=rounded(delta[t]),
                marker_color=bar_colours,
                showlegend=False,
                hovertemplate="channel %{x}: Δ = %{y:.3f}<extra>" + name + "</extra>",
            ),
            row=2,
            col=col,
        )
        fig.update_yaxes(title_text="channel d" if col == 1 else None, autorange="reversed", row=1, col=col)
        fig.update_xaxes(title_text="state index n", row=1, col=col)
        fig.update_yaxes(range=[0, dmax * 1.05], title_text="Δ" if col == 1 else None, row=2, col=col)
        fig.update_xaxes(title_text="channel d", row=2, col=col)
    mode = "lines+markers" if L <= 64 else "lines"
    ticks = _token_ticks(tokens, len(names))
    for col, (name, (_, delta)) in enumerate(runs.items(), start=1):
        for i, c in enumerate(chans):
            fig.add_trace(
                go.Scatter(
                    x=list(range(L)),
                    y=rounded(delta[:, c]),
                    mode=mode,
                    name=f"channel {c}",
                    legendgroup=f"channel {c}",
                    showlegend=col == 1,
                    customdata=tokens,
                    line={"color": DELTA_COLOURS[i], "dash": DASHES[i % len(DASHES)], "width": 2},
                    marker={"size": 5},
                    meta={"run": name, "channel": c},
                    hovertemplate=f"channel {c}, t = %{{x}} (%{{customdata}}): Δ = %{{y:.4g}}<extra>{name}</extra>",
                ),
                row=3,
                col=col,
            )
        fig.add_trace(
            go.Scatter(
                x=[t, t],
                y=[bottom, top],
                mode="lines",
                showlegend=False,
                name="current step",
                line={"color": "#555555", "dash": "dot", "width": 2},
                hoverinfo="skip",
                meta={"run": name, "marker": "step"},
            ),
            row=3,
            col=col,
        )
        fig.add_trace(
            go.Scatter(
                x=[t] * len(chans),
                y=rounded(delta[t, chans]),
                mode="markers",
                showlegend=False,
                name="Δ at the current step",
                meta={"run": name, "marker": "values"},
                marker={
                    "color": DELTA_COLOURS[: len(chans)],
                    "size": 11,
                    "symbol": "circle-open",
                    "line": {"width": 3},
                },
                hovertemplate="Δ = %{y:.4g} at the current token<extra>" + name + "</extra>",
            ),
            row=3,
            col=col,
        )
        fig.update_xaxes(**ticks, range=[-0.5, L - 0.5], title_text="token t", row=3, col=col)
        fig.update_yaxes(
            type="log" if log else "linear",
            range=np.log10([bottom, top]).tolist() if log else [bottom, top],
            title_text=("Δ (log scale)" if log else "Δ") if col == 1 else None,
            row=3,
            col=col,
        )
    fig.update_layout(
        title={"text": f"token {t + 1} of {L}: {_sequence_text(tokens, t)}", "font": {"size": 13}},
        height=880,
        plot_bgcolor="white",
        bargap=0.15,
        legend={"title": {"text": "Δ of"}, "x": 1.02, "xanchor": "left", "y": 0, "yanchor": "bottom"},
        meta={"onemask": "ssm_state", "step": t, "runs": names, "shape": [L, D, N], "delta_channels": chans},
    )
    if animate and L > 1:
        n_runs = len(names)
        moving = list(range(2 * n_runs)) + [
            2 * n_runs + col * (len(chans) + 2) + k for col in range(n_runs) for k in (len(chans), len(chans) + 1)
        ]
        frames, steps = [], []
        for j in range(L):
            frames.append(
                go.Frame(
                    name=str(j + 1),
                    data=_frame_traces(runs, j, chans, bottom, top),
                    traces=moving,
                    layout={"title": {"text": f"token {j + 1} of {L}: {_sequence_text(tokens, j)}"}},
                )
            )
            steps.append(
                {
                    "label": tokens[j],
                    "method": "animate",
                    "args": [[str(j + 1)], {"mode": "immediate", "frame": {"duration": 0, "redraw": True}}],
                }
            )
        fig.frames = frames
        fig.update_layout(
            sliders=[
                {
                    "active": t,
                    "steps": steps,
                    "currentvalue": {"prefix": "token: "},
                    "pad": {"t": 50},
                    "x": 0.1,
                    "len": 0.9,
                }
            ],
            updatemenus=[
                {
                    "type": "buttons",
                    "showactive": False,
                    "x": 0.09,
                    "y": -0.08,
                    "xanchor": "right",
                    "buttons": [
                        {
                            "label": "▶ play",
                            "method": "animate",
                            "args": [None, {"frame": {"duration": 300, "redraw": True}, "fromcurrent": False}],
                        }
                    ],
                }
            ],
            height=980,
        )
    return fig


class SSMStateView:
    """Live face: a slider over the tokens; with `recompute(text) -> (tokens, runs)`, a text box
    for a new input sequence (the lesson passes a function that runs lib.mamba)."""

    def __init__(
        self,
        tokens: Sequence[str],
        runs: Mapping[str, tuple],
        *,
        recompute: Callable[[str], tuple] | None = None,
        text: str = "",
        delta_channels: Sequence[int] | None = None,
    ):
        import ipywidgets as W

        self.tokens = [str(t) for t in tokens]
        self.runs = check_runs(self.tokens, runs)
        # chosen once: a new input sequence keeps the same channels in the Δ panel
        D = next(iter(self.runs.values()))[0].shape[1]
        self.delta_channels = _check_channels(
            pick_delta_channels(self.runs) if delta_channels is None else delta_channels, D
        )
        self.recompute = recompute
        style = {"description_width": "initial"}
        self.status = W.HTML()
        self.controls = {}
        rows = []
        if recompute is not None:
            self.controls["text"] = W.Text(
                value=text, description="input sequence", style=style, continuous_update=False, layout={"width": "60%"}
            )
            self.controls["text"].observe(self._on_text, names="value")
            rows.append(self.controls["text"])
        # opens at the first token: step through the sequence as it arrives
        self.controls["step"] = W.IntSlider(
            value=1, min=1, max=len(self.tokens), description="token", style=style, continuous_update=True
        )
        self.controls["step"].observe(self._on_step, names="value")
        self.figure = go.FigureWidget(self._figure(0))
        self.widget = W.VBox(rows + [self.controls["step"], self.status, self.figure])

    def set_step(self, step: int) -> None:
        """Show token `step` (1-based, as the slider)."""
        redraw(self.figure, self._figure(step - 1))

    def figure_for(self, name: str, value) -> go.Figure:
        """The figure drawn once the token slider (`name="step"`) is at `value`, computed afresh,
        the widget untouched. A new input sequence (`"text"`) runs the model: not previewed."""
        if name != "step":
            raise ValueError(f"name must be 'step' (the token slider), got {name!r}")
        slider = self.controls["step"]
        if isinstance(value, bool) or not isinstance(value, int) or not slider.min <= value <= slider.max:
            raise ValueError(f"value must be a token position from {slider.min} to {slider.max}, got {value!r}")
        return self._figure(value - 1)

    def _figure(self, t: int) -> go.Figure:
        return ssm_state_figure(self.tokens, self.runs, step=t, animate=False, delta_channels=self.delta_channels)

    def _on_step(self, change) -> None:
        self.set_step(change["new"])

    def _on_text(self, change) -> None:
        try:
            tokens, runs = self.recompute(change["new"])
            tokens = [str(t) for t in tokens]
            runs = check_runs(tokens, runs)
            if list(runs) != list(self.runs):
                raise ValueError(f"recompute must return the runs {list(self.runs)}, got {list(runs)}")
            _check_channels(self.delta_channels, next(iter(runs.values()))[0].shape[1])
        except (ValueError, TypeError, KeyError) as err:  # a bad input sequence: say why, keep the old view
            self.status.value = f"<span>Could not run this input: {err}</span>"
            return
        self.status.value = ""
        self.tokens, self.runs = tokens, runs
        slider = self.controls["step"]
        with slider.hold_trait_notifications():
            slider.max = len(tokens)
            slider.value = 1
        self.set_step(1)

    def _repr_mimebundle_(self, **kwargs):
        return live_mimebundle(self.widget, "SSMStateView", **kwargs)


def masked_attention_figure(tokens: Sequence[str], decay, weights, *, title: str = "") -> go.Figure:
    """The selective SSM as a masked attention (lib.ssd), three (T, T) panels over `tokens`:
    lesson 01's causal mask (0 or −∞), the decay exp(M) of one state entry (how much of x_s is left
    at t, 0 above the diagonal) and the weights W of one channel (y_t = Σ_s W_ts x_s). `decay` and
    `weights` (T, T) as tensors or arrays; their entries above the diagonal must be 0."""
    tokens = [str(t) for t in tokens]
    T = len(tokens)
    if not 1 <= T <= MAX_STEPS:
        raise ValueError(f"tokens must hold 1..{MAX_STEPS} tokens, got {T}")
    decay, weights = as_array("decay", decay), as_array("weights", weights)
    for name, m in (("decay", decay), ("weights", weights)):
        if m.shape != (T, T):
            raise ValueError(f"{name} must have shape (T, T) = {(T, T)} for {T} tokens, got {m.shape}")
    future = np.triu(np.ones((T, T), dtype=bool), 1)
    if np.any(decay[future] != 0) or np.any(weights[future] != 0):
        raise ValueError("decay and weights must be 0 above the diagonal (s > t: the future)")
    if np.any(decay[~future] < 0) or np.any(decay[~future] > 1):
        raise ValueError("decay must lie in [0, 1] on and below the diagonal: exp of a mask <= 0")
    labels = T <= 16
    font = 11 if T <= 10 else 8
    pairs = [[[tokens[i], tokens[j]] for j in range(T)] for i in range(T)]
    fig = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.08,
        subplot_titles=(
            "causal mask M (lesson 01): 0 or −∞",
            "exp(M) here: what is left of x_s at t",
            "W: y_t = Σ_s W_ts x_s",
        ),
    )
    fig.add_trace(
        go.Heatmap(
            z=future.astype(int),
            zmin=0,
            zmax=1,
            colorscale=[[0, OPEN_COLOUR], [1, MASKED_COLOUR]],
            showscale=False,
            text=[["−∞" if f else "0" for f in row] for row in future],
            texttemplate="%{text}" if labels else None,
            textfont={"size": font},
            customdata=pairs,
            xgap=1,
            ygap=1,
            name="causal mask",
            hovertemplate="t = %{y} (%{customdata[0]}), s = %{x} (%{customdata[1]})<br>M = %{text}<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Heatmap(
            z=_lower(decay, future),
            zmin=0,
            zmax=1,
            colorscale=SEQUENTIAL,
            customdata=pairs,
            text=[["" if f else f"{v:.2f}" for v, f in zip(r, fr)] for r, fr in zip(decay, future)],
            texttemplate="%{text}" if labels else None,
            textfont={"size": font},
            xgap=1,
            ygap=1,
            name="decay",
            colorbar={"title": {"text": "left"}, "thickness": 10, "x": 0.63},
            hoverongaps=False,
            hovertemplate=(
                "t = %{y} (%{customdata[0]}), s = %{x} (%{customdata[1]})<br>exp(M) = %{z:.4f}<extra></extra>"
            ),
        ),
        row=1,
        col=2,
    )
    top = float(np.abs(weights).max()) or 1.0
    fig.add_trace(
        go.Heatmap(
            z=_lower(weights, future),
            zmin=-top,
            zmax=top,
            colorscale=DIVERGING,
            customdata=pairs,
            xgap=1,
            ygap=1,
            name="W",
            hoverongaps=False,
            colorbar={"title": {"text": "W"}, "thickness": 10},
            hovertemplate="t = %{y} (%{customdata[0]}), s = %{x} (%{customdata[1]})<br>W = %{z:.4g}<extra></extra>",
        ),
        row=1,
        col=3,
    )
    ticks = {"tickmode": "array", "tickvals": list(range(T)), "ticktext": tokens, "tickfont": {"size": font}}
    for col in (1, 2, 3):
        fig.update_xaxes(
            **ticks,
            title_text="s (input position)",
            range=[-0.5, T - 0.5],
            constrain="domain",
            showgrid=False,
            zeroline=False,
            row=1,
            col=col,
        )
        fig.update_yaxes(
            **ticks,
            autorange="reversed",
            scaleanchor=f"x{'' if col == 1 else col}",
            constrain="domain",
            showgrid=False,
            zeroline=False,
            row=1,
            col=col,
        )
    fig.update_yaxes(title_text="t (output position)", row=1, col=1)
    fig.update_layout(title={"text": title, "x": 0.01}, height=420, plot_bgcolor="white", margin={"t": 80})
    return fig


def _lower(values: np.ndarray, future: np.ndarray) -> list:
    """Four significant digits on and below the diagonal; None (no cell) above it."""
    return [[None if f else v for v, f in zip(row, frow)] for row, frow in zip(rounded(values), future)]
