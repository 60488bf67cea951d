"""Lesson 03's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import pytest
import torch

from exercise_helpers import stub
from lib.exercises.lesson03 import check_clm_loss, check_rope, check_top_p_filter
from lib.gpt import clm_loss
from lib.rope import apply_rope, rope_cos_sin
from lib.sampling import top_p_filter


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
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return (x.double() * angles.cos() + torch.cat([-x2, x1], dim=-1).double() * angles.sin()).float()


@pytest.mark.parametrize("wrong, words", [(_rope_interleaved, "repeat-interleaved"), (lambda x, p: x, "equals the input")])
def test_rope_check_names_the_mistake(wrong, words):
    report = check_rope(wrong)
    assert not report.passed and words in report.hint, report
