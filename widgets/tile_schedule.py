"""Tile schedule: which (query block, key block) tiles a flash-attention forward visits, in order.

The kernel runs one program per query block (per batch and head); each walks its key blocks left
to right, folding one tile at a time into its online softmax. Under a causal mask, tiles wholly
above the diagonal hold no visible key and are skipped; tiles cut by the diagonal (or by the
ragged end of the sequence) need an element mask; the rest are used in full. The numbers come
from `lib.kernels.key_block_bounds`, the bounds the Triton kernel itself uses; this module draws.

`tile_schedule_figure(...)` is the static face: an animation (play button and slider, no kernel
needed) in which every program advances one key block per frame, as they do in parallel on a GPU.
`TileSchedule(...)` is the live face (sequence length, block sizes, causal).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import plotly.graph_objects as go

from lib.kernels.flash import key_block_bounds, visited_blocks
from widgets._base import LiveView
from widgets._render import OKABE_ITO

__all__ = ["TileSchedule", "TileState", "tile_grid", "tile_schedule_figure"]

KINDS = ("skipped", "masked tile", "full tile", "not reached yet")
KIND_COLOURS = ["#f2f2f2", OKABE_ITO[1], OKABE_ITO[0], "#d9d9d9"]
BLOCKS = (16, 32, 64, 128)
MAX_T = 4096


@dataclass(frozen=True)
class TileState:
    T: int = 256
    block_m: int = 64
    block_n: int = 64
    causal: bool = True

    def check(self) -> "TileState":
        for name in ("T", "block_m", "block_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.T > MAX_T:
            raise ValueError(f"T must be <= {MAX_T} for drawing, got {self.T}")
        return self


def tile_grid(state: TileState) -> dict:
    """kind[m][n] (an index into KINDS, never "not reached"), step[m][n] (the key-block step at
    which program m reaches tile n, or None if skipped) and the tile counts."""
    state.check()
    n_q, n_k = -(-state.T // state.block_m), -(-state.T // state.block_n)
    kind, step = [], []
    for m in range(n_q):
        n_full, n_end = key_block_bounds(m, state.T, state.block_m, state.block_n, state.causal)
        kind.append([2 if n < n_full else 1 if n < n_end else 0 for n in range(n_k)])
        step.append([n if n < n_end else None for n in range(n_k)])
    visited = sum(k != 0 for row in kind for k in row)
    return {
        "kind": kind,
        "step": step,
        "n_q": n_q,
        "n_k": n_k,
        "visited": visited,
        "total": n_q * n_k,
        "masked": sum(k == 1 for row in kind for k in row),
    }


def _colorscale() -> list:
    n = len(KINDS)
    scale = []
    for i, c in enumerate(KIND_COLOURS):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


def _frame_z(grid: dict, upto: int | None) -> tuple[list, list]:
    """Tile kinds with tiles not reached by step `upto` greyed out (None = the finished run)."""
    z, text = [], []
    for kinds, steps in zip(grid["kind"], grid["step"]):
        row_z, row_t = [], []
        for k, s in zip(kinds, steps):
            reached = upto is None or (s is not None and s <= upto)
            row_z.append(k if (reached or k == 0) else 3)
            row_t.append("skip" if k == 0 else (f"{s + 1}" if reached else ""))
        z.append(row_z)
        text.append(row_t)
    return z, text


def _title(state: TileState, grid: dict) -> str:
    share = grid["visited"] / grid["total"]
    what = "causal" if state.causal else "no mask"
    return (
        f"T = {state.T}, blocks {state.block_m} x {state.block_n}, {what}: the forward visits "
        f"{grid['visited']} of {grid['total']} tiles ({share:.0%}), {grid['masked']} of them with an element mask"
    )


def tile_schedule_figure(state: TileState | None = None, *, animate: bool = True, **changes) -> go.Figure:
    """The tile grid for `state`; `animate` adds play/slider frames, one key-block step each."""
    state = replace(state or TileState(), **changes).check()
    grid = tile_grid(state)
    assert grid["visited"] == visited_blocks(state.T, state.block_m, state.block_n, state.causal)
    z, text = _frame_z(grid, None)
    heat = go.Heatmap(
        z=z,
        text=text,
        texttemplate="%{text}",
        zmin=-0.5,
        zmax=len(KINDS) - 0.5,
        colorscale=_colorscale(),
        xgap=2,
        ygap=2,
        colorbar={"title": {"text": "tile"}, "tickvals": list(range(len(KINDS))), "ticktext": list(KINDS)},
        customdata=[[KINDS[k] for k in row] for row in grid["kind"]],
        hovertemplate="query block %{y}, key block %{x}: %{customdata}<br>step %{text}<extra></extra>",
    )
    fig = go.Figure(heat)
    fig.update_yaxes(title_text=f"query block (program), {state.block_m} queries each", autorange="reversed")
    fig.update_xaxes(title_text=f"key block, {state.block_n} keys each (visited left to right)")
    fig.update_layout(
        title={"text": _title(state, grid), "font": {"size": 13}},
        height=460,
        plot_bgcolor="white",
        meta={
            "onemask": "tile_schedule",
            "state": {"T": state.T, "block_m": state.block_m, "block_n": state.block_n, "causal": state.causal},
        },
    )
    n_steps = max((s for row in grid["step"] for s in row if s is not None), default=-1) + 1
    if animate and n_steps > 1:
        frames, steps = [], []
        for j in range(n_steps):
            fz, ft = _frame_z(grid, j)
            frames.append(go.Frame(name=str(j + 1), data=[go.Heatmap(z=fz, text=ft)]))
            steps.append(
                {
                    "label": str(j + 1),
                    "method": "animate",
                    "args": [[str(j + 1)], {"mode": "immediate", "frame": {"duration": 0, "redraw": True}}],
                }
            )
        fig.frames = frames
        fig.update_layout(
            sliders=[
                {
                    "active": n_steps - 1,
                    "steps": steps,
                    "currentvalue": {"prefix": "key-block step: "},
                    "pad": {"t": 40},
                }
            ],
            updatemenus=[
                {
                    "type": "buttons",
                    "showactive": False,
                    "x": 0,
                    "y": -0.18,
                    "xanchor": "left",
                    "buttons": [
                        {
                            "label": "▶ play",
                            "method": "animate",
                            "args": [None, {"frame": {"duration": 400, "redraw": True}, "fromcurrent": False}],
                        }
                    ],
                }
            ],
            height=560,
        )
    return fig


class TileSchedule(LiveView):
    """Live face: sequence length, block sizes and causal; the grid redrawn in place."""

    def __init__(self, state: TileState | None = None, **changes):
        import ipywidgets as W

        s = replace(state or TileState(), **changes).check()
        style = {"description_width": "initial"}
        self.controls = {
            "T": W.IntSlider(
                value=s.T, min=1, max=1024, description="sequence length T", style=style, continuous_update=False
            ),
            "block_m": W.Dropdown(options=list(BLOCKS), value=s.block_m, description="BLOCK_M (queries)", style=style),
            "block_n": W.Dropdown(options=list(BLOCKS), value=s.block_n, description="BLOCK_N (keys)", style=style),
            "causal": W.Checkbox(value=s.causal, description="causal"),
        }
        c = self.controls
        self._start(
            s, lambda figure: W.VBox([W.HBox([c["T"], c["causal"]]), W.HBox([c["block_m"], c["block_n"]]), figure])
        )

    def _figure(self, state: TileState) -> go.Figure:
        return tile_schedule_figure(state, animate=False)

    def _checked(self, state: TileState) -> TileState:
        return state.check()
