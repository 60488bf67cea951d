"""The character vocabulary round-trips text; the fact checker accepts exactly the corpus' true
sentences; the swapped-sound table really changes every animal's sound."""

import pytest
import torch

from lib.corpus import ANIMAL_SOUNDS, SWAPPED_SOUNDS, CharVocab, fact_is_true, facts_corpus


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


@pytest.mark.parametrize("sentence", [
    "the old dog meows in the barn .",  # wrong fact
    "the old dog barks in the barn",  # no full stop
    "the purple dog barks in the barn .",  # a word the templates never use
    "a ripe lime is yellow .",
    "ana went to the bakery on friday to buy meat .",
    "ana went to the bakery on friday to buy br",
    "",
])
def test_fact_checker_rejects_wrong_or_malformed_sentences(sentence):
    assert not fact_is_true(sentence)


def test_swapped_sounds_change_every_animal_and_reuse_the_same_sounds():
    assert sorted(SWAPPED_SOUNDS) == sorted(ANIMAL_SOUNDS)
    assert all(SWAPPED_SOUNDS[a] != ANIMAL_SOUNDS[a] for a in ANIMAL_SOUNDS)
    assert sorted(SWAPPED_SOUNDS.values()) == sorted(ANIMAL_SOUNDS.values())
    with pytest.raises(ValueError, match="animals"):
        facts_corpus(3, sounds={"dog": "barks"})
