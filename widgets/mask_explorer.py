"""The mask explorer: M, the scores QKᵀ/√d and the weights softmax(QKᵀ/√d + M), side by side.

Two faces of one drawing function:
- `mask_explorer_figure(...)` returns a plain plotly figure. With `buttons=True` it carries one
  button per mask in the zoo, so it works with no kernel (the book, a PDF handout).
- `MaskExplorer(...)` wraps the same figure in a FigureWidget with a text box, dropdowns and
  sliders for live use in JupyterLab.
Every number comes from `lib` (tokenizer, toy projections, masks, attention weights); this
module only arranges and draws them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from lib.attention import attention_scores, attention_weights
from lib.masks import MASK_KINDS, build_mask, combine_masks, padding_mask
from lib.toy import pad_tokens, simple_tokenize, toy_qkv
from widgets._base import LiveView
from widgets._render import DIVERGING, MASKED_COLOUR, OPEN_COLOUR, SEQUENTIAL

__all__ = ["KIND_LABELS", "MaskExplorer", "MaskState", "attention_heatmap", "explorer_matrices", "mask_explorer_figure"]

KIND_LABELS = {
    "bidirectional": "bidirectional (BERT)",
    "causal": "causal (GPT)",
    "prefix-lm": "prefix-LM",
    "sliding-window": "sliding window",
}
MAX_TOKENS = 24  # beyond this the cell labels stop being readable
DIGITS = 4  # figure data are rounded: stable across CPUs, still more than the eye can see
MINUS_INF = "−∞"


@dataclass(frozen=True)
class MaskState:
    """Everything the explorer draws is a function of these values."""

    sentence: str = "The cat sat on the mat ."
    kind: str = "causal"
    n_pad: int = 2
    pad_side: str = "right"
    prefix_len: int = 3
    window: int = 3
    d_k: int = 16
    seed: int = 0

    def clamped(self) -> "MaskState":
        """The same state with prefix_len and window brought inside what the tokens allow."""
        T = len(self.tokens())
        return replace(self, prefix_len=min(max(self.prefix_len, 0), T), window=min(max(self.window, 1), T))

    def tokens(self) -> list[str]:
        return self.padded()[0]

    def padded(self) -> tuple[list[str], torch.Tensor]:
        """The tokens with padding added, and the (1, T) 0/1 attention mask."""
        words = simple_tokenize(self.sentence)[:MAX_TOKENS] or ["(empty)"]
        return pad_tokens(words, self.n_pad, self.pad_side)


def explorer_matrices(state: MaskState) -> dict:
    """Tokens and the three (T, T) matrices for one state, computed by lib (float64 numpy)."""
    state = state.clamped()
    tokens, keep = state.padded()  # keep: (1, T) of 0/1
    q, k, _ = toy_qkv(tokens, state.d_k, seed=state.seed)  # (1, 1, T, d_k) each
    T = len(tokens)
    mask = combine_masks(
        build_mask(state.kind, T, prefix_len=state.prefix_len, window=state.window),  # (T, T)
        padding_mask(keep),  # (1, 1, 1, T)
    )  # (1, 1, T, T)
    return {
        "tokens": tokens,
        "mask": mask[0, 0].double().numpy(),
        "scores": attention_scores(q, k)[0, 0].double().numpy(),
        "weights": attention_weights(q, k, mask)[0, 0].double().numpy(),
    }


def _cell_text(values: np.ndarray, masked: np.ndarray, masked_label: str, digits: int = 2) -> list[list[str]]:
    return [[masked_label if m else f"{v:.{digits}f}" for v, m in zip(row, mrow)] for row, mrow in zip(values, masked)]


def _panel_data(mats: dict) -> dict:
    """Trace contents for one state: what a button or a control change swaps in."""
    tokens, mask, weights = mats["tokens"], mats["mask"], mats["weights"]
    masked = np.isneginf(mask)
    T = len(tokens)
    pairs = [[[tokens[i], tokens[j]] for j in range(T)] for i in range(T)]
    weight_note = [["masked: exactly 0" if masked[i, j] else "" for j in range(T)] for i in range(T)]
    rows, cols = np.nonzero(masked)
    return {
        "mask_z": masked.astype(int).tolist(),
        "mask_text": [[MINUS_INF if m else "0" for m in row] for row in masked],
        "pairs": pairs,
        "weights_z": np.round(weights, DIGITS).tolist(),
        "weights_text": _cell_text(weights, masked, ""),  # masked cells carry a × marker instead
        "weights_custom": [[pairs[i][j] + [weight_note[i][j]] for j in range(T)] for i in range(T)],
        "x_cols": cols.tolist(),
        "x_rows": rows.tolist(),
    }


def _title(state: MaskState) -> str:
    pad = f", {state.n_pad} padding token(s) on the {state.pad_side}" if state.n_pad else ", no padding"
    extra = {"prefix-lm": f" (prefix {state.prefix_len})", "sliding-window": f" (window {state.window})"}.get(
        state.kind, ""
    )
    return f"Mask: {KIND_LABELS[state.kind]}{extra}{pad}"


def _font(T: int) -> int:
    return 11 if T <= 10 else 8 if T <= 16 else 6


def _mask_trace(data: dict, font: int) -> go.Heatmap:
    return go.Heatmap(
        z=data["mask_z"],
        text=data["mask_text"],
        texttemplate="%{text}",
        textfont={"size": font},
        customdata=data["pairs"],
        zmin=0,
        zmax=1,
        showscale=False,
        colorscale=[[0, OPEN_COLOUR], [1, MASKED_COLOUR]],
        xgap=1,
        ygap=1,
        name="M",
        hovertemplate=(
            "query %{customdata[0]} (row %{y}) → key %{customdata[1]} (col %{x})<br>M = %{text}<extra></extra>"
        ),
    )


def _weights_trace(data: dict, font: int, colorbar: dict) -> go.Heatmap:
    return go.Heatmap(
        z=data["weights_z"],
        text=data["weights_text"],
        texttemplate="%{text}",
        textfont={"size": font},
        customdata=data["weights_custom"],
        zmin=0,
        zmax=1,
        colorscale=SEQUENTIAL,
        xgap=1,
        ygap=1,
        name="weights",
        colorbar={"title": {"text": "weight"}, "thickness": 12, **colorbar},
        hovertemplate=(
            "query %{customdata[0]} → key %{customdata[1]}<br>weight = %{z:.4f} %{customdata[2]}<extra></extra>"
        ),
    )


def _masked_markers(data: dict, T: int, axes: str) -> go.Scatter:
    """A × on every masked cell of the weights panel: the non-colour cue for "exactly 0"."""
    return go.Scatter(
        x=data["x_cols"],
        y=data["x_rows"],
        mode="markers",
        name="masked: weight exactly 0",
        marker={"symbol": "x-thin", "size": max(4, 120 // T), "line": {"width": 2, "color": "#d62728"}},
        hoverinfo="skip",
        xaxis=f"x{axes}",
        yaxis=f"y{axes}",
        showlegend=True,
    )


def _token_axes(fig: go.Figure, tokens: list[str], cols: int, font: int) -> None:
    T = len(tokens)
    ticks = {"tickmode": "array", "tickvals": list(range(T)), "ticktext": list(tokens), "tickfont": {"size": font + 1}}
    for col in range(1, cols + 1):
        fig.update_xaxes(
            **ticks,
            tickangle=-50,
            side="bottom",
            title_text="key (looked at)",
            row=1,
            col=col,
            range=[-0.5, T - 0.5],
            constrain="domain",
            showgrid=False,
            zeroline=False,
        )
        fig.update_yaxes(
            **ticks,
            autorange="reversed",
            row=1,
            col=col,
            showgrid=False,
            zeroline=False,
            scaleanchor=f"x{'' if col == 1 else col}",
            constrain="domain",
        )
    fig.update_yaxes(title_text="query (looking)", row=1, col=1)


def mask_explorer_figure(state: MaskState | None = None, *, buttons: bool = False, **changes) -> go.Figure:
    """The three heatmaps for `state` (or MaskState(**changes)); `buttons=True` adds the zoo."""
    state = (state or MaskState()) if not changes else replace(state or MaskState(), **changes)
    state = state.clamped()
    if state.kind not in MASK_KINDS:
        raise ValueError(f"kind must be one of {MASK_KINDS}, got {state.kind!r}")
    mats = explorer_matrices(state)
    data = _panel_data(mats)
    tokens, T = mats["tokens"], len(mats["tokens"])
    font = _font(T)

    fig = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.09,
        subplot_titles=("M: the mask (0 or −∞)", "scores QKᵀ/√d (before the mask)", "weights softmax(QKᵀ/√d + M)"),
    )
    fig.add_trace(_mask_trace(data, font), row=1, col=1)
    fig.add_trace(
        go.Heatmap(
            z=np.round(mats["scores"], DIGITS).tolist(),
            text=_cell_text(mats["scores"], np.zeros((T, T), bool), "", digits=1),
            texttemplate="%{text}",
            textfont={"size": font},
            customdata=data["pairs"],
            colorscale=DIVERGING,
            zmid=0,
            xgap=1,
            ygap=1,
            name="scores",
            colorbar={"title": {"text": "score"}, "x": 0.635, "len": 0.8, "thickness": 12},
            hovertemplate="query %{customdata[0]} → key %{customdata[1]}<br>score = %{z:.4f}<extra></extra>",
        ),
        row=1,
        col=2,
    )
    fig.add_trace(_weights_trace(data, font, {"x": 1.0, "len": 0.8}), row=1, col=3)
    fig.add_trace(_masked_markers(data, T, "3"))
    _token_axes(fig, tokens, 3, font)
    fig.update_layout(
        title={"text": _title(state), "x": 0.01},
        height=520,
        margin={"l": 70, "r": 30, "t": 80, "b": 90},
        legend={"orientation": "h", "x": 1.0, "xanchor": "right", "y": -0.32},
        plot_bgcolor="white",
        meta={"onemask": "mask_explorer", "state": asdict(state)},
    )
    if buttons:
        fig.update_layout(updatemenus=[_zoo_buttons(state)])
        fig.update_layout(margin={"t": 120}, title={"y": 0.97})
    return fig


def _zoo_buttons(state: MaskState) -> dict:
    """One button per mask kind; each swaps the M and weights traces and the × markers."""
    items = []
    for kind in MASK_KINDS:
        s = replace(state, kind=kind).clamped()
        d = _panel_data(explorer_matrices(s))
        items.append(
            {
                "label": KIND_LABELS[kind],
                "method": "update",
                "args": [
                    {
                        "z": [d["mask_z"], d["weights_z"], None],
                        "text": [d["mask_text"], d["weights_text"], None],
                        "customdata": [d["pairs"], d["weights_custom"], None],
                        "x": [None, None, d["x_cols"]],
                        "y": [None, None, d["x_rows"]],
                    },
                    {"title.text": _title(s), "meta.state": asdict(s)},
                    [0, 2, 3],
                ],
            }
        )
    return {
        "type": "buttons",
        "direction": "right",
        "buttons": items,
        "showactive": True,
        "active": list(MASK_KINDS).index(state.kind),
        "x": 0.0,
        "xanchor": "left",
        "y": 1.27,
        "yanchor": "top",
        "pad": {"r": 4, "t": 4},
        "font": {"size": 12},
    }


class MaskExplorer(LiveView):
    """Live face: controls on top, the same figure below, redrawn in place on every change."""

    def __init__(self, state: MaskState | None = None, **changes):
        import ipywidgets as W

        s = replace(state or MaskState(), **changes).clamped()
        T = len(s.tokens())
        style = {"description_width": "initial"}
        self.controls = {
            "sentence": W.Text(
                value=s.sentence,
                description="sentence",
                continuous_update=False,
                layout=W.Layout(width="420px"),
                style=style,
            ),
            "kind": W.Dropdown(
                options=[(KIND_LABELS[k], k) for k in MASK_KINDS], value=s.kind, description="mask", style=style
            ),
            "n_pad": W.IntSlider(value=s.n_pad, min=0, max=4, description="padding tokens", style=style),
            "pad_side": W.ToggleButtons(
                options=["left", "right"], value=s.pad_side, description="pad side", style=style
            ),
            "prefix_len": W.IntSlider(value=s.prefix_len, min=0, max=T, description="prefix length", style=style),
            "window": W.IntSlider(value=s.window, min=1, max=T, description="window", style=style),
            "d_k": W.Dropdown(options=[4, 16, 64, 256], value=s.d_k, description="d_k", style=style),
        }
        c = self.controls
        self._start(
            s,
            lambda figure: W.VBox(
                [
                    W.HBox([c["sentence"], c["kind"], c["d_k"]]),
                    W.HBox([c["n_pad"], c["pad_side"], c["prefix_len"], c["window"]]),
                    figure,
                ]
            ),
        )

    @staticmethod
    def _figure(state: MaskState) -> go.Figure:
        # A fixed width: inside a widget area plotly's autosize picks a cramped default.
        return mask_explorer_figure(state).update_layout(width=1050)

    def _checked(self, state: MaskState) -> MaskState:
        return state.clamped()

    def _sync_controls(self, state: MaskState) -> None:
        """Move the controls to `state`: the prefix and window sliders reach T, and a control the
        mask does not use is greyed out."""
        T = len(state.tokens())
        with self._quietly():
            for name, control in self.controls.items():
                if name in ("prefix_len", "window"):
                    control.max = T
                control.value = getattr(state, name)
        self.controls["prefix_len"].disabled = state.kind != "prefix-lm"
        self.controls["window"].disabled = state.kind != "sliding-window"
        self.controls["pad_side"].disabled = state.n_pad == 0


def attention_heatmap(weights, mask, tokens: list[str], title: str) -> go.Figure:
    """Any model's attention for one head, drawn like the explorer: M beside the weights.

    `weights` (T, T) and `mask` (T, T) (additive, 0/−inf) as tensors or arrays; masked cells
    get "−∞" in M and a × in the weights, whose value there is exactly 0.
    """
    w, m = np.asarray(weights, dtype=float), np.asarray(mask, dtype=float)
    T = len(tokens)
    if w.shape != (T, T) or m.shape != (T, T):
        raise ValueError(f"weights and mask must be (T, T) = {(T, T)} for {T} tokens, got {w.shape} and {m.shape}")
    data = _panel_data({"tokens": list(tokens), "mask": m, "weights": w})
    font = _font(T)
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=("M: the padding mask (0 or −∞)", "attention weights")
    )
    fig.add_trace(_mask_trace(data, font), row=1, col=1)
    fig.add_trace(_weights_trace(data, font, {}), row=1, col=2)
    fig.add_trace(_masked_markers(data, T, "2"))
    _token_axes(fig, list(tokens), 2, font)
    fig.update_layout(
        title={"text": title, "x": 0.01},
        height=520,
        plot_bgcolor="white",
        legend={"orientation": "h", "x": 1.0, "xanchor": "right", "y": -0.25},
        margin={"t": 80, "b": 90},
    )
    return fig
