"""Lesson 02's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

from functools import partial

import pytest
import torch
from exercise_helpers import assert_names_the_mistake, assert_passes_and_refuses_the_stub, stub

from lib.bert import mean_pool, mlm_corrupt
from lib.course.exercises.lesson02 import check_mean_pool, check_mlm_corrupt, check_padding_mask
from lib.masks import padding_mask


def test_padding_mask_check_passes_on_lib_and_fails_on_the_stub():
    assert check_padding_mask(padding_mask).passed
    assert check_padding_mask(stub).problem == "not attempted yet"


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda k: padding_mask(k)[:, 0, 0], "(B, 1, 1, T)"),
        (lambda k: padding_mask(1 - k), "inverted"),
        (lambda k: padding_mask(k).transpose(-1, -2), "queries"),
        (lambda k: k.bool()[:, None, None, :], "not True/False"),
    ],
)
def test_padding_mask_check_names_the_mistake(wrong, words):
    report = check_padding_mask(wrong)
    assert not report.passed and words in (report.hint or "")


def lib_corrupt(ids, mask_id, vocab, special, g):
    return mlm_corrupt(ids, mask_token_id=mask_id, vocab_size=vocab, special_token_ids=special, generator=g)


def only_mask(ids, mask_id, vocab, special, g):
    sel = (torch.rand(ids.shape, generator=g) < 0.15) & ~torch.isin(ids, torch.tensor(special))
    return torch.where(sel, mask_id, ids), torch.where(sel, ids, -100)


def selects_specials(ids, mask_id, vocab, special, g):
    sel = torch.rand(ids.shape, generator=g) < 0.15
    return torch.where(sel, mask_id, ids), torch.where(sel, ids, -100)


def in_place(ids, mask_id, vocab, special, g):
    corrupted, labels = lib_corrupt(ids, mask_id, vocab, special, g)
    ids.copy_(corrupted)
    return corrupted, labels


def no_ignore_labels(ids, mask_id, vocab, special, g):
    corrupted, _ = lib_corrupt(ids, mask_id, vocab, special, g)
    return corrupted, ids.clone()


def _corrupt(ids, mask_id, vocab, special, g, *, select=None, p=0.15, split=(0.8, 0.9), random_ids=None):
    """A parametrised corruption: the right one by default, each keyword a way to get it wrong."""
    not_special = ~torch.isin(ids, torch.tensor(special))
    sel = (select if select is not None else torch.rand(ids.shape, generator=g) < p) & not_special
    choice = torch.rand(ids.shape, generator=g)
    if random_ids is None:
        allowed = torch.ones(vocab, dtype=torch.bool)
        allowed[list(special)] = False
        candidates = allowed.nonzero().squeeze(1)
        random_ids = candidates[torch.randint(len(candidates), ids.shape, generator=g)]
    corrupted = torch.where(sel & (choice < split[0]), mask_id, ids)
    corrupted = torch.where(sel & (choice >= split[0]) & (choice < split[1]), random_ids, corrupted)
    return corrupted, torch.where(sel, ids, -100)


def every_7th(ids, mask_id, vocab, special, g):  # the right average and even columns, a fixed pattern
    select = (torch.arange(ids.numel()).view(ids.shape) % 7 == 0) | (torch.rand(ids.shape, generator=g) < 0.0085)
    return _corrupt(ids, mask_id, vocab, special, g, select=select)


def every_7th_position(ids, mask_id, vocab, special, g):  # positions 0, 7, 14, ... of every sequence
    select = (torch.arange(ids.shape[1]) % 7 == 0).expand(ids.shape) | (torch.rand(ids.shape, generator=g) < 0.0085)
    return _corrupt(ids, mask_id, vocab, special, g, select=select)


def one_random_token(ids, mask_id, vocab, special, g):
    return _corrupt(ids, mask_id, vocab, special, g, random_ids=torch.full_like(ids, 2000))


def random_from_specials(ids, mask_id, vocab, special, g):  # [PAD], [CLS] or [SEP] as the "random" token
    others = torch.tensor([t for t in special if t != mask_id])
    pick = others[torch.randint(len(others), ids.shape, generator=g)]
    return _corrupt(ids, mask_id, vocab, special, g, random_ids=pick)


def ignores_the_generator(ids, mask_id, vocab, special, g):
    return _corrupt(ids, mask_id, vocab, special, torch.Generator().manual_seed(torch.seed() % 2**31))


def test_mlm_corrupt_check_fails_plausible_wrong_answers_by_name():
    """Each passes the average shares the old check looked at, or misses them by a little."""
    assert check_mlm_corrupt(_corrupt).passed  # the parametrised corruption, unchanged, is right
    for wrong, words in [
        (every_7th, "position to position"),
        (every_7th_position, "position to position"),
        (one_random_token, "spread evenly"),
        (random_from_specials, "special token"),
        (partial(_corrupt, p=0.141), "of the non-special tokens were selected, expected 15%"),
        (partial(_corrupt, p=0.159), "of the non-special tokens were selected, expected 15%"),
        (partial(_corrupt, split=(0.786, 0.886)), "expected 80% / 10% / 10%"),
        (ignores_the_generator, "generator"),
    ]:
        report = check_mlm_corrupt(wrong)
        assert not report.passed and words in f"{report.problem} {report.hint}", (wrong, report)


def test_mlm_corrupt_check_passes_on_lib_and_fails_on_the_stub():
    assert check_mlm_corrupt(lib_corrupt).passed
    assert check_mlm_corrupt(stub).problem == "not attempted yet"


@pytest.mark.parametrize(
    "wrong, words",
    [
        (only_mask, "below 0.8"),
        (selects_specials, "special"),
        (in_place, "clone"),
        (no_ignore_labels, "special"),
        (lambda *a: a[0], "tuple"),
    ],
)
def test_mlm_corrupt_check_names_the_mistake(wrong, words):
    report = check_mlm_corrupt(wrong)
    assert not report.passed and words in f"{report.problem} {report.hint}"


def _pool_by_hand(hidden, attention_mask):
    w = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return (hidden * w).sum(1) / w.sum(1)


@pytest.mark.parametrize("solution", [partial(mean_pool, normalize=False), _pool_by_hand])
def test_mean_pool_check_passes_on_solutions_and_refuses_the_stub(solution):
    assert_passes_and_refuses_the_stub(check_mean_pool, solution)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda h, m: h.mean(1), "padding positions were averaged in"),
        (lambda h, m: (h * m.unsqueeze(-1)).sum(1) / h.shape[1], "divided by T"),
        (lambda h, m: mean_pool(h, m), "L2-normalised"),
        (lambda h, m: h[:, 0], "[CLS]"),
        (lambda h, m: h * m.unsqueeze(-1), "reduce dimension 1"),
    ],
)
def test_mean_pool_check_names_the_mistake(wrong, words):
    assert_names_the_mistake(check_mean_pool, wrong, words)
