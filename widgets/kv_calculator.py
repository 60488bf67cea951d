"""The KV calculator: a model's weights and KV cache against one GPU's memory.

One stacked bar, weights then KV cache, in GB, beside a dashed line at the GPU's memory. The
title carries the exact numbers (cache bytes in GB and GiB, weights, total), says in words
whether it fits, and gives the largest batch at this context and the longest context at this
batch. Bars carry their own labels, so nothing is said by colour alone.

Two faces of one drawing function:
- `kv_calculator_figure(...)` returns a plain plotly figure; `buttons=True` adds one button per
  published config (MHA, GQA, MQA) at the same batch, context and dtypes, so it works with no
  kernel. `attention_kinds_figure(...)` compares every published config's cache in one chart.
- `KVCalculator(...)` wraps the same figure in a FigureWidget with a model menu, shape sliders,
  batch, context, dtypes and GPU, for live use in JupyterLab.
Every number comes from `lib.kv_cache`; this module only arranges and draws them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import plotly.graph_objects as go

from lib._checks import require_int
from lib.kv_cache import (
    DTYPE_BYTES,
    GB,
    GPU_MEMORY_GB,
    PUBLIC_CONFIGS,
    ModelShape,
    estimate_params,
    format_bytes,
    gpu_memory_bytes,
    max_batch,
    max_context,
)
from widgets._base import LiveView, move_control
from widgets._render import OKABE_ITO

__all__ = ["KVCalcState", "KVCalculator", "attention_kinds_figure", "calculator_numbers", "kv_calculator_figure"]

CUSTOM = "custom"
MODELS = (*PUBLIC_CONFIGS, CUSTOM)
SHAPE_FIELDS = ("n_layers", "n_heads", "n_kv_heads", "head_dim")
HEAD_DIMS = (32, 64, 80, 96, 128, 256)
CONTEXTS = tuple(2**i for i in range(7, 18))  # 128 .. 131,072 tokens
SHAPE_SLIDER_MAX = 128
BATCH_SLIDER_MAX = 256
SIGNIFICANT = 6  # figure data keep 6 significant digits: stable across machines, finer than the eye
WEIGHTS_COLOUR, CACHE_COLOUR, GPU_COLOUR = OKABE_ITO[0], OKABE_ITO[1], OKABE_ITO[7]
KIND_COLOURS = {"MHA": OKABE_ITO[0], "GQA": OKABE_ITO[2], "MQA": OKABE_ITO[5]}
CUSTOM_SOURCE = "custom shape from the calculator; n_params estimated by lib.kv_cache.estimate_params"


@dataclass(frozen=True)
class KVCalcState:
    """Everything the calculator draws.

    `model` is a PUBLIC_CONFIGS key or "custom". The shape fields describe the model when it is
    "custom"; for a published model `clamped()` fills them from its config, so a state always
    says what is drawn. A custom model's KV heads snap to the largest divisor of its query heads
    not above them (each KV head serves a whole group), and its weights are estimated.
    """

    model: str = "Llama-2-7B"
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    batch: int = 16
    context: int = 4096
    dtype: str = "fp16"
    weight_dtype: str = "fp16"
    gpu: str = "80 GB (A100/H100)"

    def clamped(self) -> "KVCalcState":
        """The same state, checked, with the shape fields made consistent (see the class doc)."""
        _check_state(self)
        if self.model != CUSTOM:
            c = PUBLIC_CONFIGS[self.model]
            return replace(self, n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim)
        kv = min(self.n_kv_heads, self.n_heads)
        while self.n_heads % kv:
            kv -= 1
        return replace(self, n_kv_heads=kv)

    def shape(self) -> ModelShape:
        """The published config, or the custom shape with estimated weights."""
        s = self.clamped()
        if s.model != CUSTOM:
            return PUBLIC_CONFIGS[s.model]
        return ModelShape(
            CUSTOM,
            s.n_layers,
            s.n_heads,
            s.n_kv_heads,
            s.head_dim,
            s.n_heads * s.head_dim,
            estimate_params(s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim),
            CUSTOM_SOURCE,
        )


def _check_state(state: KVCalcState) -> None:
    if not isinstance(state, KVCalcState):
        raise TypeError(f"state must be a KVCalcState, got {type(state).__name__}")
    for name, choices in (
        ("model", MODELS),
        ("dtype", tuple(DTYPE_BYTES)),
        ("weight_dtype", tuple(DTYPE_BYTES)),
        ("gpu", tuple(GPU_MEMORY_GB)),
    ):
        value = getattr(state, name)
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    for name in (*SHAPE_FIELDS, "batch", "context"):
        require_int(name, getattr(state, name), minimum=1)


def _resolve(state: KVCalcState | None, changes: dict) -> KVCalcState:
    if state is not None and not isinstance(state, KVCalcState):
        raise TypeError(f"state must be a KVCalcState or None, got {type(state).__name__}")
    return replace(state or KVCalcState(), **changes).clamped()


def calculator_numbers(state: KVCalcState) -> dict:
    """lib.kv_cache's numbers for `state`: cache, weight and total bytes, the GPU's memory, whether
    it fits, the largest batch at the state's context and the longest context at its batch."""
    _check_state(state)
    state = state.clamped()
    shape = state.shape()
    bpe, w_bpe = DTYPE_BYTES[state.dtype], DTYPE_BYTES[state.weight_dtype]
    memory = gpu_memory_bytes(state.gpu)
    cache, weights = shape.cache_bytes(state.batch, state.context, bpe), shape.weight_bytes(w_bpe)
    budget = {"memory_bytes": memory, "bytes_per_elem": bpe, "weight_bytes_per_elem": w_bpe}
    return {
        "shape": shape,
        "cache_bytes": cache,
        "weight_bytes": weights,
        "total_bytes": cache + weights,
        "memory_bytes": memory,
        "fits": cache + weights <= memory,
        "max_batch": max_batch(shape, seq_len=state.context, **budget),
        "max_context": max_context(shape, batch=state.batch, **budget),
    }


def _gb(n_bytes: int) -> float:
    return float(f"{n_bytes / GB:.{SIGNIFICANT}g}")


def _heads_text(shape: ModelShape) -> str:
    H, H_kv = shape.n_heads, shape.n_kv_heads
    if shape.attention == "MHA":
        return f"MHA: {H} query heads, {H_kv} KV heads, one each"
    heads = "KV head" if H_kv == 1 else "KV heads"
    return f"{shape.attention}: {H} query heads share {H_kv} {heads}, {H // H_kv} per KV head"


def _title(state: KVCalcState, n: dict) -> str:
    shape = n["shape"]
    custom = state.model == CUSTOM
    name = "custom shape" if custom else state.model
    weights = format_bytes(n["weight_bytes"], binary=False)
    weights = f"≈ {weights} (estimated from the shape)" if custom else weights
    memory, total = n["memory_bytes"], n["total_bytes"]
    if n["weight_bytes"] > memory:
        verdict = f"Does NOT fit: the weights alone exceed {state.gpu}"
    elif n["fits"]:
        verdict = f"Fits in {state.gpu} with {format_bytes(memory - total, binary=False)} to spare"
    else:
        verdict = f"Does NOT fit in {state.gpu}: over by {format_bytes(total - memory, binary=False)}"
    return (
        f"<b>{name}</b> ({_heads_text(shape)}; {shape.n_layers} layers, head dim {shape.head_dim})"
        f"<br>Batch {state.batch:,} × context {state.context:,}: KV cache ({state.dtype}) {n['cache_bytes']:,} bytes "
        f"= {format_bytes(n['cache_bytes'])}; weights ({state.weight_dtype}) {weights}; "
        f"total {format_bytes(total, binary=False)}"
        f"<br>{verdict}. Largest batch at context {state.context:,}: {n['max_batch']:,}; "
        f"longest context at batch {state.batch:,}: {n['max_context']:,} tokens"
    )


def _bar_data(state: KVCalcState, n: dict) -> dict:
    """What a button or a control change swaps into the weights and cache bars."""
    w, c = n["weight_bytes"], n["cache_bytes"]
    return {
        "x": [[_gb(w)], [_gb(c)]],
        "text": [[f"weights {format_bytes(w, binary=False)}"], [f"KV cache {format_bytes(c, binary=False)}"]],
        "customdata": [[[f"{w:,}", format_bytes(w)]], [[f"{c:,}", format_bytes(c)]]],
        "name": [f"weights ({state.weight_dtype})", f"KV cache ({state.dtype})"],
    }


def _x_range(n: dict) -> list[float]:
    return [0.0, _gb(int(1.08 * max(n["total_bytes"], n["memory_bytes"])))]


def kv_calculator_figure(state: KVCalcState | None = None, *, buttons: bool = False, **changes) -> go.Figure:
    """Weights and KV cache for `state` (or KVCalcState(**changes)) against the GPU's memory;
    `buttons=True` adds one button per published config, at the state's batch, context and dtypes."""
    state = _resolve(state, changes)
    if not isinstance(buttons, bool):
        raise TypeError(f"buttons must be a bool, got {type(buttons).__name__}")
    n = calculator_numbers(state)
    d = _bar_data(state, n)
    hover = "%{fullData.name}: %{customdata[0]} bytes = %{customdata[1]}<extra></extra>"
    bar = {
        "y": [0],
        "orientation": "h",
        "textposition": "inside",
        "insidetextanchor": "middle",
        "textfont": {"size": 13},
        "hovertemplate": hover,
        "width": 0.5,
    }
    gpu_gb, memory = _gb(n["memory_bytes"]), n["memory_bytes"]
    hatch = {"shape": "/", "fgcolor": "#ffffff", "fgopacity": 0.35}  # the cache differs by texture too
    fig = go.Figure(
        [
            go.Bar(
                x=d["x"][0],
                text=d["text"][0],
                customdata=d["customdata"][0],
                name=d["name"][0],
                marker={"color": WEIGHTS_COLOUR},
                **bar,
            ),
            go.Bar(
                x=d["x"][1],
                text=d["text"][1],
                customdata=d["customdata"][1],
                name=d["name"][1],
                marker={"color": CACHE_COLOUR, "pattern": hatch},
                **bar,
            ),
            go.Scatter(
                x=[gpu_gb, gpu_gb],
                y=[-0.45, 0.45],
                mode="lines+text",
                name=f"GPU memory: {state.gpu}",
                text=["", f"GPU: {state.gpu}"],
                textposition="top center",
                cliponaxis=False,
                line={"color": GPU_COLOUR, "dash": "dash", "width": 3},
                hovertemplate=f"GPU memory: {memory:,} bytes = {format_bytes(memory)}<extra></extra>",
            ),
        ]
    )
    fig.update_xaxes(
        title_text="memory (GB = 10⁹ bytes)",
        range=_x_range(n),
        rangemode="tozero",
        showgrid=True,
        gridcolor="#e5e5e5",
        zeroline=False,
    )
    fig.update_yaxes(tickvals=[0], ticktext=["this setup"], range=[-0.7, 0.8], showgrid=False, zeroline=False)
    fig.update_layout(
        barmode="stack",
        title={"text": _title(state, n), "x": 0.01, "y": 0.96, "yanchor": "top", "font": {"size": 13}},
        height=340,
        margin={"l": 90, "r": 30, "t": 110, "b": 60},
        plot_bgcolor="white",
        legend={"orientation": "h", "x": 1.0, "xanchor": "right", "y": -0.3, "yanchor": "top", "traceorder": "normal"},
        meta={"onemask": "kv_calculator", "state": asdict(state)},
    )
    if buttons:
        fig.update_layout(updatemenus=[_model_buttons(state)], height=400, margin={"t": 160}, title={"y": 0.97})
    return fig


def _model_buttons(state: KVCalcState) -> dict:
    """One button per published config; each carries that model's bars, title and axis range."""
    items = []
    for model in PUBLIC_CONFIGS:
        s = replace(state, model=model).clamped()
        n = calculator_numbers(s)
        d = _bar_data(s, n)
        label = f"{model} ({n['shape'].attention})"
        items.append(
            {
                "label": label,
                "method": "update",
                "args": [
                    {"x": d["x"], "text": d["text"], "customdata": d["customdata"], "name": d["name"]},
                    {"title.text": _title(s, n), "meta.state": asdict(s), "xaxis.range": _x_range(n)},
                    [0, 1],
                ],
            }
        )
    active = list(PUBLIC_CONFIGS).index(state.model) if state.model != CUSTOM else -1
    return {
        "type": "buttons",
        "direction": "right",
        "buttons": items,
        "showactive": True,
        "active": active,
        "x": 0.0,
        "xanchor": "left",
        "y": 1.62,
        "yanchor": "top",
        "pad": {"r": 4, "t": 4},
        "font": {"size": 11},
    }


def attention_kinds_figure(batch: int = 1, context: int = 4096, dtype: str = "fp16") -> go.Figure:
    """KV cache of every published config for `batch` sequences of `context` tokens, one bar each,
    grouped and labelled by attention kind (MHA, GQA, MQA)."""
    require_int("batch", batch, minimum=1)
    require_int("context", context, minimum=1)
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {list(DTYPE_BYTES)}, got {dtype!r}")
    fig = go.Figure()
    order = []
    for kind in ("MHA", "GQA", "MQA"):
        shapes = [s for s in PUBLIC_CONFIGS.values() if s.attention == kind]
        sizes = [s.cache_bytes(batch, context, DTYPE_BYTES[dtype]) for s in shapes]
        order += [s.name for s in shapes]
        fig.add_trace(
            go.Bar(
                y=[s.name for s in shapes],
                x=[_gb(b) for b in sizes],
                orientation="h",
                name=kind,
                marker={"color": KIND_COLOURS[kind]},
                textposition="outside",
                cliponaxis=False,
                text=[
                    f"{kind}, {s.n_kv_heads} KV head{'s' if s.n_kv_heads > 1 else ''} × {s.n_layers} layers: "
                    f"{format_bytes(b)}"
                    for s, b in zip(shapes, sizes)
                ],
                customdata=[[f"{b:,}"] for b in sizes],
                hovertemplate="%{y}: %{customdata[0]} bytes<extra></extra>",
            )
        )
    largest = max(s.cache_bytes(batch, context, DTYPE_BYTES[dtype]) for s in PUBLIC_CONFIGS.values())
    fig.update_xaxes(title_text="KV cache (GB = 10⁹ bytes)", range=[0, _gb(int(1.9 * largest))], gridcolor="#e5e5e5")
    fig.update_yaxes(categoryorder="array", categoryarray=order[::-1], showgrid=False)
    fig.update_layout(
        title={
            "text": f"KV cache for batch {batch:,} × context {context:,} tokens ({dtype}), by attention kind",
            "x": 0.01,
            "font": {"size": 14},
        },
        height=80 + 45 * len(order),
        margin={"l": 130, "r": 30, "t": 60, "b": 50},
        plot_bgcolor="white",
        legend={"title": {"text": "attention"}, "traceorder": "normal"},
        bargap=0.3,
        meta={"onemask": "attention_kinds", "state": {"batch": batch, "context": context, "dtype": dtype}},
    )
    return fig


class KVCalculator(LiveView):
    """Live face: a model menu and sliders above the same figure, redrawn in place.

    Choosing a model fills the shape sliders with its config; moving a shape slider switches the
    model to "custom".
    """

    def __init__(self, state: KVCalcState | None = None, **changes):
        import ipywidgets as W

        state = _resolve(state, changes)
        style = {"description_width": "initial"}

        def slider(description: str, maximum: int, **kw):
            return W.IntSlider(value=1, min=1, max=maximum, description=description, style=style, **kw)

        def menu(description: str, options):
            return W.Dropdown(options=options, description=description, style=style)

        self.controls = {
            # The model menu comes first: it is the control a reader (and the browser test) tries first.
            "model": menu("model", [(m, m) for m in PUBLIC_CONFIGS] + [("custom (use the sliders)", CUSTOM)]),
            "n_layers": slider("layers", SHAPE_SLIDER_MAX, continuous_update=False),
            "n_heads": slider("query heads", SHAPE_SLIDER_MAX, continuous_update=False),
            "n_kv_heads": slider(
                "KV heads",
                SHAPE_SLIDER_MAX,
                continuous_update=False,
                tooltip="snaps to a divisor of the query heads: each KV head serves a whole group",
            ),
            "head_dim": menu("head dim", list(HEAD_DIMS)),
            "batch": slider("batch", BATCH_SLIDER_MAX),
            "context": W.SelectionSlider(options=list(CONTEXTS), description="context (tokens)", style=style),
            "dtype": menu("cache dtype", list(DTYPE_BYTES)),
            "weight_dtype": menu("weight dtype", list(DTYPE_BYTES)),
            "gpu": menu("GPU", list(GPU_MEMORY_GB)),
        }
        c = self.controls
        row = W.Layout(flex_flow="row wrap")
        self._start(
            state,
            lambda figure: W.VBox(
                [
                    W.HBox([c["model"], c["gpu"], c["dtype"], c["weight_dtype"]], layout=row),
                    W.HBox([c["n_layers"], c["n_heads"], c["n_kv_heads"], c["head_dim"]], layout=row),
                    W.HBox([c["batch"], c["context"]], layout=row),
                    figure,
                ]
            ),
        )

    @staticmethod
    def _figure(state: KVCalcState) -> go.Figure:
        # A fixed width: inside a widget area plotly's autosize picks a cramped default.
        return kv_calculator_figure(state).update_layout(width=1000)

    def _checked(self, state: KVCalcState) -> KVCalcState:
        return _resolve(state, {})

    def _sync_controls(self, state: KVCalcState) -> None:
        """Move the controls to `state`, widening a slider or adding a menu option it lacks."""
        with self._quietly():
            for name, control in self.controls.items():
                value = getattr(state, name)
                if name in ("head_dim", "context") and value not in control.options:
                    control.options = sorted([*control.options, value])
                move_control(control, value)

    def _state_from_controls(self, name: str, value) -> KVCalcState:
        if name in SHAPE_FIELDS:
            return replace(self.state, model=CUSTOM, **{name: value})
        return replace(self.state, **{name: value})  # a published model refills the shape in clamped()
