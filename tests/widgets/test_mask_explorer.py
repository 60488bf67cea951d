"""The mask explorer draws lib's matrices, for every value its controls allow."""

import itertools
import json

import numpy as np
import plotly.io as pio
import pytest
import torch

from lib.attention import attention_scores, attention_weights
from lib.masks import MASK_KINDS, build_mask, combine_masks, padding_mask
from lib.toy import pad_tokens, simple_tokenize, toy_qkv
from widgets import MaskExplorer, MaskState, mask_explorer_figure, use_stable_renderer
from widgets.mask_explorer import MAX_TOKENS

ROUNDING = 0.5e-4  # the figure stores values rounded to 4 decimals


def lib_matrices(state: MaskState):
    """The same three matrices, computed here straight from lib's primitives."""
    words = simple_tokenize(state.sentence)[:MAX_TOKENS] or ["(empty)"]
    tokens, keep = pad_tokens(words, state.n_pad, state.pad_side)
    T = len(tokens)
    prefix, window = min(state.prefix_len, T), min(max(state.window, 1), T)
    q, k, _ = toy_qkv(tokens, state.d_k, seed=state.seed)
    mask = combine_masks(build_mask(state.kind, T, prefix_len=prefix, window=window), padding_mask(keep))
    return tokens, mask[0, 0].numpy(), attention_scores(q, k)[0, 0].numpy(), attention_weights(q, k, mask)[0, 0].numpy()


def assert_figure_draws(fig, state: MaskState):
    tokens, mask, scores, weights = lib_matrices(state)
    m_trace, s_trace, w_trace, x_trace = fig.data
    blocked = np.isneginf(mask)
    assert list(fig.layout.xaxis.ticktext) == tokens and list(fig.layout.yaxis.ticktext) == tokens
    assert np.array_equal(np.array(m_trace.z), blocked.astype(int))
    assert np.allclose(np.array(s_trace.z), scores, atol=ROUNDING, rtol=0)
    w = np.array(w_trace.z, dtype=float)
    assert np.allclose(w, weights, atol=ROUNDING, rtol=0)
    assert (w[blocked] == 0).all()  # masked cells are exactly 0 in the drawing too
    assert not np.isnan(w).any()
    assert sorted(zip(x_trace.y, x_trace.x)) == sorted(zip(*np.nonzero(blocked)))  # × on every masked cell
    for i, row in enumerate(m_trace.text):
        assert [t == "−∞" for t in row] == blocked[i].tolist()  # masked cells labelled, not only coloured


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("n_pad, side", [(0, "right"), (2, "right"), (3, "left")])
def test_static_figure_plots_libs_matrices(kind, n_pad, side):
    state = MaskState(kind=kind, n_pad=n_pad, pad_side=side)
    assert_figure_draws(mask_explorer_figure(state), state)


def test_static_buttons_carry_libs_matrices_for_every_mask():
    state = MaskState(n_pad=2)
    fig = mask_explorer_figure(state, buttons=True)
    buttons = fig.layout.updatemenus[0].buttons
    assert [b.args[1]["meta.state"]["kind"] for b in buttons] == list(MASK_KINDS)
    for b in buttons:
        s = MaskState(**b.args[1]["meta.state"])
        _, mask, _, weights = lib_matrices(s)
        z_mask, z_weights, _ = b.args[0]["z"]
        assert np.array_equal(np.array(z_mask), np.isneginf(mask).astype(int))
        assert np.allclose(np.array(z_weights, dtype=float), weights, atol=ROUNDING, rtol=0)
        assert list(b.args[2]) == [0, 2, 3]


SENTENCES = [
    "The cat sat on the mat .",
    "",
    "   ",
    "!!!",
    "naïve café 東京 — ok?",
    "[PAD] [PAD] hello",
    " ".join(f"w{i}" for i in range(60)),
]


@pytest.mark.parametrize("sentence", SENTENCES)
def test_every_sentence_is_drawn(sentence):
    ex = MaskExplorer()
    ex.controls["sentence"].value = sentence
    assert_figure_draws(ex.figure, ex.state)


def control_values(ex):
    c = ex.controls
    yield from (("kind", k) for k in MASK_KINDS)
    yield from (("n_pad", n) for n in range(c["n_pad"].min, c["n_pad"].max + 1))
    yield from (("pad_side", s) for s in c["pad_side"].options)
    yield from (("d_k", d) for d in c["d_k"].options)


def test_every_control_value_redraws_libs_matrices():
    ex = MaskExplorer()
    for name, value in control_values(ex):
        ex.controls[name].value = value
        assert getattr(ex.state, name) == value
        assert_figure_draws(ex.figure, ex.state)


@pytest.mark.parametrize("kind", ["prefix-lm", "sliding-window"])
def test_every_slider_position_works_for_prefix_and_window(kind):
    ex = MaskExplorer(kind=kind, n_pad=1)
    for name in ("prefix_len", "window"):
        slider = ex.controls[name]
        for value in range(slider.min, slider.max + 1):
            slider.value = value
            assert_figure_draws(ex.figure, ex.state)


def test_sliders_follow_the_sentence_length():
    ex = MaskExplorer(kind="sliding-window", window=8, prefix_len=8)
    ex.controls["sentence"].value = "two words"
    T = len(ex.state.tokens())
    assert ex.controls["window"].max == T and ex.state.window <= T and ex.state.prefix_len <= T
    assert_figure_draws(ex.figure, ex.state)
    ex.controls["sentence"].value = "now a much longer sentence with many more words in it"
    assert ex.controls["window"].max == len(ex.state.tokens())


def test_combinations_of_controls():
    ex = MaskExplorer()
    for kind, n_pad, side in itertools.product(MASK_KINDS, (0, 4), ("left", "right")):
        for name, value in (("kind", kind), ("n_pad", n_pad), ("pad_side", side)):
            ex.controls[name].value = value
        assert_figure_draws(ex.figure, ex.state)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_a_sentence_of_only_padding_gives_zero_weights_not_nan(kind):
    ex = MaskExplorer(sentence="[PAD] [PAD]", n_pad=1, kind=kind)
    assert ex.state.tokens() == ["[PAD]"] * 3
    assert_figure_draws(ex.figure, ex.state)
    assert (np.array(ex.figure.data[2].z, dtype=float) == 0).all()  # every row has no visible key


def test_changing_a_control_changes_the_plotted_data():
    ex = MaskExplorer(kind="bidirectional", n_pad=0)
    before = np.array(ex.figure.data[2].z, dtype=float)
    ex.controls["kind"].value = "causal"
    after = np.array(ex.figure.data[2].z, dtype=float)
    assert not np.array_equal(before, after)
    upper = np.triu_indices(len(before), 1)  # the future: open under bidirectional, closed under causal
    assert (before[upper] > 0).all() and (after[upper] == 0).all()


def test_live_widget_has_a_stable_text_repr():
    bundle = MaskExplorer()._repr_mimebundle_()
    assert bundle["text/plain"].startswith("MaskExplorer")
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_stable_renderer_is_deterministic_and_embeds_no_plotlyjs():
    use_stable_renderer()
    fig = mask_explorer_figure(buttons=True)
    a = pio.renderers._build_mime_bundle(fig.to_dict())
    b = pio.renderers._build_mime_bundle(mask_explorer_figure(buttons=True).to_dict())
    assert a == b
    assert set(a) == {"application/vnd.plotly.v1+json", "text/html"}
    html = a["text/html"]
    assert len(html) < 200_000 and "cdn.plot.ly" not in html and "https://" not in html
    assert json.dumps(a["application/vnd.plotly.v1+json"]).count("Infinity") == 0


def test_bad_state_is_refused_clearly():
    with pytest.raises(ValueError, match="kind"):
        mask_explorer_figure(kind="diagonal")
    with pytest.raises(ValueError, match="side"):
        mask_explorer_figure(pad_side="middle")


def test_attention_heatmap_draws_the_given_weights_and_marks_masked_cells():
    from widgets import attention_heatmap

    tokens = ["[CLS]", "hi", "[SEP]", "[PAD]"]
    mask = torch.zeros(4, 4)
    mask[:, 3] = float("-inf")
    weights = torch.softmax(torch.arange(16.0).view(4, 4) / 10 + mask, -1)
    fig = attention_heatmap(weights, mask, tokens, title="t")
    m_trace, w_trace, x_trace = fig.data
    assert np.array_equal(np.array(m_trace.z), np.isneginf(mask.numpy()).astype(int))
    assert np.allclose(np.array(w_trace.z, dtype=float), weights.numpy(), atol=ROUNDING, rtol=0)
    assert sorted(zip(x_trace.y, x_trace.x)) == [(i, 3) for i in range(4)]
    assert list(fig.layout.xaxis2.ticktext) == tokens
    with pytest.raises(ValueError, match=r"\(T, T\)"):
        attention_heatmap(weights[:3], mask, tokens, title="t")
