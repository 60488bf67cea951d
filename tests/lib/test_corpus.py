"""lib.corpus: the character and word vocabularies round-trip; the fact checker accepts exactly
the corpus' true sentences; the swapped-sound table really changes every animal's sound; the
generated corpora are deterministic and balanced, and a small MLM trained on them learns; and
lib.bert_mlm.init_gradient_norms measures each layer's gradient."""

import numpy as np
import pytest
import torch

from lib.bert import BertConfig
from lib.bert_mlm import BertForMaskedLM, init_gradient_norms, predict_masked, train_mlm
from lib.corpus import (
    ANIMAL_SOUNDS,
    INTENTS,
    SWAPPED_SOUNDS,
    CharVocab,
    WordVocab,
    fact_is_true,
    facts_corpus,
    intent_dataset,
)


def test_char_vocab_round_trips_the_corpus():
    text = "\n".join(facts_corpus(200, seed=0)) + "\n"
    vocab = CharVocab.build(text)
    ids = vocab.encode(text)
    assert ids.dtype == torch.long and len(ids) == len(text)
    assert vocab.decode(ids) == text
    assert vocab.itos == sorted(set(text))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab.encode("Zebra!")
    with pytest.raises(ValueError, match="non-empty"):
        CharVocab.build("")


def test_every_generated_sentence_is_a_true_fact():
    assert all(fact_is_true(s) for s in facts_corpus(500, seed=4))
    swapped = facts_corpus(500, seed=4, sounds=SWAPPED_SOUNDS)
    assert all(fact_is_true(s, SWAPPED_SOUNDS) for s in swapped)
    animal_lines = [s for s in swapped if s.startswith("the ")]
    assert animal_lines and not any(fact_is_true(s) for s in animal_lines)  # false under the real sounds


@pytest.mark.parametrize(
    "sentence",
    [
        "the old dog meows in the barn .",  # wrong fact
        "the old dog barks in the barn",  # no full stop
        "the purple dog barks in the barn .",  # a word the templates never use
        "a ripe lime is yellow .",
        "ana went to the bakery on friday to buy meat .",
        "ana went to the bakery on friday to buy br",
        "",
    ],
)
def test_fact_checker_rejects_wrong_or_malformed_sentences(sentence):
    assert not fact_is_true(sentence)


def test_swapped_sounds_change_every_animal_and_reuse_the_same_sounds():
    assert sorted(SWAPPED_SOUNDS) == sorted(ANIMAL_SOUNDS)
    assert all(SWAPPED_SOUNDS[a] != ANIMAL_SOUNDS[a] for a in ANIMAL_SOUNDS)
    assert sorted(SWAPPED_SOUNDS.values()) == sorted(ANIMAL_SOUNDS.values())
    with pytest.raises(ValueError, match="animals"):
        facts_corpus(3, sounds={"dog": "barks"})


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
    losses = train_mlm(
        model,
        ids,
        mask,
        mask_token_id=vocab.mask_id,
        special_token_ids=vocab.special_ids,
        steps=300,
        batch_size=128,
        lr=5e-3,
    )  # the lesson's default run
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
        want.append(torch.linalg.vector_norm(torch.cat([g_.flatten() for g_ in grads[i : i + len(ps)]])).item())
        i += len(ps)
    assert norms == pytest.approx(want, rel=1e-5)
    assert len(set(round(n, 6) for n in norms)) == 3  # three different layers, so order and identity matter


@pytest.mark.parametrize("init", ["bert", "xavier"])
def test_init_gradient_norms_of_the_ffn_output_matrix_are_its_gradient_under_that_init(init):
    """part="ffn_w2" is each layer's W² (output.dense.weight) gradient norm, from an explicit rebuild:
    Xavier-uniform weights (bound sqrt(6 / (fan_in + fan_out))) and zero biases, or BERT's own."""
    config = BertConfig.tiny(num_hidden_layers=3)
    norms = init_gradient_norms(config, batch=4, T=8, seed=5, init=init, part="ffn_w2")
    torch.manual_seed(5)
    model = BertForMaskedLM(config).train()
    if init == "xavier":
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                bound = (6 / (m.in_features + m.out_features)) ** 0.5
                torch.nn.init.uniform_(m.weight, -bound, bound)
                torch.nn.init.zeros_(m.bias)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, config.vocab_size, (4, 8), generator=g)
    labels = torch.randint(5, config.vocab_size, (4, 8), generator=g)
    _, loss = model(ids, labels=labels)
    w2 = [layer.output.dense.weight for layer in model.bert.encoder.layer]
    want = [gr.norm().item() for gr in torch.autograd.grad(loss, w2)]
    assert norms == pytest.approx(want, rel=1e-5)  # fp32, same ops in the same order
    other = init_gradient_norms(
        config, batch=4, T=8, seed=5, init="bert" if init == "xavier" else "xavier", part="ffn_w2"
    )
    assert other != pytest.approx(norms, rel=1e-2)  # the init matters


@pytest.mark.parametrize(
    "kwargs, words", [({"init": "he"}, "init must be one of"), ({"part": "attention"}, "part must be one of")]
)
def test_init_gradient_norms_names_a_bad_choice(kwargs, words):
    with pytest.raises(ValueError, match=words):
        init_gradient_norms(BertConfig.tiny(), **kwargs)
