"""The MLM corruption view draws lib.bert.mlm_corrupt's result for every control value; the
generated corpora are deterministic; the small MLM trainer learns the corpus' facts."""

import numpy as np
import pytest
import torch

from lib.bert import BertConfig, BertForMaskedLM, init_gradient_norms, minilm_tokenizer, mlm_corrupt, predict_masked, train_mlm
from lib.corpus import INTENTS, WordVocab, facts_corpus, intent_dataset
from widgets.mlm_view import FATES, MLMState, MLMView, corruption_table, mlm_view_figure


def expected(state: MLMState):
    tok = minilm_tokenizer()
    ids = tok(state.sentence or " ", truncation=True, max_length=40, return_tensors="pt")["input_ids"]
    corrupted, labels = mlm_corrupt(ids, mask_token_id=tok.mask_token_id, vocab_size=tok.vocab_size,
                                    special_token_ids=tok.all_special_ids, prob=state.prob,
                                    generator=torch.Generator().manual_seed(state.seed))
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


def test_corpora_are_deterministic_and_balanced():
    assert facts_corpus(50, seed=1) == facts_corpus(50, seed=1) != facts_corpus(50, seed=2)
    texts, labels = intent_dataset(40, seed=0)
    assert len(texts) == 40 and torch.bincount(labels).tolist() == [10] * len(INTENTS)
    assert intent_dataset(40, seed=0)[0] == texts


def test_word_vocab_round_trips_and_pads():
    vocab = WordVocab.build(["the dog barks .", "a cat ."])
    assert vocab.itos[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and vocab.pad_id == 0
    ids, mask = vocab.encode(["the dog barks .", "a zebra"])
    assert ids.shape == (2, 6) and mask.tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    assert vocab.decode(ids[1, :4]) == ["[CLS]", "a", "[UNK]", "[SEP]"]
    with pytest.raises(ValueError, match="max_len"):
        vocab.encode(["the dog barks ."], max_len=3)


def test_small_mlm_learns_which_animal_barks():
    sents = facts_corpus(2000, seed=0)
    vocab = WordVocab.build(sents)
    ids, mask = vocab.encode(sents)
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig.tiny(vocab_size=len(vocab), max_position_embeddings=32, num_hidden_layers=4))
    losses = train_mlm(model, ids, mask, mask_token_id=vocab.mask_id, special_token_ids=vocab.special_ids,
                       steps=300, batch_size=128, lr=5e-3)  # the lesson's default run
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    test_ids, test_mask = vocab.encode(["a ripe banana is [MASK] ."])
    top, _ = predict_masked(model, test_ids, test_mask)
    pos = (test_ids[0] == vocab.mask_id).nonzero()[0].item()
    assert vocab.itos[top[0, pos, 0]] == "yellow"


def test_init_gradient_norms_has_one_finite_norm_per_layer():
    for norm_first in (False, True):
        norms = init_gradient_norms(BertConfig.tiny(num_hidden_layers=3, norm_first=norm_first), batch=2, T=8)
        assert len(norms) == 3 and all(np.isfinite(norms)) and all(n > 0 for n in norms)


@pytest.mark.parametrize("norm_first", [False, True])
def test_init_gradient_norms_are_each_layers_gradient_norm_from_an_explicit_backward(norm_first):
    """The same model, batch and dropout draws rebuilt here, the loss differentiated with
    torch.autograd.grad, and each encoder layer's norm taken over its own parameters only, in order:
    init_gradient_norms gives those numbers (fp32; the sums of squares differ in order only)."""
    config = BertConfig.tiny(num_hidden_layers=3, norm_first=norm_first)
    norms = init_gradient_norms(config, batch=4, T=8, seed=3)
    torch.manual_seed(3)
    model = BertForMaskedLM(config).train()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, config.vocab_size, (4, 8), generator=g)
    labels = torch.randint(5, config.vocab_size, (4, 8), generator=g)
    _, loss = model(ids, labels=labels)
    layers = list(model.bert.encoder.layer)
    params = [list(layer.parameters()) for layer in layers]
    grads = torch.autograd.grad(loss, [p for ps in params for p in ps])
    want, i = [], 0
    for ps in params:
        want.append(torch.linalg.vector_norm(torch.cat([g_.flatten() for g_ in grads[i:i + len(ps)]])).item())
        i += len(ps)
    assert norms == pytest.approx(want, rel=1e-5)
    assert len(set(round(n, 6) for n in norms)) == 3  # three different layers, so order and identity matter
