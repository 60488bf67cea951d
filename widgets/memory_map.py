"""KV memory maps: where a serving simulation's KV slots go, step by step.

    memory_map_figure(result)       heatmap of one run: x step, y memory (token slots), colour
                                    the state of each cell: free, reserved but empty, partly
                                    filled, or holding real tokens (colour bar with words; hover
                                    gives the owning request and the exact counts)
    memory_map_pair(c, p)           contiguous and paged side by side, one colour meaning, titles
                                    with each run's share of reserved slots holding real tokens
    utilisation_figure(results)     reserved and used slots over time, one line pair per run
    sweep_figure(rows)              token share and concurrency against the block size
    memory_grid(result)             the heatmap's numbers (integer arrays), for tests and tables
    MemoryMapView, MemoryMapState   live: block size, arrival rate, capacity, reserve rule, seed;
                                    memory_map_view_figure(state) is its figure

The numbers come from `lib.serving.simulate_serving`; this module only draws. A cell may cover
several slots (rows are merged when memory has more than `max_slots` units): its colour is then
"real tokens" if every reserved slot in it holds one, "reserved, empty" if none does, "partly
filled" otherwise, and "free" if nothing in it is reserved. Paged memory is drawn block by block
(a block's slots are b consecutive token slots: block × b + offset), so a last block with slack
is "partly filled".
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lib.serving import RESERVE_RULES, simulate_serving
from lib.serving_result import SimResult
from lib.workload import make_workload
from widgets._base import LiveView
from widgets._render import OKABE_ITO

__all__ = [
    "STATES",
    "MemoryMapState",
    "MemoryMapView",
    "memory_grid",
    "memory_map_figure",
    "memory_map_pair",
    "memory_map_view_figure",
    "sweep_figure",
    "utilisation_figure",
]

STATES = ("free", "reserved, empty", "partly filled", "real tokens")
STATE_COLOURS = ["#e6e6e6", OKABE_ITO[1], OKABE_ITO[4], OKABE_ITO[0]]
STEP_AXIS = "step (one decode iteration each)"
SLOT_AXIS = "KV memory (token slot)"


def _check_result(name: str, result) -> SimResult:
    if not isinstance(result, SimResult):
        raise TypeError(f"{name} must be a SimResult from lib.serving.simulate_serving, got {type(result).__name__}")
    return result


def _coloraxis() -> dict:
    n = len(STATES)
    scale = []
    for i, c in enumerate(STATE_COLOURS):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return {
        "colorscale": scale,
        "cmin": -0.5,
        "cmax": n - 0.5,
        "colorbar": {
            "title": {"text": "memory state"},
            "tickvals": list(range(n)),
            "ticktext": list(STATES),
            "len": 0.8,
        },
    }


def _small_int(a: np.ndarray) -> np.ndarray:
    """The narrowest of int8/16/32 that holds `a`: plotly stores numpy arrays as base64 typed
    arrays, so the stored figure stays small (and byte-stable: no floats)."""
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return a.astype(dtype)
    return a.astype(np.int64)


def _majority_owner(owner: np.ndarray) -> np.ndarray:
    """(rows, g) owners (-1: free) -> (rows,) the owner of most units in each row, ties to the
    lower rid, -1 for an all-free row. Vectorised over runs of equal values in sorted rows."""
    rows, g = owner.shape
    s = np.sort(owner, axis=1)  # free (-1) sorts first; equal owners become runs
    starts = np.ones_like(s, dtype=bool)
    starts[:, 1:] = s[:, 1:] != s[:, :-1]
    run = np.cumsum(starts, axis=1) - 1  # (rows, g): index of each unit's run within its row
    flat = (np.arange(rows)[:, None] * g + run).ravel()
    counts = np.bincount(flat, weights=(s >= 0).ravel(), minlength=rows * g).reshape(rows, g)  # free runs count 0
    values = np.full((rows, g), -1)
    values[np.nonzero(starts)[0], run[starts]] = s[starts]  # (rows, runs): each run's owner
    best = counts.argmax(axis=1)  # the first maximum: runs ascend, so the lowest rid wins ties
    return np.where(counts.max(axis=1) > 0, values[np.arange(rows), best], -1)


def memory_grid(result: SimResult, max_slots: int = 400) -> dict:
    """The heatmap's numbers, as integer numpy arrays: for every row of memory and snapshot
    (column), `z` the state code (an index into STATES) and `customdata` [owner rid (-1: none),
    slots holding real tokens, slots reserved but empty].

    Rows merge consecutive units (token slots, or blocks for paged) so that there are at most
    `max_slots` rows; the owner of a merged row is the request holding most of its slots (ties:
    the lower rid). `y` is each row's first token slot, `x` each snapshot's step.
    """
    _check_result("result", result)
    if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 1:
        raise ValueError(f"max_slots must be an int >= 1, got {max_slots!r}")
    units, unit = result.num_units, result.unit
    per_row = -(-units // max_slots)
    rows = -(-units // per_row)
    pad = rows * per_row - units
    cols = len(result.snapshots)
    z = np.zeros((rows, cols), dtype=np.int64)
    custom = np.zeros((rows, cols, 3), dtype=np.int64)
    for col in range(cols):
        m = result.memory_map(col)
        owner = np.array(m["owner"] + [-1] * pad).reshape(rows, per_row)  # (units,) -> (rows, per_row)
        filled = np.array(m["filled"] + [0] * pad).reshape(rows, per_row)
        held = (owner >= 0).sum(axis=1) * unit  # reserved slots per row
        real = filled.sum(axis=1)
        z[:, col] = np.where(held == 0, 0, np.where(real == 0, 1, np.where(real == held, 3, 2)))
        rid = owner[:, 0] if per_row == 1 else _majority_owner(owner)
        custom[:, col] = np.stack([rid, real, held - real], axis=1)  # (rows, 3)
    return {
        "x": [s for s, _ in result.snapshots],
        "y": [r * per_row * unit for r in range(rows)],
        "z": _small_int(z),
        "customdata": _small_int(custom),
        "slots_per_row": per_row * unit,
    }


def _heatmap(result: SimResult, max_slots: int) -> go.Heatmap:
    g = memory_grid(result, max_slots)
    where = (
        f"blocks of {result.unit} slots, {g['slots_per_row']} slots per cell"
        if result.policy == "paged"
        else f"{g['slots_per_row']} slot{'s' if g['slots_per_row'] > 1 else ''} per cell"
    )
    return go.Heatmap(
        x=g["x"],
        y=g["y"],
        z=g["z"],
        customdata=g["customdata"],
        coloraxis="coloraxis",
        name=result.policy,
        hovertemplate=(
            f"{result.label()}<br>step %{{x}}, slots from %{{y}} ({where})<br>"
            "request %{customdata[0]} (−1: none)<br>%{customdata[1]} slots hold real tokens, "
            "%{customdata[2]} reserved but empty<extra></extra>"
        ),
    )


def _share_title(result: SimResult) -> str:
    return f"{result.label()}: {result.token_share():.1%} of reserved slots hold real tokens"


def memory_map_figure(result: SimResult, *, title: str | None = None, max_slots: int = 400) -> go.Figure:
    """One run's KV memory over time (see the module docstring for the cell states)."""
    _check_result("result", result)
    fig = go.Figure(_heatmap(result, max_slots))
    fig.update_xaxes(title_text=STEP_AXIS, showgrid=False)
    fig.update_yaxes(title_text=SLOT_AXIS, showgrid=False, range=[-0.5, result.capacity_tokens])
    fig.update_layout(
        title={"text": title if title is not None else _share_title(result), "x": 0.01, "font": {"size": 14}},
        coloraxis=_coloraxis(),
        height=420,
        width=760,
        plot_bgcolor="white",
        margin={"l": 70, "r": 20, "t": 60, "b": 50},
        meta={"onemask": "memory_map", "summary": result.summary()},
    )
    return fig


def memory_map_pair(contiguous: SimResult, paged: SimResult, *, max_slots: int = 200) -> go.Figure:
    """Contiguous and paged runs side by side on linked step axes, one colour meaning. Each map
    is ~300 px tall, so `max_slots` rows default to 200 (more would not show, only weigh)."""
    _check_result("contiguous", contiguous)
    _check_result("paged", paged)
    if contiguous.policy != "contiguous" or paged.policy != "paged":
        raise ValueError(
            f"memory_map_pair wants a contiguous then a paged result, got {contiguous.policy!r} and {paged.policy!r}"
        )
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.08, subplot_titles=[_share_title(contiguous), _share_title(paged)]
    )
    fig.add_trace(_heatmap(contiguous, max_slots), row=1, col=1)
    fig.add_trace(_heatmap(paged, max_slots), row=1, col=2)
    fig.update_xaxes(title_text=STEP_AXIS, showgrid=False)
    fig.update_xaxes(matches="x", row=1, col=2)  # same step scale: the faster run ends further left
    fig.update_yaxes(showgrid=False)
    fig.update_yaxes(title_text=SLOT_AXIS, range=[-0.5, contiguous.capacity_tokens], row=1, col=1)
    fig.update_yaxes(range=[-0.5, paged.capacity_tokens], row=1, col=2)
    fig.update_annotations(font={"size": 12})
    fig.update_layout(
        title={
            "text": f"KV memory over time, {len(contiguous.requests)} requests: contiguous reservations hold "
            f"{contiguous.token_share():.1%} real tokens, paged {paged.token_share():.1%}",
            "x": 0.01,
            "font": {"size": 14},
        },
        coloraxis=_coloraxis(),
        height=460,
        width=1100,
        plot_bgcolor="white",
        margin={"l": 70, "r": 20, "t": 90, "b": 50},
        meta={"onemask": "memory_map_pair", "contiguous": contiguous.summary(), "paged": paged.summary()},
    )
    return fig


def utilisation_figure(results: dict, *, max_points: int = 400) -> go.Figure:
    """Reserved (dashed) and real-token (solid) slots per step for each named run, sampled at
    every k-th step so that each line has at most `max_points` points."""
    if not isinstance(results, dict) or not results:
        raise TypeError(f"results must be a non-empty dict of name -> SimResult, got {type(results).__name__}")
    if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 2:
        raise ValueError(f"max_points must be an int >= 2, got {max_points!r}")
    fig = go.Figure()
    for i, (name, res) in enumerate(results.items()):
        _check_result(f"results[{name!r}]", res)
        every = -(-res.makespan // max_points)
        steps = list(range(0, res.makespan, every))
        colour = OKABE_ITO[i % len(OKABE_ITO)]
        for kind, values, dash in (
            ("reserved", res.reserved_tokens, "dash"),
            ("real tokens", res.used_tokens, "solid"),
        ):
            fig.add_trace(
                go.Scatter(
                    x=steps,
                    y=[values[s] for s in steps],
                    name=f"{name}: {kind}",
                    mode="lines",
                    line={"color": colour, "dash": dash, "width": 2},
                    hovertemplate=f"{name}<br>step %{{x}}: %{{y}} slots {kind}<extra></extra>",
                )
            )
    capacities = {res.capacity_tokens for res in results.values()}
    if len(capacities) == 1:
        cap = capacities.pop()
        fig.add_hline(
            y=cap,
            line={"color": "#555555", "dash": "dot", "width": 1},
            annotation_text=f"capacity {cap} slots",
            annotation_position="top left",
        )
    fig.update_xaxes(title_text=STEP_AXIS)
    fig.update_yaxes(title_text="KV slots (tokens)", rangemode="tozero")
    fig.update_layout(
        title={"text": "Reserved vs real-token KV slots over time", "x": 0.01, "font": {"size": 14}},
        height=400,
        width=900,
        margin={"l": 70, "r": 20, "t": 60, "b": 50},
        meta={"onemask": "utilisation", "summaries": {n: r.summary() for n, r in results.items()}},
    )
    return fig


def sweep_figure(rows: list, *, contiguous: SimResult | None = None) -> go.Figure:
    """`lib.serving.sweep_block_sizes` rows drawn against the block size (log scale): the share of
    reserved slots holding real tokens, and the mean number of requests in the batch; a
    contiguous run, if given, as a dotted reference line in both."""
    if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, dict) for r in rows):
        raise TypeError("rows must be a non-empty list of summary dicts from lib.serving.sweep_block_sizes")
    need = {"block_size", "token_share", "mean_running", "preemptions"}
    for i, r in enumerate(rows):
        if not need <= set(r) or r["block_size"] is None:
            raise ValueError(f"rows[{i}] must be a paged summary with keys {sorted(need)}, got {sorted(r)}")
    sizes = [r["block_size"] for r in rows]
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.12,
        subplot_titles=["share of reserved slots holding real tokens", "requests running at once (mean)"],
    )
    hover = [f"block size {r['block_size']}: {r['preemptions']} preemptions" for r in rows]
    fig.add_trace(
        go.Scatter(
            x=sizes,
            y=[round(100 * r["token_share"], 2) for r in rows],
            name="paged",
            mode="lines+markers",
            line={"color": OKABE_ITO[0]},
            customdata=hover,
            hovertemplate="%{customdata}<br>%{y}% real tokens<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=sizes,
            y=[r["mean_running"] for r in rows],
            name="paged",
            showlegend=False,
            mode="lines+markers",
            line={"color": OKABE_ITO[0]},
            customdata=hover,
            hovertemplate="%{customdata}<br>%{y} requests on average<extra></extra>",
        ),
        row=1,
        col=2,
    )
    if contiguous is not None:
        _check_result("contiguous", contiguous)
        s = contiguous.summary()
        for col, y in ((1, round(100 * s["token_share"], 2)), (2, s["mean_running"])):
            fig.add_trace(
                go.Scatter(
                    x=[min(sizes), max(sizes)],
                    y=[y, y],
                    mode="lines",
                    name=contiguous.label(),
                    showlegend=col == 1,
                    line={"color": OKABE_ITO[1], "dash": "dot"},
                    hovertemplate=f"{contiguous.label()}: %{{y}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    fig.update_xaxes(type="log", tickvals=sizes, ticktext=[str(b) for b in sizes], title_text="block size (tokens)")
    fig.update_yaxes(title_text="%", range=[0, 101], row=1, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=1, col=2)
    fig.update_layout(
        title={"text": "Paged KV memory against the block size", "x": 0.01, "font": {"size": 14}},
        height=380,
        width=900,
        margin={"l": 60, "r": 20, "t": 80, "b": 50},
        meta={"onemask": "block_size_sweep", "rows": list(rows)},
    )
    return fig


# --------------------------------------------------------------------------- live view
@dataclass(frozen=True)
class MemoryMapState:
    n_requests: int = 200
    seed: int = 0
    arrival_rate: float = 1.0
    prompt_mean: int = 200
    output_mean: int = 200
    max_len: int = 1024
    capacity_tokens: int = 4096
    block_size: int = 16
    reserve: str = "max_len"


def _simulate(state: MemoryMapState) -> tuple[SimResult, SimResult]:
    reqs = make_workload(
        state.n_requests,
        seed=state.seed,
        arrival_rate=state.arrival_rate,
        prompt_mean=state.prompt_mean,
        output_mean=state.output_mean,
        max_len=state.max_len,
    )
    common = {"capacity_tokens": state.capacity_tokens, "max_len": state.max_len}
    return (
        simulate_serving(reqs, policy="contiguous", reserve=state.reserve, **common),
        simulate_serving(reqs, policy="paged", block_size=state.block_size, **common),
    )


def memory_map_view_figure(state: MemoryMapState | None = None, **changes) -> go.Figure:
    """The pair figure for a workload and memory described by `state` (the live view's figure)."""
    state = replace(state or MemoryMapState(), **changes)
    fig = memory_map_pair(*_simulate(state))
    fig.update_layout(meta={**fig.layout.meta, "state": {f.name: getattr(state, f.name) for f in fields(state)}})
    return fig


BLOCK_SLIDER_MAX = 64


def _min_capacity(max_len: int) -> int:
    """The smallest multiple of 256 that holds a max_len request in blocks of every slider size."""
    return -(-(max_len + BLOCK_SLIDER_MAX - 1) // 256) * 256


class MemoryMapView(LiveView):
    """Live face: block size, arrival rate, capacity, reserve rule and seed; both runs redrawn."""

    def __init__(self, state: MemoryMapState | None = None, **changes):
        import ipywidgets as W

        state = replace(state or MemoryMapState(), **changes)
        style = {"description_width": "initial"}
        self.controls = {
            "block_size": W.IntSlider(
                value=16, min=1, max=BLOCK_SLIDER_MAX, description="block size (tokens)", style=style
            ),
            "arrival_rate": W.FloatSlider(
                value=1.0,
                min=0.01,
                max=2.0,
                step=0.01,
                description="arrivals per step",
                readout_format=".2f",
                style=style,
            ),
            # the smallest capacity must hold one max_len request in blocks of any size up to 64:
            # floor(capacity / b) * b >= max_len needs capacity >= max_len + b - 1
            "capacity_tokens": W.IntSlider(
                value=4096,
                min=_min_capacity(state.max_len),
                max=max(16384, _min_capacity(state.max_len)),
                step=256,
                description="capacity (token slots)",
                style=style,
            ),
            "reserve": W.Dropdown(
                options=list(RESERVE_RULES), value="max_len", description="contiguous reserves", style=style
            ),
            "seed": W.IntSlider(value=0, min=0, max=9, description="seed", style=style),
        }
        c = self.controls
        self._start(
            state,
            lambda figure: W.VBox(
                [
                    W.HBox([c["block_size"], c["arrival_rate"], c["capacity_tokens"]]),
                    W.HBox([c["reserve"], c["seed"]]),
                    figure,
                ]
            ),
        )

    def _figure(self, state: MemoryMapState) -> go.Figure:
        """Simulate both policies for `state` and draw them."""
        return memory_map_view_figure(state)
