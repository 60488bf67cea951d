"""The KV calculator draws lib.kv_cache's numbers, for every value its controls allow."""

import json
from dataclasses import asdict, replace

import plotly.io as pio
import pytest

from lib.kv_cache import (
    DTYPE_BYTES,
    GPU_MEMORY_GB,
    PUBLIC_CONFIGS,
    ModelShape,
    estimate_params,
    format_bytes,
    kv_cache_bytes,
    max_batch,
    max_context,
    weight_bytes,
)
from widgets import use_stable_renderer
from widgets.kv_calculator import (
    CONTEXTS,
    KVCalcState,
    KVCalculator,
    attention_kinds_figure,
    calculator_numbers,
    kv_calculator_figure,
)

REL = 1e-5  # the figure keeps 6 significant digits of each GB value


def lib_numbers(state: KVCalcState) -> dict:
    """The numbers straight from lib, for a state whose shape is already consistent."""
    if state.model == "custom":
        L, H, H_kv, D = state.n_layers, state.n_heads, state.n_kv_heads, state.head_dim
        shape = ModelShape("custom", L, H, H_kv, D, H * D, estimate_params(L, H, H_kv, D), "test")
    else:
        shape = PUBLIC_CONFIGS[state.model]
    bpe, w_bpe = DTYPE_BYTES[state.dtype], DTYPE_BYTES[state.weight_dtype]
    memory = GPU_MEMORY_GB[state.gpu] * 10**9
    budget = {"memory_bytes": memory, "bytes_per_elem": bpe, "weight_bytes_per_elem": w_bpe}
    return {
        "cache": kv_cache_bytes(shape.n_layers, state.batch, state.context, shape.n_kv_heads, shape.head_dim, bpe),
        "weights": weight_bytes(shape.n_params, w_bpe),
        "memory": memory,
        "max_batch": max_batch(shape, seq_len=state.context, **budget),
        "max_context": max_context(shape, batch=state.batch, **budget),
    }


def assert_title_says(title: str, state: KVCalcState, n: dict) -> None:
    total = n["cache"] + n["weights"]
    assert f"{n['cache']:,} bytes = {format_bytes(n['cache'])}" in title  # GB and GiB
    assert f"weights ({state.weight_dtype}) " in title and format_bytes(n["weights"], binary=False) in title
    assert f"total {format_bytes(total, binary=False)}" in title
    if total <= n["memory"]:
        assert f"Fits in {state.gpu}" in title and "NOT" not in title
    else:
        assert "Does NOT fit" in title and state.gpu in title
    assert f"Largest batch at context {state.context:,}: {n['max_batch']:,};" in title
    assert f"longest context at batch {state.batch:,}: {n['max_context']:,} tokens" in title
    assert "e+" not in title and "nan" not in title.lower()


def assert_figure_draws(fig, state: KVCalcState) -> None:
    """`fig` shows lib's numbers for `state` (the state the figure says it draws)."""
    assert fig.layout.meta["state"] == asdict(state)
    n = lib_numbers(state)
    weights_bar, cache_bar, gpu_line = fig.data
    assert weights_bar.x[0] == pytest.approx(n["weights"] / 1e9, rel=REL)
    assert cache_bar.x[0] == pytest.approx(n["cache"] / 1e9, rel=REL)
    assert list(gpu_line.x) == [GPU_MEMORY_GB[state.gpu]] * 2
    assert weights_bar.text[0] == f"weights {format_bytes(n['weights'], binary=False)}"  # labelled, not colour alone
    assert cache_bar.text[0] == f"KV cache {format_bytes(n['cache'], binary=False)}"
    assert weights_bar.customdata[0][0] == f"{n['weights']:,}" and cache_bar.customdata[0][0] == f"{n['cache']:,}"
    assert_title_says(fig.layout.title.text, state, n)
    assert fig.layout.xaxis.range[1] >= max(n["cache"] + n["weights"], n["memory"]) / 1e9  # the bar and the line show


STATES = [
    KVCalcState(),
    *(KVCalcState(model=m).clamped() for m in PUBLIC_CONFIGS),
    KVCalcState(model="Llama-2-70B", batch=64, context=8192, gpu="141 GB (H200)"),  # over by the cache
    KVCalcState(model="Llama-2-70B", gpu="24 GB (RTX 4090)"),  # weights alone exceed memory
    KVCalcState(model="Llama-2-70B", dtype="int4", weight_dtype="int4", gpu="80 GB (A100/H100)", batch=1, context=128),
    KVCalcState(model="Falcon-7B", dtype="fp8", weight_dtype="bf16", batch=256, context=131072),
    KVCalcState(model="custom", n_layers=7, n_heads=12, n_kv_heads=3, head_dim=80, dtype="fp32", batch=5, context=999),
]


def state_id(s: KVCalcState) -> str:
    return f"{s.model}-{s.dtype}-{s.gpu.split()[0]}GB-{s.batch}x{s.context}"


@pytest.mark.parametrize("state", STATES, ids=state_id)
def test_static_figure_plots_libs_numbers(state):
    assert_figure_draws(kv_calculator_figure(state), state.clamped())


def test_the_issue_example_reads_32_gib_and_fits_on_an_80_gb_gpu():
    title = kv_calculator_figure().layout.title.text
    assert "34,359,738,368 bytes = 34.4 GB (32.0 GiB)" in title and "Fits in 80 GB (A100/H100)" in title


def test_buttons_carry_each_models_numbers():
    state = KVCalcState(batch=8, context=2048, dtype="bf16", weight_dtype="int4", gpu="24 GB (RTX 4090)")
    menu = kv_calculator_figure(state, buttons=True).layout.updatemenus[0]
    assert menu.active == list(PUBLIC_CONFIGS).index(state.model)
    assert [b.args[1]["meta.state"]["model"] for b in menu.buttons] == list(PUBLIC_CONFIGS)
    for b in menu.buttons:
        s = KVCalcState(**b.args[1]["meta.state"])
        assert (s.batch, s.context, s.dtype, s.weight_dtype, s.gpu) == (8, 2048, "bf16", "int4", "24 GB (RTX 4090)")
        n = lib_numbers(s)
        (w,), (c,) = b.args[0]["x"]
        assert w == pytest.approx(n["weights"] / 1e9, rel=REL) and c == pytest.approx(n["cache"] / 1e9, rel=REL)
        assert b.args[0]["customdata"] == [
            [[f"{n['weights']:,}", format_bytes(n["weights"])]],
            [[f"{n['cache']:,}", format_bytes(n["cache"])]],
        ]
        assert_title_says(b.args[1]["title.text"], s, n)
        assert list(b.args[2]) == [0, 1]  # the GPU line stays
        assert PUBLIC_CONFIGS[s.model].attention in b.label
    # applying a button's data reproduces that model's own figure
    for b in menu.buttons:
        own = kv_calculator_figure(KVCalcState(**b.args[1]["meta.state"]))
        assert [list(t.x) for t in own.data[:2]] == b.args[0]["x"]
        assert own.layout.title.text == b.args[1]["title.text"]


def test_a_custom_state_snaps_kv_heads_to_a_divisor_of_the_query_heads():
    for heads, kv, expected in [(32, 128, 32), (32, 5, 4), (32, 33, 32), (31, 8, 1), (71, 70, 1), (12, 6, 6)]:
        s = KVCalcState(model="custom", n_heads=heads, n_kv_heads=kv).clamped()
        assert s.n_kv_heads == expected and heads % s.n_kv_heads == 0
        assert_figure_draws(kv_calculator_figure(s), s)


def test_a_published_model_fills_the_shape_fields_from_its_config():
    s = KVCalcState(model="Falcon-7B", n_layers=1, n_heads=2, n_kv_heads=2, head_dim=32).clamped()
    assert (s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim) == (32, 71, 1, 64)
    assert "MQA: 71 query heads share 1 KV head" in kv_calculator_figure(s).layout.title.text


def test_figure_json_is_deterministic_and_finite():
    use_stable_renderer()
    a = pio.renderers._build_mime_bundle(kv_calculator_figure(buttons=True).to_dict())
    b = pio.renderers._build_mime_bundle(kv_calculator_figure(buttons=True).to_dict())
    assert a == b
    payload = json.dumps(a["application/vnd.plotly.v1+json"])
    assert "NaN" not in payload and "Infinity" not in payload
    assert len(a["text/html"]) < 200_000 and "https://" not in a["text/html"]


def test_bad_states_are_refused_by_name():
    for change, error, name in [
        ({"model": "GPT-5"}, ValueError, "model"),
        ({"dtype": "fp64"}, ValueError, "dtype"),
        ({"weight_dtype": 2}, ValueError, "weight_dtype"),
        ({"gpu": "8 GB"}, ValueError, "gpu"),
        ({"batch": 0}, ValueError, "batch"),
        ({"context": 4096.0}, TypeError, "context"),
        ({"n_heads": -1, "model": "custom"}, ValueError, "n_heads"),
    ]:
        with pytest.raises(error, match=name):
            kv_calculator_figure(**change)
    with pytest.raises(TypeError, match="state"):
        kv_calculator_figure({"model": "GPT-2"})
    with pytest.raises(TypeError, match="buttons"):
        kv_calculator_figure(buttons="yes")
    with pytest.raises(TypeError, match="state must be a KVCalcState"):
        calculator_numbers({"model": "GPT-2"})


# --------------------------------------------------------------------------- the live widget
def assert_in_sync(calc: KVCalculator) -> None:
    for name, control in calc.controls.items():
        assert control.value == getattr(calc.state, name), name
    assert_figure_draws(calc.figure, calc.state)


def control_values(calc: KVCalculator):
    """Every extreme of every slider and every option of every menu."""
    for name, control in calc.controls.items():
        if hasattr(control, "max"):
            yield from ((name, v) for v in (control.min, control.max, control.min))
        else:
            yield from ((name, v) for v in control.options if not isinstance(v, tuple))
            yield from ((name, v) for _, v in (o for o in control.options if isinstance(o, tuple)))


def test_every_control_value_redraws_libs_numbers():
    calc = KVCalculator()
    assert_in_sync(calc)
    for name, value in list(control_values(calc)):
        calc.controls[name].value = value
        if not (name == "n_kv_heads" and calc.state.n_kv_heads != value):  # n_kv_heads may snap down
            assert getattr(calc.state, name) == value
        assert_in_sync(calc)


def test_every_model_at_the_smallest_and_largest_batch_context_and_dtype():
    calc = KVCalculator()
    b, ctx = calc.controls["batch"], calc.controls["context"]
    for model in [*PUBLIC_CONFIGS, "custom"]:
        calc.controls["model"].value = model
        for dtype, batch, context in (("fp32", b.max, ctx.options[-1]), ("int4", b.min, ctx.options[0])):
            for name, value in (("dtype", dtype), ("weight_dtype", dtype), ("batch", batch), ("context", context)):
                calc.controls[name].value = value
            assert (calc.state.batch, calc.state.context) == (batch, context)
            assert_in_sync(calc)


def test_the_largest_shape_is_drawn_readably():
    calc = KVCalculator()
    for name in ("n_layers", "n_heads", "n_kv_heads", "batch"):
        calc.controls[name].value = calc.controls[name].max
    calc.controls["head_dim"].value = max(calc.controls["head_dim"].options)
    calc.controls["context"].value = CONTEXTS[-1]
    calc.controls["dtype"].value = "fp32"
    assert_in_sync(calc)
    s = calc.state
    assert (s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, s.batch, s.context) == (128, 128, 128, 256, 256, 131072)
    assert lib_numbers(s)["cache"] == 2**50  # 1.1 PB: written with units, not as 1.1e+15
    assert "1,125,899,906,842,624 bytes = 1.1 PB (1.0 PiB)" in calc.figure.layout.title.text
    for name in ("n_layers", "n_heads", "n_kv_heads", "batch"):
        calc.controls[name].value = 1
    calc.controls["head_dim"].value = min(calc.controls["head_dim"].options)
    calc.controls["context"].value = CONTEXTS[0]
    calc.controls["dtype"].value = "int4"
    assert_in_sync(calc)
    assert lib_numbers(calc.state)["cache"] == 4096  # 2 × 128 × 32 × 0.5 bytes


def test_kv_heads_above_the_query_heads_snap_instead_of_raising():
    calc = KVCalculator(model="custom", n_heads=32, n_kv_heads=8)
    calc.controls["n_kv_heads"].value = 128
    assert calc.state.n_kv_heads == 32 == calc.controls["n_kv_heads"].value
    calc.controls["n_kv_heads"].value = 7
    assert calc.state.n_kv_heads == 4 == calc.controls["n_kv_heads"].value
    calc.controls["n_heads"].value = 31  # a prime: only MQA or MHA divide it
    assert calc.state.n_kv_heads == 1
    assert_in_sync(calc)


def test_choosing_a_model_fills_the_sliders_and_moving_one_makes_it_custom():
    calc = KVCalculator()
    calc.controls["model"].value = "Llama-2-70B"
    c = calc.controls
    assert (c["n_layers"].value, c["n_heads"].value, c["n_kv_heads"].value, c["head_dim"].value) == (80, 64, 8, 128)
    assert "GQA: 64 query heads share 8 KV heads" in calc.figure.layout.title.text
    c["n_layers"].value = 40
    assert calc.state.model == "custom" == c["model"].value
    assert (calc.state.n_layers, calc.state.n_heads, calc.state.n_kv_heads) == (40, 64, 8)
    assert "estimated from the shape" in calc.figure.layout.title.text
    assert_in_sync(calc)
    c["model"].value = "Mistral-7B-v0.1"
    assert calc.state == KVCalcState(model="Mistral-7B-v0.1").clamped()
    assert_in_sync(calc)


def test_changing_the_model_dropdown_changes_the_plotted_data():
    """What the JupyterLab test does: pick another option of the first dropdown."""
    calc = KVCalculator()
    first = calc.widget.children[0].children[0]
    assert first is calc.controls["model"]
    before = [(list(t.x), list(t.text)) for t in calc.figure.data[:2]]
    first.value = next(v for _, v in first.options if v != first.value)
    after = [(list(t.x), list(t.text)) for t in calc.figure.data[:2]]
    assert before != after
    for (_, text_before), (_, text_after) in zip(before, after):
        assert text_before != text_after  # the bar labels change, not only the lengths


def test_moving_batch_redraws_in_place():
    calc = KVCalculator()
    figure, traces = calc.figure, calc.figure.data
    cache_before = calc.figure.data[1].x[0]
    calc.controls["batch"].value = 32
    assert calc.figure is figure and calc.figure.data[1] is traces[1]
    assert calc.figure.data[1].x[0] == pytest.approx(2 * cache_before, rel=REL)


def test_set_state_widens_controls_for_values_beyond_them():
    calc = KVCalculator()
    state = KVCalcState(model="custom", n_layers=200, n_heads=40, n_kv_heads=10, head_dim=100, batch=1000, context=5000)
    calc.set_state(state)
    assert calc.state == state.clamped()
    assert calc.controls["batch"].max == 1000 and 100 in calc.controls["head_dim"].options
    assert 5000 in calc.controls["context"].options
    assert_in_sync(calc)
    with pytest.raises(ValueError, match="model"):
        calc.set_state(KVCalcState(model="nope"))
    assert_in_sync(calc)  # a refused state leaves the widget as it was


def test_live_widget_has_a_stable_text_repr():
    bundle = KVCalculator()._repr_mimebundle_()
    assert bundle["text/plain"] == "KVCalculator (a live widget: run this cell in JupyterLab to use it)"
    assert "application/vnd.jupyter.widget-view+json" in bundle


# --------------------------------------------------------------------------- MHA vs GQA vs MQA
def test_attention_kinds_figure_draws_every_public_configs_cache():
    fig = attention_kinds_figure(batch=2, context=1024, dtype="bf16")
    assert [t.name for t in fig.data] == ["MHA", "GQA", "MQA"]
    seen = []
    for trace in fig.data:
        for name, x, text, custom in zip(trace.y, trace.x, trace.text, trace.customdata):
            shape = PUBLIC_CONFIGS[name]
            n = shape.cache_bytes(2, 1024, 2)
            assert shape.attention == trace.name
            assert text.startswith(trace.name)  # the kind is written, not only coloured
            assert x == pytest.approx(n / 1e9, rel=REL) and custom[0] == f"{n:,}" and format_bytes(n) in text
            seen.append(name)
    assert sorted(seen) == sorted(PUBLIC_CONFIGS)
    with pytest.raises(ValueError, match="dtype"):
        attention_kinds_figure(dtype="fp64")
    with pytest.raises(ValueError, match="batch"):
        attention_kinds_figure(batch=0)
    with pytest.raises(TypeError, match="context"):
        attention_kinds_figure(context="4k")


def test_replace_keeps_the_state_frozen():
    s = KVCalcState()
    with pytest.raises(AttributeError):
        s.batch = 3
    assert replace(s, batch=3).batch == 3 and s.batch == 16
