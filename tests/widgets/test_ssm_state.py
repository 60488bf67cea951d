"""The SSM state animator draws exactly the states and step sizes it is given, at every step, and
refuses inconsistent records with a message instead of drawing garbage."""

import numpy as np
import pytest

from widgets.ssm_state import SSMStateView, check_runs, masked_attention_figure, ssm_state_figure


def _runs(L=6, D=4, N=3, seed=0):
    rng = np.random.default_rng(seed)
    return {"selective": (rng.normal(size=(L, D, N)), rng.uniform(0.01, 2.0, size=(L, D))),
            "fixed Δ, B, C": (rng.normal(size=(L, D, N)), np.full((L, D), 0.1))}


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


@pytest.mark.parametrize("tokens, runs, words", [
    (list("abc"), {}, "non-empty"),
    (list("abc"), {"r": (np.zeros((4, 2, 2)), np.zeros((4, 2)))}, "(L=3"),
    (list("abc"), {"r": (np.zeros((3, 2, 2)), np.zeros((3, 5)))}, "delta must have shape"),
    (list("abc"), {"r": (np.zeros((3, 2, 2)), np.zeros((3, 2))), "s": (np.zeros((3, 3, 2)), np.zeros((3, 3)))},
     "one shape"),
    (list("abc"), {"r": (np.full((3, 2, 2), np.nan), np.zeros((3, 2)))}, "non-finite"),
    ([], {"r": (np.zeros((0, 2, 2)), np.zeros((0, 2)))}, "1.."),
    (list("abc"), {"r": np.zeros((3, 2, 2))}, "pair"),
])
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
