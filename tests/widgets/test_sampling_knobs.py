"""The sampling-knobs figure draws lib.sampling.next_token_distribution's numbers, for every
state its controls and presets allow."""

import json

import numpy as np
import plotly.io as pio
import pytest
import torch

from lib.sampling import next_token_distribution
from widgets import SamplingKnobs, SamplingState, sampling_figure, use_stable_renderer
from widgets.sampling_knobs import visible_token

V = 30
LOGITS = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 1.5
LOGITS[0], LOGITS[1] = LOGITS.max() + 0.4, LOGITS.max() + 0.2  # " " and "\n" the two most probable
LABELS = [" ", "\n", "\t"] + [chr(ord("a") + i) for i in range(V - 4)] + ["é"]


def fake_model(prompt: str) -> torch.Tensor:
    """Stands in for a lesson's GPT: different logits per prompt, deterministic, accepts ""."""
    seed = sum(map(ord, prompt)) % 1000
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2.0


def expected(logits, state: SamplingState, show: int = 20) -> dict:
    d = next_token_distribution(logits, temperature=state.temperature, top_k=state.top_k or None, top_p=state.top_p)
    order = torch.sort(d["p_raw"], descending=True, stable=True).indices[:show].tolist()
    return {"d": d, "order": order}


def assert_draws(fig, logits, state: SamplingState, show: int = 20):
    e = expected(logits, state, show)
    d, order = e["d"], e["order"]
    raw, final = fig.data
    assert raw.name == "before (T=1)" and final.name == "after knobs"
    assert list(fig.layout.xaxis.ticktext) == [visible_token(LABELS[i]) for i in order]
    assert np.allclose(raw.y, d["p_raw"][order].numpy(), atol=0.5e-4, rtol=0)
    assert list(final.y) == [round(float(d["p_final"][i]), 4) for i in order]  # p_final, rounded, raw-probability order
    assert list(np.diff(raw.y) <= 0) == [True] * (len(order) - 1)  # bars in decreasing raw probability
    for i, text in zip(order, final.text):
        assert (text == "cut: top-k") == (not d["kept_by_top_k"][i])
        assert (text == "cut: top-p") == (bool(d["kept_by_top_k"][i]) and not d["kept_by_top_p"][i])
        assert text.startswith("cut") != bool(d["kept"][i])  # every dropped bar says so in words
    n = int(d["kept"].sum())
    assert f": {n} token" in fig.layout.title.text and repr(state.prompt) in fig.layout.title.text
    assert fig.layout.meta["onemask"] == "sampling_knobs"
    assert fig.layout.meta["state"]["top_k"] == state.top_k
    assert tuple(fig.layout.yaxis.range) == (0, 1)


STATES = [
    SamplingState(),
    SamplingState(temperature=0.7, top_k=5, top_p=0.9),
    SamplingState(temperature=0.0),
    SamplingState(temperature=2.0, top_k=3),
    SamplingState(top_p=0.05),
    SamplingState(top_k=V + 10),
    SamplingState(temperature=0.3, top_p=0.5),
]


@pytest.mark.parametrize("state", STATES)
def test_figure_draws_next_token_distributions_numbers(state):
    assert_draws(sampling_figure(LOGITS, LABELS, state), LOGITS, state)


def test_figure_makes_whitespace_visible_and_keeps_tokens_with_equal_labels_apart():
    names = list(sampling_figure(LOGITS, LABELS).layout.xaxis.ticktext)
    assert names[:2] == ["␣", "⏎"]
    assert visible_token("\t") == "⇥" and visible_token("a b\n") == "a␣b⏎" and visible_token("") == "∅"
    fig = sampling_figure(LOGITS, ["x"] * V, show=V)  # one bar per token even when labels repeat
    assert len(fig.data[1].y) == V and list(fig.data[1].x) == list(range(V))


def test_the_title_summarises_the_knobs():
    title = sampling_figure(LOGITS, LABELS, temperature=0.7, top_k=5, top_p=0.9).layout.title.text
    assert title.startswith("T = 0.70, top-k 5, top-p 0.90: ") and title.endswith("prompt 'the dog'")
    assert "tempered mass" in title
    greedy = sampling_figure(LOGITS, LABELS, temperature=0).layout.title.text
    assert greedy.startswith("T = 0 (greedy), top-k off, top-p off: 1 token survives (100% of the tempered mass)")


def test_show_limits_the_bars():
    fig = sampling_figure(LOGITS, LABELS, show=5)
    assert len(fig.data[0].y) == len(fig.data[1].y) == 5
    assert_draws(fig, LOGITS, SamplingState(), show=5)
    assert len(sampling_figure(LOGITS, LABELS, show=100).data[0].y) == V


PRESETS = [
    {"temperature": 1.0},
    {"temperature": 0.5},
    {"temperature": 1.5},
    {"top_k": 5},
    {"top_p": 0.9},
    {"temperature": 0.0},
]


def test_preset_slider_has_one_step_per_preset_with_its_data():
    base = SamplingState(temperature=0.8, top_p=0.95)
    fig = sampling_figure(LOGITS, LABELS, base, presets=PRESETS)
    steps = fig.layout.sliders[0].steps
    assert len(steps) == len(PRESETS)
    assert [s.label for s in steps] == ["T = 1", "T = 0.5", "T = 1.5", "top-k 5", "top-p 0.9", "T = 0 (greedy)"]
    for preset, step in zip(PRESETS, steps):
        state = SamplingState(**{**vars(base), **preset})
        e = expected(LOGITS, state)
        data, layout, traces = step.args
        assert list(traces) == [1]  # only the "after knobs" bars move
        assert data["y"][0] == [round(float(e["d"]["p_final"][i]), 4) for i in e["order"]]
        assert [t.startswith("cut") for t in data["text"][0]] == [not e["d"]["kept"][i] for i in e["order"]]
        assert layout["meta.state"] == {
            "prompt": "the dog",
            "temperature": state.temperature,
            "top_k": state.top_k,
            "top_p": state.top_p,
        }
        assert layout["title.text"] == sampling_figure(LOGITS, LABELS, state).layout.title.text
    assert_draws(fig, LOGITS, SamplingState(**{**vars(base), **PRESETS[0]}))  # the figure opens on step 0


def test_figure_is_byte_stable_and_finite():
    use_stable_renderer()
    a = pio.renderers._build_mime_bundle(sampling_figure(LOGITS, LABELS, presets=PRESETS).to_dict())
    b = pio.renderers._build_mime_bundle(sampling_figure(LOGITS.clone(), LABELS, presets=PRESETS).to_dict())
    assert a == b
    text = json.dumps(a["application/vnd.plotly.v1+json"])
    assert "Infinity" not in text and "NaN" not in text


# --------------------------------------------------------------------------- live widget
def test_live_widget_survives_every_control_extreme():
    knobs = SamplingKnobs(fake_model, LABELS, top_p=0.9)
    c = knobs.controls
    assert list(c) == ["prompt", "temperature", "top_k", "top_p"]
    assert c["top_k"].max == V and c["temperature"].max == 2.0 and c["top_p"].min == 0.05
    assert_draws(knobs.figure, fake_model("the dog"), knobs.state)
    for prompt in ("the dog", "", "naïve café 東京 🐕", "x" * 500):
        c["prompt"].value = prompt
        for name in ("temperature", "top_k", "top_p"):
            for value in (c[name].min, c[name].max):
                c[name].value = value
                assert getattr(knobs.state, name) == value and knobs.state.prompt == prompt
                assert_draws(knobs.figure, fake_model(prompt), knobs.state)


def test_moving_a_control_redraws_the_figure_in_place():
    knobs = SamplingKnobs(fake_model, LABELS, top_p=0.9)
    figure, before = knobs.figure, list(knobs.figure.data[1].y)
    knobs.controls["temperature"].value = 0.3
    assert knobs.figure is figure and list(figure.data[1].y) != before
    title = figure.layout.title.text
    knobs.controls["top_k"].value = 2
    assert figure.layout.title.text != title and figure.layout.meta["state"]["top_k"] == 2
    ticks = list(figure.layout.xaxis.ticktext)
    knobs.controls["prompt"].value = "a cat"  # new logits: new bar order
    assert list(figure.layout.xaxis.ticktext) != ticks
    assert_draws(figure, fake_model("a cat"), knobs.state)


def test_the_last_slider_can_move_right_from_the_lessons_default():
    knobs = SamplingKnobs(fake_model, LABELS, SamplingState(temperature=0.8, top_p=0.9))
    last = knobs.widget.children[1].children[-1]
    assert last is knobs.controls["top_p"] and last.value < last.max


def test_set_state_moves_the_controls_even_beyond_their_range():
    knobs = SamplingKnobs(fake_model, LABELS)
    state = SamplingState(prompt="hi", temperature=3.0, top_k=V + 20, top_p=0.01)
    knobs.set_state(state)
    assert knobs.state == state
    assert {n: knobs.controls[n].value for n in ("prompt", "temperature", "top_k", "top_p")} == vars(state)
    assert_draws(knobs.figure, fake_model("hi"), state)


def test_the_model_is_called_once_per_prompt():
    calls = []
    knobs = SamplingKnobs(lambda p: calls.append(p) or fake_model(p), LABELS)
    for t in (0.2, 0.4, 0.6):
        knobs.controls["temperature"].value = t
    knobs.controls["prompt"].value = ""
    assert calls == ["the dog", ""]


def test_live_widget_has_a_stable_text_repr():
    bundle = SamplingKnobs(fake_model, LABELS)._repr_mimebundle_()
    assert bundle["text/plain"] == "SamplingKnobs (a live widget: run this cell in JupyterLab to use it)"
    assert "application/vnd.jupyter.widget-view+json" in bundle


# --------------------------------------------------------------------------- bad states
@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"top_k": 2.5}, TypeError, "top_k"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.2}, ValueError, "top_p"),
        ({"prompt": None}, TypeError, "prompt"),
    ],
)
def test_bad_states_are_refused_clearly(changes, error, match):
    with pytest.raises(error, match=match):
        sampling_figure(LOGITS, LABELS, **changes)
    with pytest.raises(error, match=match):
        SamplingKnobs(fake_model, LABELS, **changes)


def test_bad_logits_labels_and_presets_are_refused():
    with pytest.raises(ValueError, match="labels"):
        sampling_figure(LOGITS, LABELS[:-1])
    with pytest.raises(ValueError, match=r"\(V,\)"):
        sampling_figure(LOGITS[None], LABELS)
    with pytest.raises(ValueError, match="preset"):
        sampling_figure(LOGITS, LABELS, presets=[{"prompt": "other"}])
    with pytest.raises(ValueError, match="top_p"):
        sampling_figure(LOGITS, LABELS, presets=[{"top_p": 0.5}, {"top_p": 2.0}])
    with pytest.raises(ValueError, match="show"):
        sampling_figure(LOGITS, LABELS, show=0)
    with pytest.raises(ValueError, match="labels"):
        SamplingKnobs(lambda p: torch.zeros(V + 1), LABELS)
