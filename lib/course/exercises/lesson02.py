"""Checks for lesson 02, "BERT".

check_padding_mask(fn)  fn(attention_mask) -> (B, 1, 1, T) additive mask, equal to
                        lib.masks.padding_mask
check_mlm_corrupt(fn)   fn(input_ids, mask_token_id, vocab_size, special_token_ids, generator)
                        -> (corrupted, labels) following BERT's 15% / 80-10-10 rule
check_mean_pool(fn)     fn(hidden (B, T, C), attention_mask (B, T)) -> (B, C), the mean of the real
                        tokens' states, equal to lib.bert.mean_pool(..., normalize=False)
"""

from __future__ import annotations

import torch

from lib.bert import mean_pool
from lib.course.exercises import Case, CheckReport, call_learner, run_checks
from lib.masks import padding_mask

__all__ = ["check_mean_pool", "check_mlm_corrupt", "check_padding_mask"]


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


# MLM corruption: judged on statistics of one large batch of 614,400 tokens, about 550,000 of
# them not special, so about 82,000 selected. Standard errors: the selection rate 0.05 points, the
# [MASK] share 0.14, the random and unchanged shares 0.10. The bands, 0.35 and 0.6 points, are at
# least 4 standard errors: a correct solution with another random stream fails about once in ten
# thousand runs, while 14.1% or 15.9% selected, or a 78.6 / 10 / 11.4 split, fail. Two chi-squared
# statistics look past the averages: the selection rate column by column, and the random
# replacements over 16 ranges of the non-special ids (one fixed "random" token gives the right
# share); each must stay below df + 6·sqrt(2·df), which a fair draw exceeds about once in a million.
# And tokens a few places apart must be selected together no more often than independent draws
# allow (selecting every 7th token gives the right average and even columns).
_SPECIAL = (0, 101, 102, 103)
_MASK, _VOCAB = 103, 30522
_TOL_SELECT, _TOL_SHARE = 0.0035, 0.006
_BUCKETS = 16


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, _VOCAB, (2400, 256), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    ids[::2, -50:] = 0  # padding
    return ids


def _chi2_too_large(observed: torch.Tensor, expected: torch.Tensor, variance: torch.Tensor) -> bool:
    """sum (o - e)^2 / var over the bins, against df + 6 sqrt(2 df) (df = bins - 1)."""
    stat = ((observed - expected) ** 2 / variance).sum().item()
    df = observed.numel() - 1
    return stat > df + 6 * (2 * df) ** 0.5


def _lagged_pattern(selected: torch.Tensor, eligible: torch.Tensor, lags=range(1, 17)) -> bool:
    """Whether two eligible tokens `lag` apart along the flattened batch are both selected more or
    less often than independent draws allow (|z| > 6 at some lag): every 7th token is selected
    with the right average, but two tokens 7 apart always together."""
    s = selected.double()
    for lag in lags:
        both = eligible[:-lag] & eligible[lag:]
        m = int(both.sum())
        p = s[:-lag][both].mean().item()
        pairs = (s[:-lag] * s[lag:])[both].mean().item()
        if abs(pairs - p * p) > 6 * (p * p * (1 - p * p) / m) ** 0.5:
            return True
    return False


def check_mlm_corrupt(fn) -> CheckReport:
    """fn(input_ids, mask_token_id, vocab_size, special_token_ids, generator) must select ~15% of the
    non-special tokens, at every position alike, turn 80% of those into [MASK], 10% into a random
    non-special token (any of them, evenly), leave 10%, take every draw from `generator`, and return
    labels holding the original id at selected positions and -100 elsewhere."""
    name = "Exercise 2.2 (80/10/10 corruption)"
    ids = _batch()
    original = ids.clone()
    case = "a batch of 614,400 tokens with [CLS], [SEP] and padding"
    n_checks = 9
    out, report = call_learner(
        name, fn, (ids, _MASK, _VOCAB, list(_SPECIAL), torch.Generator().manual_seed(1)), case, n_checks
    )
    if report is not None:
        return report

    def fail(problem, hint=None):
        return CheckReport(name, False, n_checks, case, problem, hint)

    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        return fail(f"returned {type(out).__name__}, expected a tuple (corrupted_ids, labels)")
    corrupted, labels = out
    if corrupted.shape != ids.shape or labels.shape != ids.shape:
        return fail(
            f"returned shapes {tuple(corrupted.shape)} and {tuple(labels.shape)}, expected {tuple(ids.shape)} for both"
        )
    if not torch.equal(ids, original):
        return fail("the input_ids passed in were modified", "work on a copy: corrupted = input_ids.clone()")
    special = torch.isin(ids, torch.tensor(_SPECIAL))
    selected = labels != -100
    if not selected.any():
        return fail(
            "no label differs from -100: nothing was selected", "select each non-special token with probability 0.15"
        )
    if bool((selected & special).any()) or not torch.equal(corrupted[special], ids[special]):
        return fail(
            "a special token ([CLS], [SEP], [PAD]) was selected or changed",
            "only positions whose id is not in special_token_ids may be selected",
        )
    if not torch.equal(labels[selected], ids[selected]):
        return fail(
            "labels at selected positions must be the original token ids", "labels = where(selected, input_ids, -100)"
        )
    if not torch.equal(corrupted[~selected], ids[~selected]):
        return fail(
            "a token that was not selected changed (or its label is -100 although it changed)",
            "change only selected positions, and give every selected position its label",
        )
    share = selected.sum().item() / (~special).sum().item()
    if abs(share - 0.15) > _TOL_SELECT:
        return fail(
            f"{share:.2%} of the non-special tokens were selected, expected 15%",
            "select with torch.rand(shape, generator=generator) < 0.15, excluding special tokens",
        )
    per_position = (~special).sum(0).double()  # (T,): how many non-special tokens each position holds
    at = per_position > 0
    if _chi2_too_large(
        selected.sum(0).double()[at], 0.15 * per_position[at], 0.15 * 0.85 * per_position[at]
    ) or _lagged_pattern(selected.flatten(), (~special).flatten()):
        return fail(
            "the share selected differs from position to position, far beyond chance",
            "draw one independent number per token: torch.rand(input_ids.shape, generator=generator) < 0.15, "
            "not a pattern over positions",
        )
    n = selected.sum().item()
    masked = (selected & (corrupted == _MASK)).sum().item() / n
    unchanged = (selected & (corrupted == ids)).sum().item() / n
    randomised = 1 - masked - unchanged
    if max(abs(masked - 0.8), abs(randomised - 0.1), abs(unchanged - 0.1)) > _TOL_SHARE:
        return fail(
            f"of the selected tokens {masked:.1%} became [MASK], {randomised:.1%} random, {unchanged:.1%} unchanged; "
            "expected 80% / 10% / 10%",
            "draw one number per selected token: below 0.8 -> [MASK], 0.8 to 0.9 -> a random id, else keep it",
        )
    replaced = corrupted[selected & (corrupted != _MASK) & (corrupted != ids)]  # the random replacements
    if bool(torch.isin(replaced, torch.tensor(_SPECIAL)).any()):
        return fail(
            "a random replacement is a special token ([PAD], [CLS], [SEP] or [MASK])",
            "draw random ids from the non-special vocabulary only, as lib.bert.mlm_corrupt does",
        )
    allowed = torch.ones(_VOCAB, dtype=torch.bool)
    allowed[list(_SPECIAL)] = False
    rank = torch.cumsum(allowed, 0) - 1  # each non-special id's place among them
    n_ids = int(allowed.sum())
    bucket = torch.div(rank[replaced] * _BUCKETS, n_ids, rounding_mode="floor")
    counts = torch.bincount(bucket, minlength=_BUCKETS).double()
    size = (
        torch.bincount(
            torch.div(torch.arange(n_ids) * _BUCKETS, n_ids, rounding_mode="floor"), minlength=_BUCKETS
        ).double()
        / n_ids
    )  # each range's share of the ids
    if _chi2_too_large(counts, size * len(replaced), size * len(replaced)):
        return fail(
            "the random replacements are not spread evenly over the vocabulary",
            "draw each random id independently and uniformly from the non-special ids, e.g. "
            "candidates[torch.randint(len(candidates), shape, generator=generator)]",
        )
    again = fn(ids, _MASK, _VOCAB, list(_SPECIAL), torch.Generator().manual_seed(1))
    other = fn(ids, _MASK, _VOCAB, list(_SPECIAL), torch.Generator().manual_seed(2))
    if not (torch.equal(again[0], corrupted) and torch.equal(again[1], labels)) or torch.equal(other[1], labels):
        return fail(
            "the result does not follow the generator: the same seed must give the same corruption, "
            "another seed another one",
            "pass generator=generator to every torch.rand / torch.randint call (not the global random state)",
        )
    return CheckReport(name, True, n_checks)


# --------------------------------------------------------------------------- 2.3 mean pooling
def _diagnose_pool(hidden: torch.Tensor, keep: torch.Tensor):
    B, T, C = hidden.shape
    w = keep.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    summed = (hidden * w).sum(1)  # (B, C)
    expected = summed / w.sum(1)

    def diagnose(got: torch.Tensor) -> str | None:
        if got.shape == (B, T, C):
            return "average over the tokens: reduce dimension 1, (B, T, C) -> (B, C)"
        if got.shape != (B, C):
            return None
        near = lambda x: bool(torch.allclose(got, x, rtol=1e-4, atol=1e-4))  # noqa: E731
        if near(hidden.mean(1)):
            return (
                "the padding positions were averaged in: their states are not zero, so weight each position "
                "by attention_mask before summing, and count only the real tokens"
            )
        if near(summed / T):
            return (
                "the sum is right but it was divided by T, the padded length: divide by each sequence's number "
                "of real tokens, attention_mask.sum(1)"
            )
        if near(torch.nn.functional.normalize(expected, dim=-1)):
            return (
                "that is L2-normalised: lib.bert.mean_pool does that afterwards (normalize=True), but this "
                "exercise asks for the plain mean"
            )
        if near(hidden[:, 0]):
            return "that is the first token's ([CLS]) vector: mean pooling averages every real token"
        return None

    return diagnose


def check_mean_pool(fn) -> CheckReport:
    """fn(hidden (B, T, C), attention_mask (B, T) of 1/0) must return the (B, C) mean of the hidden
    states at the real positions, equal to lib.bert.mean_pool(hidden, attention_mask, normalize=False)."""
    g = torch.Generator().manual_seed(3)
    cases = []
    for name, keep, C in [
        ("one sequence of 3 tokens, no padding", torch.tensor([[1, 1, 1]]), 4),
        ("T = 1", torch.tensor([[1], [1]]), 3),
        ("right padding", torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), 8),
        (
            "padding on both sides, a sequence with a single real token",
            torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0], [1, 1, 1, 1]]),
            6,
        ),
    ]:
        B, T = keep.shape
        hidden = torch.randn(B, T, C, generator=g) + 1.0
        hidden[keep == 0] = 20.0 + 5 * torch.randn(int((keep == 0).sum()), C, generator=g)  # padding is not zero
        # fp32, at most 5 terms of size ~1 summed in any order: agreement to ~1e-7
        cases.append(
            Case(
                name,
                (hidden, keep),
                mean_pool(hidden, keep, normalize=False),
                atol=1e-5,
                rtol=1e-5,
                diagnose=_diagnose_pool(hidden, keep),
            )
        )
    return run_checks("Exercise 2.3 (mean pooling that ignores padding)", fn, cases)
