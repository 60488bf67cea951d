"""Lesson 03's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import pytest
import torch
from exercise_helpers import assert_names_the_mistake, assert_passes_and_refuses_the_stub, stub

from lib.course.exercises.lesson03 import (
    check_clm_loss,
    check_repetition_penalty,
    check_rope,
    check_top_p_filter,
    repetition_penalty_ref,
)
from lib.rope import apply_rope, rope_cos_sin
from lib.sampling import top_p_filter
from lib.train import clm_loss


def _lib_rope(x, positions):
    return apply_rope(x, *rope_cos_sin(len(positions), x.shape[-1], offset=int(positions[0])))


def test_lesson03_checks_pass_on_lib_and_fail_on_the_stub():
    for check, solution in ((check_clm_loss, clm_loss), (check_top_p_filter, top_p_filter), (check_rope, _lib_rope)):
        assert check(solution).passed, check(solution)
        report = check(stub)
        assert not report.passed and "not attempted" in repr(report)


def _unshifted(logits, idx):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))


def _summed(logits, idx):
    return clm_loss(logits, idx) * idx.shape[0] * (idx.shape[1] - 1)


@pytest.mark.parametrize("wrong, words", [(_unshifted, "no shift"), (_summed, "sum")])
def test_clm_loss_check_names_the_mistake(wrong, words):
    report = check_clm_loss(wrong)
    assert not report.passed and words in report.hint, report


def _top_p_strict(logits, p):  # keeps only tokens whose running total stays below p: one too few
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, probs.cumsum(-1) < p)
    return logits.masked_fill(~keep, float("-inf"))


def _top_p_probs(logits, p):  # returns probabilities instead of logits
    return top_p_filter(logits, p).softmax(-1).log()


@pytest.mark.parametrize("wrong, words", [(_top_p_strict, "too few"), (_top_p_probs, "logits themselves")])
def test_top_p_check_names_the_mistake(wrong, words):
    report = check_top_p_filter(wrong)
    assert not report.passed and words in report.hint, report


def _rope_interleaved(x, positions):
    D = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = (positions.double()[:, None] * theta[None, :]).repeat_interleave(2, dim=-1)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return (x.double() * angles.cos() + torch.cat([-x2, x1], dim=-1).double() * angles.sin()).float()


@pytest.mark.parametrize(
    "wrong, words", [(_rope_interleaved, "repeat-interleaved"), (lambda x, p: x, "equals the input")]
)
def test_rope_check_names_the_mistake(wrong, words):
    report = check_rope(wrong)
    assert not report.passed and words in report.hint, report


def _penalty_like_hugging_face(logits, input_ids, penalty):  # RepetitionPenaltyLogitsProcessor's three lines
    score = torch.gather(logits, 1, input_ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(1, input_ids, score)


@pytest.mark.parametrize("solution", [repetition_penalty_ref, _penalty_like_hugging_face])
def test_repetition_penalty_check_passes_on_solutions_and_refuses_the_stub(solution):
    assert_passes_and_refuses_the_stub(check_repetition_penalty, solution)


def _seen(logits, input_ids):
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, input_ids, True)


def _divides_every_seen(logits, input_ids, penalty):
    return torch.where(_seen(logits, input_ids), logits / penalty, logits)


def _once_per_occurrence(logits, input_ids, penalty):
    out = logits.clone()
    for b, row in enumerate(input_ids.tolist()):
        for t in row:
            out[b, t] = out[b, t] / penalty if out[b, t] > 0 else out[b, t] * penalty
    return out


def _contexts_pooled(logits, input_ids, penalty):
    out, ids = logits.clone(), input_ids.unique()
    out[:, ids] = torch.where(out[:, ids] > 0, out[:, ids] / penalty, out[:, ids] * penalty)
    return out


def _in_place(logits, input_ids, penalty):
    return logits.copy_(repetition_penalty_ref(logits, input_ids, penalty))


@pytest.mark.parametrize(
    "wrong, words",
    [
        (_divides_every_seen, "multiply negative ones"),
        (lambda l, ids, p: repetition_penalty_ref(l, ids, 1 / p), "backwards"),
        (_once_per_occurrence, "penalise each token once"),
        (_contexts_pooled, "each row has its own context"),
        (lambda l, ids, p: torch.where(l > 0, l / p, l * p), "not the whole vocabulary"),
        (_in_place, "work on a copy"),
    ],
)
def test_repetition_penalty_check_names_the_mistake(wrong, words):
    assert_names_the_mistake(check_repetition_penalty, wrong, words)
