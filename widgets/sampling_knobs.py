"""Sampling knobs: how temperature, top-k and top-p reshape the next-token distribution.

One bar pair per token, for the `show` tokens most probable under the model's raw distribution,
in that fixed order (so bars stay put while the knobs move): grey, the distribution at T = 1;
coloured, the one actually sampled from after the knobs. A token a filter removed carries the
words "cut: top-k" or "cut: top-p" on its bar (never colour alone).

`sampling_figure(...)` is the static face (with `presets`, a slider steps through knob settings
with no kernel); `SamplingKnobs(...)` the live one (prompt box and three sliders). The numbers
are `lib.sampling.next_token_distribution`'s; the logits come from the caller (a lesson's model);
this module only draws.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, replace
from typing import Callable

import plotly.graph_objects as go
import torch

from lib.sampling import next_token_distribution
from widgets._base import LiveView
from widgets._render import OKABE_ITO

__all__ = ["SamplingKnobs", "SamplingState", "sampling_figure", "visible_token"]

DIGITS = 4  # figure data are rounded: stable across CPUs, still more than the eye can see
RAW_COLOUR = "#A0A0A0"
FINAL_COLOUR = OKABE_ITO[0]
KNOBS = ("temperature", "top_k", "top_p")
WHITESPACE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}
TOP_K_SLIDER_MAX = 50


@dataclass(frozen=True)
class SamplingState:
    """Everything the figure draws, given the logits the prompt leads to.

    temperature 0 means greedy decoding; top_k 0 means top-k off; top_p 1 means top-p off.
    """

    prompt: str = "the dog"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def _check_state(state: SamplingState) -> None:
    if not isinstance(state.prompt, str):
        raise TypeError(f"prompt must be a str, got {type(state.prompt).__name__}")
    t = state.temperature
    if isinstance(t, bool) or not isinstance(t, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(t).__name__}")
    if not 0 <= t < float("inf"):
        raise ValueError(f"temperature must be finite and >= 0 (0 means greedy), got {t!r}")
    if isinstance(state.top_k, bool) or not isinstance(state.top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int (0 = off), got {type(state.top_k).__name__}")
    if state.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {state.top_k}")
    p = state.top_p
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"top_p must be a real number, got {type(p).__name__}")
    if not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")


def _check_logits(logits, labels) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 1:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a floating (V,) tensor of next-token logits, got {shape}")
    if len(labels) != logits.shape[0]:
        raise ValueError(f"labels must hold one string per logit: V = {logits.shape[0]}, got {len(labels)} labels")


def visible_token(label: str) -> str:
    """Token text with whitespace made visible: " " -> "␣", "\\n" -> "⏎", "\\t" -> "⇥"."""
    label = str(label)
    return "".join(WHITESPACE.get(ch, ch) for ch in label) if label else "∅"


def distribution(logits: torch.Tensor, state: SamplingState) -> dict[str, torch.Tensor]:
    """lib's numbers for `state`: top_k 0 and top_p 1 are passed as "off"."""
    return next_token_distribution(
        logits.detach().cpu(),
        temperature=float(state.temperature),
        top_k=int(state.top_k) or None,
        top_p=float(state.top_p),
    )


def _knob_text(state: SamplingState) -> str:
    t = "T = 0 (greedy)" if state.temperature == 0 else f"T = {state.temperature:.2f}"
    k = f"top-k {state.top_k}" if state.top_k else "top-k off"
    p = f"top-p {state.top_p:.2f}" if state.top_p < 1 else "top-p off"
    return f"{t}, {k}, {p}"


def _title(d: dict, state: SamplingState) -> str:
    kept = d["kept"]
    n = int(kept.sum())
    mass = float(d["p_tempered"][kept].sum())
    tokens = "token survives" if n == 1 else "tokens survive"
    return f"{_knob_text(state)}: {n} {tokens} ({mass:.0%} of the tempered mass); prompt {state.prompt!r}"


def _meta_state(state: SamplingState) -> dict:
    s = asdict(state)
    s["temperature"] = round(float(s["temperature"]), DIGITS)
    s["top_p"] = round(float(s["top_p"]), DIGITS)
    s["top_k"] = int(s["top_k"])
    return s


def _order(d: dict, show: int) -> list[int]:
    """The `show` most probable tokens under p_raw, most probable first; ties by token id."""
    p_raw = d["p_raw"]
    return torch.sort(p_raw, descending=True, stable=True).indices[:show].tolist()


def _note(d: dict, i: int, greedy: bool) -> str:
    if not d["kept_by_top_k"][i]:
        return "cut: top-k"
    if not d["kept_by_top_p"][i]:
        return "cut: top-p"
    if not d["kept"][i]:
        return "cut: greedy" if greedy else "cut: −∞ logit"
    return ""


def _final_data(d: dict, order: list[int], names: list[str], state: SamplingState) -> dict:
    """The coloured trace's contents: what a preset step or a knob change swaps in."""
    greedy = state.temperature == 0
    r = lambda x: round(float(x), DIGITS)  # noqa: E731
    notes = [_note(d, i, greedy) for i in order]
    y = [r(d["p_final"][i]) for i in order]
    text = [note or f"{p:.2f}" for note, p in zip(notes, y)]
    custom = [[names[j], i, r(d["p_tempered"][i]), note or "kept"] for j, (i, note) in enumerate(zip(order, notes))]
    return {"y": y, "text": text, "customdata": custom}


def _step_label(preset: dict) -> str:
    parts = []
    for name, value in preset.items():
        if name == "temperature":
            parts.append("T = 0 (greedy)" if value == 0 else f"T = {value:g}")
        elif name == "top_k":
            parts.append(f"top-k {value}" if value else "top-k off")
        else:
            parts.append(f"top-p {value:g}" if value < 1 else "top-p off")
    return ", ".join(parts) or "as drawn"


def sampling_figure(
    logits: torch.Tensor,
    labels: list[str],
    state: SamplingState | None = None,
    *,
    show: int = 20,
    presets: list[dict] | None = None,
    **changes,
) -> go.Figure:
    """Bars of the next-token distribution before (T = 1) and after the knobs of `state`.

    `logits` (V,) for the next token, `labels` the V token strings. `show` bars, for the tokens
    most probable at T = 1. `presets`, a list of dicts of knob values (temperature, top_k,
    top_p), adds a slider; each step is `state` with that preset applied, and the figure opens on
    the first step.
    """
    state = replace(state or SamplingState(), **changes)
    _check_logits(logits, labels)
    if isinstance(show, bool) or not isinstance(show, int) or show < 1:
        raise ValueError(f"show must be an int >= 1, got {show!r}")
    steps = []
    if presets is not None:
        if not presets:
            raise ValueError("presets must be a non-empty list of dicts of knob values, or None")
        for preset in presets:
            if not isinstance(preset, dict) or not set(preset) <= set(KNOBS):
                raise ValueError(f"each preset must be a dict with keys among {KNOBS}, got {preset!r}")
        steps = [replace(state, **preset) for preset in presets]
        state = steps[0]
    _check_state(state)
    for s in steps:
        _check_state(s)

    d = distribution(logits, state)
    order = _order(d, show)
    names = [visible_token(labels[i]) for i in order]
    x = list(range(len(order)))
    final = _final_data(d, order, names, state)
    raw = [round(float(d["p_raw"][i]), DIGITS) for i in order]
    fig = go.Figure(
        [
            go.Bar(
                x=x,
                y=raw,
                name="before (T=1)",
                marker={"color": RAW_COLOUR},
                customdata=[[n, i] for n, i in zip(names, order)],
                hovertemplate="token %{customdata[0]} (id %{customdata[1]})<br>p at T = 1: %{y:.4f}<extra></extra>",
            ),
            go.Bar(
                x=x,
                y=final["y"],
                name="after knobs",
                marker={"color": FINAL_COLOUR},
                text=final["text"],
                customdata=final["customdata"],
                textposition="outside",
                textangle=-90,
                cliponaxis=False,
                constraintext="none",
                textfont={"size": 10},
                hovertemplate=(
                    "token %{customdata[0]} (id %{customdata[1]})<br>p after temperature: %{customdata[2]:.4f}"
                    "<br>p sampled from: %{y:.4f}<br>%{customdata[3]}<extra></extra>"
                ),
            ),
        ]
    )
    fig.update_xaxes(
        title_text="next token (most probable at T = 1 first)",
        tickmode="array",
        tickvals=x,
        ticktext=names,
        range=[-0.5, len(x) - 0.5],
        showgrid=False,
    )
    fig.update_yaxes(title_text="probability", range=[0, 1], tickformat=".1f")
    fig.update_layout(
        barmode="group",
        bargap=0.2,
        title={"text": _title(d, state), "x": 0.01, "font": {"size": 14}},
        height=420,
        width=max(700, 34 * len(x) + 200),
        margin={"l": 70, "r": 20, "t": 60, "b": 70},
        plot_bgcolor="white",
        legend={"orientation": "h", "x": 1.0, "xanchor": "right", "y": 1.02, "yanchor": "bottom"},
        meta={"onemask": "sampling_knobs", "state": _meta_state(state)},
    )
    if steps:
        items = []
        for preset, s in zip(presets, steps):
            ds = distribution(logits, s)
            fs = _final_data(ds, order, names, s)
            items.append(
                {
                    "label": _step_label(preset),
                    "method": "update",
                    "args": [
                        {"y": [fs["y"]], "text": [fs["text"]], "customdata": [fs["customdata"]]},
                        {"title.text": _title(ds, s), "meta.state": _meta_state(s)},
                        [1],
                    ],
                }
            )
        fig.update_layout(
            sliders=[
                {"active": 0, "steps": items, "currentvalue": {"prefix": "knobs: "}, "pad": {"t": 60}, "len": 0.9}
            ],
            height=520,
            margin={"b": 90},
        )
    return fig


class SamplingKnobs(LiveView):
    """Live face: a prompt box and the three knobs above the figure, redrawn in place.

    `next_logits(prompt) -> (V,) tensor` is the lesson's model (called once per prompt, including
    the empty one: what it returns for "" is its choice); `labels` the V token strings.
    """

    def __init__(
        self,
        next_logits: Callable[[str], torch.Tensor],
        labels: list[str],
        state: SamplingState | None = None,
        **changes,
    ):
        import ipywidgets as W

        if not callable(next_logits):
            raise TypeError(f"next_logits must be callable (prompt -> (V,) logits), got {type(next_logits).__name__}")
        self.next_logits = next_logits
        self.labels = list(labels)
        state = replace(state or SamplingState(), **changes)
        _check_state(state)
        self._prompt, self._logits = None, None
        V = len(self.labels)
        style = {"description_width": "initial"}
        self.controls = {
            "prompt": W.Text(
                value=state.prompt,
                description="prompt",
                continuous_update=False,
                layout=W.Layout(width="420px"),
                style=style,
            ),
            "temperature": W.FloatSlider(
                value=1.0,
                min=0.0,
                max=2.0,
                step=0.05,
                description="temperature",
                readout_format=".2f",
                style=style,
                tooltip="0 means greedy: always the most probable token",
            ),
            "top_k": W.IntSlider(
                value=0, min=0, max=max(1, min(V, TOP_K_SLIDER_MAX)), description="top-k (0 = off)", style=style
            ),
            "top_p": W.FloatSlider(
                value=1.0,
                min=0.05,
                max=1.0,
                step=0.05,
                description="top-p (1 = off)",
                readout_format=".2f",
                style=style,
            ),
        }
        c = self.controls
        self._start(
            state, lambda figure: W.VBox([c["prompt"], W.HBox([c["temperature"], c["top_k"], c["top_p"]]), figure])
        )

    def logits_for(self, prompt: str) -> torch.Tensor:
        """The callable's logits for `prompt`, kept while only the knobs move."""
        if prompt != self._prompt or self._logits is None:
            logits = self.next_logits(prompt)
            _check_logits(logits, self.labels)
            self._prompt, self._logits = prompt, logits.detach().float().cpu()
        return self._logits

    def _figure(self, state: SamplingState) -> go.Figure:
        return sampling_figure(self.logits_for(state.prompt), self.labels, state)

    def _checked(self, state: SamplingState) -> SamplingState:
        _check_state(state)
        return state
