"""widgets.mlm_view draws lib.bert.mlm_corrupt's draws, for every sentence and slider value."""

import numpy as np
import pytest
import torch

from lib.bert import minilm_tokenizer, mlm_corrupt
from widgets.mlm_view import FATES, MLMState, MLMView, corruption_table, mlm_view_figure


def expected(state: MLMState):
    tok = minilm_tokenizer()
    ids = tok(state.sentence or " ", truncation=True, max_length=40, return_tensors="pt")["input_ids"]
    corrupted, labels = mlm_corrupt(
        ids,
        mask_token_id=tok.mask_token_id,
        vocab_size=tok.vocab_size,
        special_token_ids=tok.all_special_ids,
        prob=state.prob,
        generator=torch.Generator().manual_seed(state.seed),
    )
    return tok, ids[0], corrupted[0], labels[0]


def assert_draws(fig, state):
    tok, ids, corrupted, labels = expected(state)
    z = np.array(fig.data[0].z)
    text = fig.data[0].text
    assert list(text[0]) == tok.convert_ids_to_tokens(ids)
    assert list(text[1]) == tok.convert_ids_to_tokens(corrupted)
    sel = (labels != -100).numpy()
    assert [t == "−100" for t in text[2]] == (~sel).tolist()
    fate = z[0]
    assert ((fate == 0) == ~sel).all()
    assert ((fate == 1) == (sel & (corrupted == tok.mask_token_id).numpy())).all()
    assert ((fate == 3) == (sel & (corrupted == ids).numpy())).all()
    assert (z == z[0]).all()  # one fate per column


@pytest.mark.parametrize("prob", [0.0, 0.15, 0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 7])
def test_static_view_draws_libs_corruption(prob, seed):
    state = MLMState(prob=prob, seed=seed)
    assert_draws(mlm_view_figure(state), state)


def test_seed_slider_steps_carry_each_draw():
    fig = mlm_view_figure(seeds=4)
    steps = fig.layout.sliders[0].steps
    assert [s.label for s in steps] == ["0", "1", "2", "3"]
    for s in steps:
        table = corruption_table(MLMState(seed=int(s.label)))
        assert s.args[0]["z"][0][0] == table["fate"]


@pytest.mark.parametrize("sentence", ["", "a", "naïve café 東京", "word " * 80])
def test_live_view_survives_every_sentence_and_slider_value(sentence):
    view = MLMView()
    view.controls["sentence"].value = sentence
    for prob in (0.0, 0.05, 1.0):
        view.controls["prob"].value = prob
        for seed in (view.controls["seed"].min, view.controls["seed"].max):
            view.controls["seed"].value = seed
            assert_draws(view.figure, view.state)
    assert view._repr_mimebundle_()["text/plain"].startswith("MLMView")


def test_full_selection_shows_every_fate():
    table = corruption_table(MLMState(prob=1.0, seed=3, sentence=" ".join(["word"] * 38)))
    assert set(table["fate"][1:-1]) == {1, 2, 3} and table["fate"][0] == 0  # [CLS] is never selected
    assert len(FATES) == 4
