"""Checks for lesson 02, "BERT".

    check_padding_mask(fn)  fn(attention_mask) -> (B, 1, 1, T) additive mask, equal to
                            lib.masks.padding_mask
    check_mlm_corrupt(fn)   fn(input_ids, mask_token_id, vocab_size, special_token_ids, generator)
                            -> (corrupted, labels) following BERT's 15% / 80-10-10 rule
"""

from __future__ import annotations

import torch

from lib.exercises import Case, CheckReport, call_learner, run_checks
from lib.masks import padding_mask

__all__ = ["check_mlm_corrupt", "check_padding_mask"]


def _diagnose_padding(keep: torch.Tensor):
    def diagnose(got: torch.Tensor) -> str | None:
        expected = padding_mask(keep)
        if got.dtype == torch.bool:
            return "return an additive float mask (0 = real key, -inf = padding key), not True/False"
        if got.shape == keep.shape:
            return "add the head and query dimensions: (B, T) -> (B, 1, 1, T), e.g. with [:, None, None, :]"
        if got.shape == expected.shape and torch.equal(torch.isneginf(got), ~torch.isneginf(expected)):
            return "inverted: 1 marks a real token (0 in the mask), 0 marks padding (-inf)"
        if keep.shape[1] > 1 and got.shape == (keep.shape[0], 1, keep.shape[1], 1):
            return "that masks the queries (rows); padding must block the keys (the last dimension)"
        return None

    return diagnose


def check_padding_mask(fn) -> CheckReport:
    """fn(attention_mask (B, T) of 1/0) must return lib.masks.padding_mask's (B, 1, 1, T) float32 mask."""
    cases = []
    for name, keep in [
        ("one token, no padding", torch.tensor([[1]])),
        ("right padding", torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])),
        ("left padding", torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])),
        ("padding on both sides", torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 1]])),
    ]:
        cases.append(Case(name, (keep,), padding_mask(keep), exact=True, diagnose=_diagnose_padding(keep)))
    return run_checks("Exercise 2.1 (padding mask)", fn, cases)


# MLM corruption: judged on statistics of one large batch. With ~45k selected tokens the standard
# error of each share is under 0.2 points, so these bands are 5+ standard errors wide.
_SPECIAL = (0, 101, 102, 103)
_MASK, _VOCAB = 103, 30522
_TOL_SELECT, _TOL_SHARE = 0.01, 0.015


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, _VOCAB, (1200, 256), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    ids[::2, -50:] = 0  # padding
    return ids


def check_mlm_corrupt(fn) -> CheckReport:
    """fn(input_ids, mask_token_id, vocab_size, special_token_ids, generator) must select ~15% of the
    non-special tokens, turn 80% of those into [MASK], 10% into a random token, leave 10%, and
    return labels holding the original id at selected positions and -100 elsewhere."""
    name = "Exercise 2.2 (80/10/10 corruption)"
    ids = _batch()
    original = ids.clone()
    case = "a batch of 300k tokens with [CLS], [SEP] and padding"
    out, report = call_learner(name, fn, (ids, _MASK, _VOCAB, list(_SPECIAL), torch.Generator().manual_seed(1)), case, 6)
    if report is not None:
        return report

    def fail(problem, hint=None):
        return CheckReport(name, False, 6, case, problem, hint)

    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        return fail(f"returned {type(out).__name__}, expected a tuple (corrupted_ids, labels)")
    corrupted, labels = out
    if corrupted.shape != ids.shape or labels.shape != ids.shape:
        return fail(f"returned shapes {tuple(corrupted.shape)} and {tuple(labels.shape)}, expected {tuple(ids.shape)} for both")
    if not torch.equal(ids, original):
        return fail("the input_ids passed in were modified", "work on a copy: corrupted = input_ids.clone()")
    special = torch.isin(ids, torch.tensor(_SPECIAL))
    selected = labels != -100
    if not selected.any():
        return fail("no label differs from -100: nothing was selected", "select each non-special token with probability 0.15")
    if bool((selected & special).any()) or not torch.equal(corrupted[special], ids[special]):
        return fail("a special token ([CLS], [SEP], [PAD]) was selected or changed",
                    "only positions whose id is not in special_token_ids may be selected")
    if not torch.equal(labels[selected], ids[selected]):
        return fail("labels at selected positions must be the original token ids", "labels = where(selected, input_ids, -100)")
    if not torch.equal(corrupted[~selected], ids[~selected]):
        return fail("a token that was not selected changed (or its label is -100 although it changed)",
                    "change only selected positions, and give every selected position its label")
    share = selected.sum().item() / (~special).sum().item()
    if abs(share - 0.15) > _TOL_SELECT:
        return fail(f"{share:.1%} of the non-special tokens were selected, expected 15%",
                    "select with torch.rand(shape, generator=generator) < 0.15, excluding special tokens")
    n = selected.sum().item()
    masked = (selected & (corrupted == _MASK)).sum().item() / n
    unchanged = (selected & (corrupted == ids)).sum().item() / n
    randomised = 1 - masked - unchanged
    if max(abs(masked - 0.8), abs(randomised - 0.1), abs(unchanged - 0.1)) > _TOL_SHARE:
        return fail(f"of the selected tokens {masked:.1%} became [MASK], {randomised:.1%} random, {unchanged:.1%} unchanged; "
                    "expected 80% / 10% / 10%",
                    "draw one number per selected token: below 0.8 -> [MASK], 0.8 to 0.9 -> a random id, else keep it")
    return CheckReport(name, True, 6)
