"""The router view draws exactly the loads, losses and probe assignments it is given, at every
frame and control value, and refuses inconsistent records with a message instead of drawing garbage."""

import ast
import inspect
import json
from types import SimpleNamespace

import numpy as np
import pytest

import widgets.router_view as router_view
from widgets.router_view import MAX_FRAMES, RouterView, check_router_runs, router_figure


def _run(S=12, L=2, E=4, seed=0, probe=False):
    """A fake training record: loads are shares (each layer's row sums to 1)."""
    rng = np.random.default_rng(seed)
    run = {
        "load": rng.dirichlet(np.ones(E), size=(S, L)),
        "loss": 3.0 - np.linspace(0, 1, S) + rng.uniform(0, 0.1, S),
        "aux_loss": rng.uniform(2.0, 2.5, S),
    }
    if probe:
        run["assignments"] = rng.integers(0, E, size=(3, L, 40))
        run["assignment_steps"] = [0, S // 2, S - 1]
    return run


def _moving(E):
    """The traces that follow the step: bars, step marker, loss dot, aux dot (and the probe strip)."""
    return {"bars": 0, "marker": E + 3, "loss": E + 5, "aux": E + 7, "strip": E + 8}


def test_every_frame_shows_that_steps_load_and_losses():
    runs = {"α = 0": _run(seed=1), "α = 0.01": _run(seed=2)}
    for label, rec in runs.items():
        for layer in (0, 1):
            fig = router_figure(runs, run=label, layer=layer)
            idx = _moving(4)
            assert [f.name for f in fig.frames] == [str(s) for s in range(12)]  # S <= MAX_FRAMES: every step
            assert len(fig.layout.sliders[0].steps) == 12 and fig.layout.sliders[0].active == 11
            for s, frame in enumerate(fig.frames):
                data = dict(zip(frame.traces, frame.data))
                assert np.allclose(data[idx["bars"]].y, rec["load"][s, layer], rtol=1e-3)  # 4 significant digits
                assert [float(t) for t in data[idx["bars"]].text] == pytest.approx(rec["load"][s, layer], rel=1e-2)
                assert list(data[idx["marker"]].x) == [s, s]
                assert data[idx["loss"]].y[0] == pytest.approx(rec["loss"][s], rel=1e-3)
                assert data[idx["aux"]].y[0] == pytest.approx(rec["aux_loss"][s], rel=1e-3)
                assert f"{label}, layer {layer}, step {s} of 11" in frame.layout.title.text
            # the shown step's traces equal the last frame's
            assert np.allclose(fig.data[0].y, rec["load"][-1, layer], rtol=1e-3)


def test_exact_loads_are_drawn_exactly():
    load = np.array([[[0.5, 0.25, 0.125, 0.125]], [[0.25, 0.25, 0.25, 0.25]], [[1.0, 0.0, 0.0, 0.0]]])  # (3, 1, 4)
    fig = router_figure({"r": {"load": load, "loss": [3.0, 2.5, 2.0], "aux_loss": [1.5, 1.0, 2.0]}}, step=0)
    for s, frame in enumerate(fig.frames):
        assert list(frame.data[0].y) == load[s, 0].tolist()
    assert list(fig.data[0].y) == load[0, 0].tolist()
    last = fig.frames[2].layout.title.text
    assert "4.00× the even share" in last and "3 of 4 experts got no token" in last
    for e in range(4):  # each expert's line over training is its column
        assert list(fig.data[2 + e].y) == load[:, 0, e].tolist() and fig.data[2 + e].name == f"expert {e}"


def test_long_runs_get_at_most_forty_frames_including_the_shown_step():
    rec = _run(S=1000, L=1, E=8)
    fig = router_figure({"r": rec}, step=123)
    steps = [int(f.name) for f in fig.frames]
    assert len(steps) <= MAX_FRAMES and steps == sorted(set(steps))
    assert {0, 123, 999} <= set(steps) and fig.layout.meta["frame_steps"] == steps
    assert fig.layout.sliders[0].steps[fig.layout.sliders[0].active].label == "123"
    for s, frame in zip(steps, fig.frames):
        assert np.allclose(frame.data[0].y, rec["load"][s, 0], rtol=1e-3)
    size = len(json.dumps(fig.to_plotly_json(), default=str))
    assert size < 150_000, f"the static figure is {size} bytes: too heavy for a notebook"


@pytest.mark.parametrize("E", [1, 3, 8, 20])
def test_even_share_line_sits_at_one_over_E(E):
    fig = router_figure({"r": _run(S=5, L=1, E=E)})
    assert list(fig.data[1].y) == [1 / E, 1 / E] and list(fig.data[1].x) == [-0.5, E - 0.5]
    assert list(fig.data[E + 2].y) == [1 / E, 1 / E]  # the same line on the over-training panel
    assert "1/E" in fig.data[1].name and "dash" == fig.data[1].line.dash
    assert any(a.text == f"1/E = {1 / E:.3g}" for a in fig.layout.annotations)
    assert fig.layout.yaxis.range[1] >= 1 / E  # the line is always in view


def test_probe_strip_shows_the_sample_at_or_before_the_step_with_expert_numbers():
    rec = _run(S=12, L=2, E=4, probe=True)  # samples at steps 0, 6, 11; 40 tokens wrap into two rows
    rec["tokens"] = [f"t{i}" for i in range(40)]
    fig = router_figure({"r": rec}, layer=1, step=7)
    strip = fig.data[-2]  # the last trace writes the probe's characters on it
    row = rec["assignments"][1, 1]  # step 7 -> the sample at step 6, layer 1
    assert np.array(strip.z, dtype=float).ravel()[:40].tolist() == row.tolist()
    assert [t for r in strip.text for t in r][:40] == [str(e) for e in row]  # the number, not colour alone
    assert strip.customdata[1][0] == "token 32 't32'"
    assert "routed at step 6" in fig.layout.title.text
    for frame in fig.frames:
        s = int(frame.name)
        sample = 0 if s < 6 else 1 if s < 11 else 2
        assert np.array(frame.data[-2].z, dtype=float).ravel()[:40].tolist() == rec["assignments"][sample, 1].tolist()
    # 2-D assignments (one layer's routing) default their steps when there is one row per step
    flat = {
        "load": rec["load"],
        "loss": rec["loss"],
        "aux_loss": rec["aux_loss"],
        "assignments": np.zeros((12, 5), dtype=int),
    }
    assert check_router_runs({"r": flat})["r"]["assignment_steps"].tolist() == list(range(12))


def _probe_labels(fig):
    """The trace that writes the probe's characters on the strip, as {(x, y): label}."""
    labels = [t for t in fig.data if t.name == "probe tokens"]
    assert len(labels) == 1 and labels[0].mode == "text"
    return labels[0], {(x, round(y)): text for x, y, text in zip(labels[0].x, labels[0].y, labels[0].text)}


def test_probe_characters_are_written_on_the_strip_at_every_control_value():
    """A projector shows no hover: every probe character is a text label in the figure's data, 16 px,
    one per cell (two glyphs at most, so neighbours never overlap), blanks made visible, for the
    default view and the extreme steps, layers and runs the controls allow."""
    text = "the cat <sat> & ran\nto\tx"  # 24 characters, with the blanks and HTML's special characters
    runs = {}
    for seed, S in ((1, 12), (2, 5)):
        rec = _run(S=S, L=2, E=4, seed=seed, probe=True)
        rec["assignments"], rec["assignment_steps"] = rec["assignments"][:, :, : len(text)], [0, S // 2, S - 1]
        rec["tokens"] = list(text)
        runs[f"run {seed}"] = rec
    shown = [
        "t",
        "h",
        "e",
        "␣",
        "c",
        "a",
        "t",
        "␣",
        "&lt;",
        "s",
        "a",
        "t",
        "&gt;",
        "␣",
        "&amp;",
        "␣",
        "r",
        "a",
        "n",
        "↵",
        "t",
        "o",
        "⇥",
        "x",
    ]
    view = RouterView(runs)
    for fig in [router_figure(runs), view.figure]:  # the static default (last step) and the live one (step 0)
        trace, at = _probe_labels(fig)
        assert trace.textfont.size >= 14 and [at[(i, 0)] for i in range(len(text))] == shown
    c = view.controls
    for label in c["run"].options:
        c["run"].value = label
        for layer in (0, 1):
            c["layer"].value = layer
            for step in (c["step"].min, c["step"].max):
                c["step"].value = step
                trace, at = _probe_labels(view.figure)
                assert [at[(i, 0)] for i in range(len(text))] == shown
                strip = view.figure.data[-2]  # the expert ids stay, at the cells' centre
                experts = runs[label]["assignments"][-1 if step == c["step"].max else 0, layer]
                assert [int(t) for t in strip.text[0][: len(text)]] == experts.tolist()
                # the ink contrasts with the cell: white on the dark blue of expert 0, black elsewhere here
                assert list(trace.textfont.color) == ["#ffffff" if e == 0 else "#000000" for e in experts]
    fig = router_figure(runs, layer=1)  # every frame recolours the ink with the cells
    labels = len(fig.data) - 1
    for frame in fig.frames:
        ink = dict(zip(frame.traces, frame.data))[labels].textfont.color
        experts = runs["run 1"]["assignments"][
            router_view._sampled_row(check_router_runs(runs)["run 1"], int(frame.name)), 1
        ]
        assert list(ink) == ["#ffffff" if e == 0 else "#000000" for e in experts]
    # many tokens wrap into rows, one label per cell; long tokens are cut to two glyphs, none without tokens
    rec = _run(S=3, L=1, E=2, probe=True)
    rec["assignments"] = rec["assignments"][:, :1] % 2
    rec["tokens"] = [f"word{i}" for i in range(40)]
    _, at = _probe_labels(router_figure({"r": rec}, step=0))
    assert len(at) == 40 and at[(0, 1)] == "w…" and all(len(v) <= 2 for v in at.values())
    del rec["tokens"]
    trace, at = _probe_labels(router_figure({"r": rec}, step=2))
    assert at == {}


def test_single_step_run_and_one_expert_one_layer():
    one = {"load": np.ones((1, 1, 1)), "loss": [2.0], "aux_loss": [1.0], "assignments": np.zeros((1, 5))}
    fig = router_figure({"r": one})
    assert not fig.frames and fig.layout.meta["shape"] == [1, 1, 1] and list(fig.data[0].y) == [1.0]
    assert "1.00× the even share" in fig.layout.title.text
    view = RouterView({"r": one})
    assert set(view.controls) == {"step"} and view.controls["step"].max == 0
    fig = router_figure({"r": _run(S=7, L=1, E=1)}, step=3)
    assert len(fig.frames) == 7 and list(fig.data[0].y) == [1.0]


def test_torch_tensors_and_record_objects_are_accepted():
    torch = pytest.importorskip("torch")
    load = torch.softmax(torch.randn(6, 2, 4), dim=-1)
    loss, aux = torch.rand(6) + 1, torch.rand(6) + 2
    fig = router_figure(
        {
            "t": {
                "load": load,
                "loss": loss,
                "aux_loss": aux,
                "assignments": torch.randint(0, 4, (2, 9)),
                "assignment_steps": torch.tensor([0, 3]),
            }
        },
        step=4,
        animate=False,
    )
    assert np.allclose(fig.data[0].y, load[4, 0].numpy(), rtol=1e-3)
    # a record with these attributes (as lib.moe_lm.MoETrainRecord has) is read by attribute
    record = SimpleNamespace(load=load, loss=loss.tolist(), aux_loss=aux.tolist(), drop_rate=[0.0] * 6, alpha=0.01)
    fig = router_figure({"α = 0.01": record}, layer=1, step=2, animate=False)
    assert np.allclose(fig.data[0].y, load[2, 1].numpy(), rtol=1e-3)


def _with(**changes):
    run = _run(S=5, L=1, E=3)
    run.update(changes)
    return {"r": {k: v for k, v in run.items() if v is not None}}


@pytest.mark.parametrize(
    "runs, words",
    [
        ({}, "non-empty"),
        ([1, 2], "non-empty"),
        ({"r": 3.0}, "must be a dict"),
        (_with(aux_loss=None), "missing ['aux_loss']"),
        (_with(load=np.ones((5, 3)) / 3), "load[:, None, :]"),
        (_with(load=np.ones((0, 1, 3))), "shape (steps, L, E)"),
        (_with(loss=np.ones(4)), "steps mismatch"),
        (_with(aux_loss=np.ones((5, 1))), "steps mismatch"),
        (_with(load=np.full((5, 1, 3), np.nan)), "non-finite"),
        (_with(loss=[1, 2, np.inf, 3, 4]), "non-finite"),
        (_with(load=-np.ones((5, 1, 3))), "negative"),
        (_with(load="lots"), "must be numbers"),
        ({"a": _run(S=5, L=1, E=3), "b": _run(S=5, L=1, E=4)}, "one (L, E)"),
        (_with(assignments=np.zeros((2, 6), dtype=int)), "give 'assignment_steps'"),
        (_with(assignments=np.full((5, 6), 3)), "ints in [0, 2]"),
        (_with(assignments=np.full((5, 6), 0.5)), "ints in [0, 2]"),
        (_with(assignments=np.zeros((5, 2, 6))), "(S', L=1, n_tokens)"),
        (_with(assignments=np.zeros((2, 6)), assignment_steps=[0, 1, 2]), "one step per"),
        (_with(assignments=np.zeros((2, 6)), assignment_steps=[3, 1]), "increasing step indices in [0, 4]"),
        (_with(assignments=np.zeros((2, 6)), assignment_steps=[0, 5]), "increasing step indices in [0, 4]"),
        (_with(assignment_steps=[0]), "no 'assignments'"),
        (_with(assignments=np.zeros((5, 6)), tokens=["a"]), "6 probe tokens"),
    ],
)
def test_bad_records_are_refused_with_a_reason(runs, words):
    with pytest.raises(ValueError) as err:
        check_router_runs(runs)
    assert words in str(err.value)


def test_bad_run_layer_or_step_is_refused():
    runs = {"a": _run(S=5, L=2, E=3)}
    with pytest.raises(ValueError, match="run must be one of"):
        router_figure(runs, run="b")
    for bad in (-1, 2, 1.0, True):
        with pytest.raises(ValueError, match="layer must be"):
            router_figure(runs, layer=bad)
    for bad in (-1, 5, 2.0, False):
        with pytest.raises(ValueError, match="step must be"):
            router_figure(runs, step=bad)


def _plotted(fig):
    """What the browser test compares: every trace's z and text."""
    return json.dumps([[t.to_plotly_json().get("z"), t.to_plotly_json().get("text")] for t in fig.data], default=str)


def test_live_view_survives_every_control_value_and_redraws():
    import ipywidgets as W

    runs = {"α = 0": _run(S=6, seed=1, probe=True), "α = 0.01": _run(S=4, seed=2), "α = 0.1": _run(S=6, seed=3)}
    view = RouterView(runs)
    c = view.controls
    assert set(c) == {"run", "layer", "step"} and c["step"].value == 0  # starts at step 0: room to move right

    def sliders(w):
        kids = getattr(w, "children", ())
        return [w] if isinstance(w, W.IntSlider) else [s for k in kids for s in sliders(k)]

    assert sliders(view.widget)[-1] is c["step"]  # the last slider is the step slider

    before = _plotted(view.figure)
    c["step"].value = 3
    assert _plotted(view.figure) != before
    assert list(view.figure.data[0].y) == pytest.approx(runs["α = 0"]["load"][3, 0], rel=1e-3)
    before = _plotted(view.figure)
    c["run"].value = "α = 0.01"
    assert _plotted(view.figure) != before
    for label in c["run"].options:
        c["run"].value = label
        S = runs[label]["load"].shape[0]
        assert c["step"].max == S - 1
        for layer in (0, 1):
            c["layer"].value = layer
            seen = set()
            for s in range(c["step"].min, c["step"].max + 1):
                c["step"].value = s
                assert view.figure.layout.meta["run"] == label and view.figure.layout.meta["step"] == s
                assert view.figure.layout.meta["layer"] == layer
                assert list(view.figure.data[0].y) == pytest.approx(runs[label]["load"][s, layer], rel=1e-3)
                assert list(view.figure.data[view.figure.layout.meta["shape"][2] + 3].x) == [s, s]
                seen.add(_plotted(view.figure))
            assert len(seen) == S  # every step draws something different
            c["step"].value = c["step"].max  # the longest run's last step, before a shorter run is chosen
    c["run"].value = "α = 0"
    c["step"].value = 5
    c["run"].value = "α = 0.01"  # 4 steps: the slider is pulled back into range
    assert c["step"].value == 3 and view.figure.layout.meta["step"] == 3
    assert "no probe assignments" in view.figure.layout.annotations[4].text
    c["run"].value = "α = 0"
    assert "probe tokens" in view.figure.layout.annotations[4].text and view.figure.data[-2].z[0][0] is not None
    assert "live widget" in view._repr_mimebundle_()["text/plain"]


def test_one_run_one_layer_has_only_the_step_slider():
    view = RouterView({"α = 0.01": _run(S=6, L=1, E=4)}, step=2)
    assert set(view.controls) == {"step"} and view.figure.layout.meta["step"] == 2
    before = _plotted(view.figure)
    view.controls["step"].value = 5
    assert _plotted(view.figure) != before


def test_widget_imports_no_model_code():
    tree = ast.parse(inspect.getsource(router_view))
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if m == "lib" or m.startswith("lib.") or m == "torch"]


def test_balance_figure_draws_f_and_P_apart_exactly():
    from widgets.router_view import balance_figure

    curves = {
        "α = 0": {"steps": [0, 10, 20], "busiest": [1.0, 1.8, 2.3], "busiest_prob": [1.0, 1.4, 1.6]},
        "α = 1": {"steps": [0, 10, 20], "busiest": [1.0, 1.7, 1.71], "busiest_prob": [1.0, 1.01, 1.001]},
    }
    fig = balance_figure(curves)
    assert [(t.name, t.xaxis) for t in fig.data] == [("α = 0", "x"), ("α = 0", "x2"), ("α = 1", "x"), ("α = 1", "x2")]
    for t, (name, key) in zip(
        fig.data, [("α = 0", "busiest"), ("α = 0", "busiest_prob"), ("α = 1", "busiest"), ("α = 1", "busiest_prob")]
    ):
        assert list(t.x) == [0, 10, 20] and list(t.y) == curves[name][key]
    assert [s.y0 for s in fig.layout.shapes] == [1.0, 1.0]  # the even share in both panels
    # a record object gives every step of its imbalance and prob_imbalance
    rec = SimpleNamespace(imbalance=[1.0, 2.0], prob_imbalance=[1.0, 1.5])
    one = balance_figure({"run": rec})
    assert list(one.data[0].y) == [1.0, 2.0] and list(one.data[1].y) == [1.0, 1.5] and list(one.data[0].x) == [0, 1]
    single = balance_figure({"x": {"steps": [5], "busiest": [1.2], "busiest_prob": [1.1]}})
    assert single.data[0].mode == "markers"  # one step: nothing to join


@pytest.mark.parametrize(
    "curves,words",
    [
        ({}, "non-empty mapping"),
        ({"a": {"steps": [0], "busiest": [1.0]}}, "'busiest_prob'"),
        ({"a": {"steps": [0, 1], "busiest": [1.0], "busiest_prob": [1.0, 1.0]}}, "1-D of one length"),
        ({"a": {"steps": [0], "busiest": [0.5], "busiest_prob": [1.0]}}, ">= 1"),
        ({"a": {"steps": [0], "busiest": [float("nan")], "busiest_prob": [1.0]}}, "non-finite"),
    ],
)
def test_balance_figure_refuses_bad_curves(curves, words):
    from widgets.router_view import balance_figure

    with pytest.raises(ValueError, match=words):
        balance_figure(curves)
