"""Small generated corpora and a word-level vocabulary, for training and fine-tuning at laptop scale.

Everything here is produced by seeded templates written for this course (no downloaded text, no
licence question). The sentences carry facts a model can only get right from context on *both*
sides of a gap, which is what a masked-LM objective rewards:

    "the dog barks in the garden ."     the sound depends on the animal (and vice versa)
    "a ripe banana is yellow ."         the colour depends on the fruit
    "ana went to the bakery on friday to buy bread ."   the item depends on the shop

`intent_dataset` makes labelled requests (weather / music / alarm / food) for the fine-tuning
pattern of lesson 02. `CharVocab` turns text into a stream of character ids for lesson 03's small
GPT, and `SWAPPED_SOUNDS` gives every animal another animal's sound: a "shifted task" for
fine-tuning (`facts_corpus(n, sounds=SWAPPED_SOUNDS)`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lib._checks import require_int

__all__ = [
    "ANIMAL_SOUNDS",
    "CharVocab",
    "INTENTS",
    "SPECIALS",
    "SWAPPED_SOUNDS",
    "WordVocab",
    "fact_is_true",
    "facts_corpus",
    "intent_dataset",
]

ANIMAL_SOUNDS = {
    "dog": "barks",
    "cat": "meows",
    "cow": "moos",
    "duck": "quacks",
    "lion": "roars",
    "sheep": "bleats",
    "owl": "hoots",
    "horse": "neighs",
}
FRUIT_COLOURS = {
    "banana": "yellow",
    "lime": "green",
    "cherry": "red",
    "plum": "purple",
    "lemon": "yellow",
    "strawberry": "red",
    "kiwi": "green",
    "blueberry": "blue",
}
SHOP_ITEMS = {
    "bakery": "bread",
    "pharmacy": "medicine",
    "bookshop": "books",
    "florist": "flowers",
    "butcher": "meat",
    "dairy": "cheese",
}
PLACES = ["garden", "barn", "field", "yard", "forest", "farm"]
NAMES = ["ana", "ben", "chen", "dara", "eli", "fatima", "goran", "hana"]
ADJECTIVES = ["old", "young", "small", "big", "happy", "sleepy"]
FRUIT_ADJ = ["ripe", "fresh", "small", "sweet"]
DAYS = ["monday", "tuesday", "friday", "sunday"]
_ANIMALS = sorted(ANIMAL_SOUNDS)
# Each animal makes the sound of the next animal in alphabetical order (the cat moos, ...).
SWAPPED_SOUNDS = {a: ANIMAL_SOUNDS[_ANIMALS[(i + 1) % len(_ANIMALS)]] for i, a in enumerate(_ANIMALS)}


def _fact(rng: random.Random, sounds: dict[str, str]) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        animal = rng.choice(_ANIMALS)
        return f"the {rng.choice(ADJECTIVES)} {animal} {sounds[animal]} in the {rng.choice(PLACES)} ."
    if kind == 1:
        fruit = rng.choice(sorted(FRUIT_COLOURS))
        return f"a {rng.choice(FRUIT_ADJ)} {fruit} is {FRUIT_COLOURS[fruit]} ."
    shop = rng.choice(sorted(SHOP_ITEMS))
    return f"{rng.choice(NAMES)} went to the {shop} on {rng.choice(DAYS)} to buy {SHOP_ITEMS[shop]} ."


def facts_corpus(n: int, seed: int = 0, sounds: dict[str, str] | None = None) -> list[str]:
    """`n` sentences from the three fact templates, deterministic for a seed. `sounds` replaces
    the animal -> sound table (it must name the same animals), e.g. `SWAPPED_SOUNDS`."""
    require_int("n", n, minimum=0)
    sounds = ANIMAL_SOUNDS if sounds is None else sounds
    if not isinstance(sounds, dict) or sorted(sounds) != _ANIMALS:
        raise ValueError(f"sounds must be a dict with exactly these animals as keys: {_ANIMALS}")
    rng = random.Random(seed)
    return [_fact(rng, sounds) for _ in range(n)]


def fact_is_true(sentence: str, sounds: dict[str, str] | None = None) -> bool:
    """Is `sentence` one of the three templates, with every word from its lists and the right fact?

    A generated sample is judged by this: False for a malformed sentence, a word the templates
    never use, or a wrong fact (a dog that meows, under the default `sounds`)."""
    sounds = ANIMAL_SOUNDS if sounds is None else sounds
    w = sentence.split()
    if len(w) == 8 and w[0] == "the" and w[4:6] == ["in", "the"] and w[7] == ".":
        return w[1] in ADJECTIVES and w[2] in sounds and w[3] == sounds[w[2]] and w[6] in PLACES
    if len(w) == 6 and w[0] == "a" and w[3] == "is" and w[5] == ".":
        return w[1] in FRUIT_ADJ and w[2] in FRUIT_COLOURS and w[4] == FRUIT_COLOURS[w[2]]
    if len(w) == 11 and w[1:4] == ["went", "to", "the"] and w[5] == "on" and w[7:9] == ["to", "buy"] and w[10] == ".":
        return w[0] in NAMES and w[4] in SHOP_ITEMS and w[6] in DAYS and w[9] == SHOP_ITEMS[w[4]]
    return False


INTENTS = ("weather", "music", "alarm", "food")
_INTENT_TEMPLATES = {  # some templates overlap on purpose (timing, wanting, "something warm")
    "weather": [
        "what is the weather like in {city} {when}",
        "will it rain in {city} {when}",
        "do i need an umbrella {when}",
        "how cold will it be in {city}",
        "is it sunny {when}",
        "what should i wear {when}",
        "should i take a coat to {city}",
        "is it warm enough to eat outside {when}",
    ],
    "music": [
        "play some {genre} music",
        "put on my {genre} playlist",
        "i want to hear {genre} songs {when}",
        "turn the music up",
        "skip this song please",
        "play something relaxing {when}",
        "i want something upbeat while i cook",
        "what was that song at {hour}",
    ],
    "alarm": [
        "set an alarm for {hour}",
        "wake me up at {hour} {when}",
        "cancel my {hour} alarm",
        "remind me at {hour} to call {name}",
        "snooze the alarm",
        "remind me {when} to buy an umbrella",
        "i need to be up before {hour}",
        "remind me to order {dish} at {hour}",
    ],
    "food": [
        "order a {dish} for dinner",
        "i am hungry , find me {dish}",
        "book a table for {n} {when}",
        "how long until my {dish} arrives",
        "what restaurants are open {when}",
        "i want something warm to eat {when}",
        "get me {dish} before the rain starts",
        "where can i eat outside in {city}",
    ],
}
_SLOTS = {
    "city": ["paris", "lagos", "lima", "oslo", "delhi", "tokyo"],
    "when": ["today", "tomorrow", "tonight", "this weekend"],
    "genre": ["jazz", "rock", "classical", "reggae", "hip hop"],
    "hour": ["six", "seven thirty", "noon", "nine"],
    "name": ["mum", "sam", "the dentist"],
    "dish": ["pizza", "curry", "noodles", "a salad", "tacos"],
    "n": ["two", "four", "six"],
}


def intent_dataset(n: int, seed: int = 0) -> tuple[list[str], torch.Tensor]:
    """`n` short requests and their intent labels (indices into `INTENTS`), balanced, shuffled."""
    require_int("n", n, minimum=0)
    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(n):
        label = i % len(INTENTS)
        template = rng.choice(_INTENT_TEMPLATES[INTENTS[label]])
        texts.append(template.format(**{k: rng.choice(v) for k, v in _SLOTS.items()}))
        labels.append(label)
    order = list(range(n))
    rng.shuffle(order)
    return [texts[i] for i in order], torch.tensor([labels[i] for i in order], dtype=torch.long)


SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass
class WordVocab:
    """A word-level vocabulary: the special tokens first ([PAD] = 0), then words by first use."""

    itos: list[str]

    @classmethod
    def build(cls, sentences: list[str]) -> "WordVocab":
        seen = dict.fromkeys(SPECIALS)
        for s in sentences:
            seen.update(dict.fromkeys(s.split()))
        return cls(list(seen))

    def __post_init__(self):
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def __getattr__(self, name: str) -> int:  # vocab.pad_id, vocab.mask_id, ...
        token = {"pad_id": "[PAD]", "unk_id": "[UNK]", "cls_id": "[CLS]", "sep_id": "[SEP]", "mask_id": "[MASK]"}.get(
            name
        )
        if token is None:
            raise AttributeError(name)
        return self.stoi[token]

    @property
    def special_ids(self) -> list[int]:
        return [self.stoi[t] for t in SPECIALS]

    def encode(self, sentences: list[str], max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[CLS] words [SEP], right-padded: ids (B, T) and attention_mask (B, T) of 1/0."""
        rows = [[self.cls_id] + [self.stoi.get(w, self.unk_id) for w in s.split()] + [self.sep_id] for s in sentences]
        T = max_len or max(len(r) for r in rows)
        if any(len(r) > T for r in rows):
            raise ValueError(f"a sentence is longer than max_len={T} tokens with [CLS] and [SEP]")
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        return ids, (ids != self.pad_id).long()

    def decode(self, ids) -> list[str]:
        return [self.itos[int(i)] for i in ids]


@dataclass
class CharVocab:
    """A character-level vocabulary: one id per distinct character, in sorted order."""

    itos: list[str]

    @classmethod
    def build(cls, text: str) -> "CharVocab":
        if not isinstance(text, str) or not text:
            raise ValueError("text must be a non-empty string")
        return cls(sorted(set(text)))

    def __post_init__(self):
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> torch.Tensor:
        """(len(text),) int64 ids; a character outside the vocabulary raises, naming it."""
        unknown = sorted(set(text) - set(self.stoi))
        if unknown:
            raise ValueError(f"text has characters outside the vocabulary: {unknown[:10]}")
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.itos[int(i)] for i in ids)
