"""The SSM state animator draws exactly the states and step sizes it is given, at every step, and
refuses inconsistent records with a message instead of drawing garbage."""

import numpy as np
import pytest

from widgets.ssm_state import MAX_STEPS, SSMStateView, check_runs, masked_attention_figure, ssm_state_figure


def _runs(L=6, D=4, N=3, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "selective": (rng.normal(size=(L, D, N)), rng.uniform(0.01, 2.0, size=(L, D))),
        "fixed Δ, B, C": (rng.normal(size=(L, D, N)), np.full((L, D), 0.1)),
    }


def test_every_frame_shows_that_steps_state_and_step_size():
    tokens, runs = list("abcdef"), _runs()
    fig = ssm_state_figure(tokens, runs)
    assert len(fig.frames) == len(tokens) and len(fig.layout.sliders[0].steps) == len(tokens)
    for t, frame in enumerate(fig.frames):
        for i, (h, delta) in enumerate(runs.values()):
            assert np.allclose(np.array(frame.data[2 * i].z), h[t], rtol=1e-3)  # drawn to 4 significant digits
            assert np.allclose(np.array(frame.data[2 * i + 1].y), delta[t], rtol=1e-3)
        assert f"<b>[{tokens[t]}]</b>" in frame.layout.title.text
    # one colour scale for all frames and runs, symmetric about zero, so fading is visible; set by the
    # 98th percentile of |h| so that a few large entries do not wash the rest out
    zmax = np.percentile(np.abs(np.concatenate([h.ravel() for h, _ in runs.values()])), 98)
    assert fig.data[0].zmax == pytest.approx(zmax) and fig.data[0].zmin == pytest.approx(-zmax)


def test_static_step_and_single_token():
    fig = ssm_state_figure(list("abcdef"), _runs(), step=2, animate=False)
    assert not fig.frames and fig.layout.meta["step"] == 2
    one = ssm_state_figure(["x"], _runs(L=1))
    assert one.layout.meta["shape"] == [1, 4, 3] and not one.frames


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    h, d = torch.randn(3, 2, 2), torch.rand(3, 2)
    fig = ssm_state_figure(list("abc"), {"run": (h, d)}, animate=False)
    assert np.allclose(np.array(fig.data[0].z), h[-1].numpy(), rtol=1e-3)


@pytest.mark.parametrize(
    "tokens, runs, words",
    [
        (list("abc"), {}, "non-empty"),
        (list("abc"), {"r": (np.zeros((4, 2, 2)), np.zeros((4, 2)))}, "(L=3"),
        (list("abc"), {"r": (np.zeros((3, 2, 2)), np.zeros((3, 5)))}, "delta must have shape"),
        (
            list("abc"),
            {"r": (np.zeros((3, 2, 2)), np.zeros((3, 2))), "s": (np.zeros((3, 3, 2)), np.zeros((3, 3)))},
            "one shape",
        ),
        (list("abc"), {"r": (np.full((3, 2, 2), np.nan), np.zeros((3, 2)))}, "non-finite"),
        ([], {"r": (np.zeros((0, 2, 2)), np.zeros((0, 2)))}, "1.."),
        (list("abc"), {"r": np.zeros((3, 2, 2))}, "pair"),
    ],
)
def test_bad_records_are_refused_with_a_reason(tokens, runs, words):
    with pytest.raises(ValueError, match=None) as err:
        check_runs(tokens, runs)
    assert words in str(err.value)


def test_bad_step_is_refused():
    for bad in (-1, 6, 2.0, True):
        with pytest.raises(ValueError, match="step must be"):
            ssm_state_figure(list("abcdef"), _runs(), step=bad)


def test_live_view_survives_every_slider_value_and_new_text():
    calls = []

    def recompute(text):
        calls.append(text)
        if "!" in text:
            raise ValueError("unknown character '!'")
        return list(text), _runs(L=len(text), seed=len(text))

    view = SSMStateView(list("abcdef"), _runs(), recompute=recompute, text="abcdef")
    slider = view.controls["step"]
    seen = set()
    for value in range(slider.min, slider.max + 1):
        slider.value = value
        assert view.figure.layout.meta["step"] == value - 1
        seen.add(tuple(np.array(view.figure.data[0].z).ravel()))
    assert len(seen) == 6  # every step draws a different state
    view.controls["text"].value = "xyzw"
    assert slider.max == 4 and view.figure.layout.meta["shape"] == [4, 4, 3]
    view.controls["text"].value = "bad!"
    assert "unknown character" in view.status.value and slider.max == 4  # the old view stays
    view.controls["text"].value = ""
    assert "1.." in view.status.value
    assert "live widget" in view._repr_mimebundle_()["text/plain"]


def _ssd(T=5, seed=0):
    rng = np.random.default_rng(seed)
    gaps = np.cumsum(rng.uniform(0.0, 1.0, T))  # S_t
    decay = np.tril(np.exp(-(gaps[:, None] - gaps[None, :])))  # exp(A (S_t − S_s)), A = −1, 0 above
    weights = np.tril(rng.normal(size=(T, T)))
    return [f"t{i}" for i in range(T)], decay, weights


def test_masked_attention_figure_draws_the_mask_the_decay_and_the_weights():
    tokens, decay, weights = _ssd()
    fig = masked_attention_figure(tokens, decay, weights, title="probe")
    mask, left, w = fig.data
    T = len(tokens)
    assert np.array_equal(np.array(mask.z), np.triu(np.ones((T, T), dtype=int), 1))  # lesson 01's causal mask
    assert [row[-1] for row in mask.text[:-1]] == ["−∞"] * (T - 1) and mask.text[-1][-1] == "0"
    for trace, values in ((left, decay), (w, weights)):
        z = np.array([[np.nan if v is None else v for v in row] for row in trace.z], dtype=float)
        assert np.isnan(z[np.triu_indices(T, 1)]).all()  # no cell drawn above the diagonal
        below = np.tril_indices(T)
        assert np.allclose(z[below], values[below], rtol=1e-3)  # four significant digits
    assert w.zmax == pytest.approx(np.abs(weights).max()) and w.zmin == -w.zmax  # symmetric: the sign shows
    assert fig.layout.title.text == "probe"
    one = masked_attention_figure(["x"], [[1.0]], [[0.0]])  # T = 1 and an all-zero W still draw
    assert one.data[2].zmax == 1.0


def test_masked_attention_figure_refuses_what_no_masked_attention_gives():
    tokens, decay, weights = _ssd()
    with pytest.raises(ValueError, match=r"decay must have shape \(T, T\) = \(5, 5\)"):
        masked_attention_figure(tokens, decay[:4], weights)
    with pytest.raises(ValueError, match="must be 0 above the diagonal"):
        masked_attention_figure(tokens, decay, weights + 1.0)
    with pytest.raises(ValueError, match=r"decay must lie in \[0, 1\]"):
        masked_attention_figure(tokens, 2 * decay, weights)
    with pytest.raises(ValueError, match="weights holds non-finite"):
        masked_attention_figure(tokens, decay, np.where(weights != 0, np.inf, 0.0))
    with pytest.raises(ValueError, match="tokens must hold 1"):
        masked_attention_figure([], [], [])


def _delta_panel(fig):
    """The Δ-over-the-tokens panel: run -> {channel: line}, run -> current-step line, run -> dots."""
    lines, steps, dots = {}, {}, {}
    for trace in fig.data:
        meta = trace.meta or {}
        if "channel" in meta:
            lines.setdefault(meta["run"], {})[meta["channel"]] = trace
        elif meta.get("marker") == "step":
            steps[meta["run"]] = trace
        elif meta.get("marker") == "values":
            dots[meta["run"]] = trace
    return lines, steps, dots


def _traced_runs(text="A..B.?", d_model=8):
    """Δ and h as lib.mamba_lm.trace_states returns them, for a small untrained selective and fixed model."""
    torch = pytest.importorskip("torch")
    from lib.mamba import MambaConfig
    from lib.mamba_lm import MambaLM, trace_states

    idx = torch.tensor([[{".": 0, "?": 1}.get(c, ord(c) - ord("A") + 2) for c in text]])  # (1, T)
    traces = {}
    for name, selective in (("selective", True), ("fixed Δ, B, C", False)):
        torch.manual_seed(0)
        model = MambaLM(MambaConfig(vocab_size=10, d_model=d_model, n_layers=1, selective=selective))
        traces[name] = trace_states(model, idx, layer=0)
    runs = {name: (tr["h"][0], tr["delta"][0]) for name, tr in traces.items()}  # (T, D, N), (T, D)
    return list(text), runs, {name: tr["delta"][0].numpy() for name, tr in traces.items()}


def test_delta_panel_draws_libs_delta_over_the_tokens_for_the_shown_channels():
    tokens, runs, delta = _traced_runs()
    fig = ssm_state_figure(tokens, runs)
    chans = fig.layout.meta["delta_channels"]
    spread = delta["selective"].std(axis=0)
    assert len(chans) == 4 and chans == sorted(np.argsort(-spread, kind="stable")[:4].tolist())  # Δ varies most
    lines, steps, dots = _delta_panel(fig)
    assert set(lines) == set(runs) and all(sorted(by) == chans for by in lines.values())
    for name, by in lines.items():
        for c, line in by.items():
            assert list(line.x) == list(range(len(tokens)))
            assert np.allclose(line.y, delta[name][:, c], rtol=1e-3, atol=0)  # lib's Δ, to 4 significant digits
            assert list(line.customdata) == tokens
    # the tokens label the x axis (every one here), readable without hovering
    axis = fig.layout[lines["selective"][chans[0]].xaxis.replace("x", "xaxis")]
    assert list(axis.ticktext) == tokens and axis.tickfont.size >= 14
    # the chosen channels can be given
    fig = ssm_state_figure(tokens, runs, delta_channels=[0, 5])
    lines, _, _ = _delta_panel(fig)
    assert np.allclose(lines["fixed Δ, B, C"][5].y, delta["fixed Δ, B, C"][:, 5], rtol=1e-3)


def test_delta_panel_marks_the_current_step_in_every_frame_and_live():
    tokens, runs, delta = _traced_runs()
    fig = ssm_state_figure(tokens, runs, step=2)
    chans = fig.layout.meta["delta_channels"]
    _, steps, dots = _delta_panel(fig)
    assert all(list(s.x) == [2, 2] for s in steps.values())
    index = {id(t): i for i, t in enumerate(fig.data)}
    for t, frame in enumerate(fig.frames):
        moved = dict(zip(frame.traces, frame.data))
        for name in runs:
            assert list(moved[index[id(steps[name])]].x) == [t, t]
            assert np.allclose(moved[index[id(dots[name])]].y, delta[name][t, chans], rtol=1e-3)
    view = SSMStateView(tokens, runs)
    slider = view.controls["step"]
    for value in (slider.min, 3, slider.max):  # the extremes and one between
        slider.value = value
        _, steps, dots = _delta_panel(view.figure)
        for name in runs:
            assert list(steps[name].x) == [value - 1, value - 1]
            assert list(dots[name].x) == [value - 1] * len(chans)
            assert np.allclose(dots[name].y, delta[name][value - 1, chans], rtol=1e-3)


def test_delta_panel_survives_one_token_one_channel_constant_and_long_sequences():
    # one token, one channel: markers, not lines; a constant Δ (the fixed model) on a linear axis
    one = {"r": (np.ones((1, 1, 2)), np.full((1, 1), 0.1))}
    fig = ssm_state_figure(["x"], one)
    lines, steps, _ = _delta_panel(fig)
    assert fig.layout.meta["delta_channels"] == [0] and list(lines["r"][0].y) == [0.1]
    assert fig.layout[lines["r"][0].yaxis.replace("y", "yaxis")].type == "linear"
    # Δ spanning decades: a log axis whose range holds every value and the marker
    runs = _runs(L=MAX_STEPS, D=6)
    runs["selective"][1][:, 0] = np.geomspace(1e-3, 1.0, MAX_STEPS)
    fig = ssm_state_figure(
        [f"tok{i}" for i in range(MAX_STEPS)], runs, step=MAX_STEPS - 1, animate=False, delta_channels=[0, 1]
    )
    lines, steps, _ = _delta_panel(fig)
    yaxis = fig.layout[lines["selective"][0].yaxis.replace("y", "yaxis")]
    assert yaxis.type == "log" and 10 ** yaxis.range[0] <= 1e-3 and 10 ** yaxis.range[1] >= 1.0
    assert list(steps["selective"].x) == [MAX_STEPS - 1] * 2
    # many tokens: every k-th one labels the axis, few enough to stand side by side
    xaxis = fig.layout[lines["selective"][0].xaxis.replace("x", "xaxis")]
    assert 2 <= len(xaxis.tickvals) <= 40 and list(xaxis.ticktext) == [f"tok{i}" for i in xaxis.tickvals]
    # a zero Δ (allowed input) keeps a linear axis
    lines, _, _ = _delta_panel(ssm_state_figure(list("ab"), {"r": (np.zeros((2, 2, 2)), np.zeros((2, 2)))}))
    assert list(lines["r"][0].y) == [0.0, 0.0]


@pytest.mark.parametrize("bad", [[], [4], [-1], [0, 0], [0.5], [True], list(range(7))])
def test_bad_delta_channels_are_refused(bad):
    with pytest.raises(ValueError, match="delta_channels must be"):
        ssm_state_figure(list("abcdef"), _runs(), delta_channels=bad)
    with pytest.raises(ValueError, match="delta_channels must be"):
        SSMStateView(list("abcdef"), _runs(), delta_channels=bad)


def test_live_view_keeps_its_delta_channels_for_a_new_sequence():
    def recompute(text):
        return list(text), _runs(L=len(text), seed=len(text))

    view = SSMStateView(list("abcdef"), _runs(), recompute=recompute, text="abcdef")
    chans = view.figure.layout.meta["delta_channels"]
    view.controls["text"].value = "xy"
    assert view.figure.layout.meta["delta_channels"] == chans and view.figure.layout.meta["shape"] == [2, 4, 3]
    lines, steps, _ = _delta_panel(view.figure)
    assert np.allclose(lines["selective"][chans[0]].y, recompute("xy")[1]["selective"][1][:, chans[0]], rtol=1e-3)
    assert list(steps["selective"].x) == [0, 0]
