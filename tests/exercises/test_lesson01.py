"""Lesson 01's exercise checks: they fail on stubs with hints, pass on solutions, never raise."""

import math

import pytest
import torch
from exercise_helpers import assert_names_the_mistake, assert_passes_and_refuses_the_stub, stub

from lib.attention import attention_ref
from lib.course.exercises import CheckReport
from lib.course.exercises.lesson01 import check_causal_mask, check_cross_attention_mask, check_masked_attention
from lib.masks import causal_mask, combine_masks, cross_attention_mask, padding_mask


# ---------------------------------------------------------------- exercise 1.1
def test_causal_mask_check_passes_on_the_solution_and_fails_on_the_stub():
    assert check_causal_mask(causal_mask).passed
    report = check_causal_mask(stub)
    assert not report.passed and report.problem == "not attempted yet"
    assert "NotImplementedError" in repr(report)


@pytest.mark.parametrize(
    "wrong, hint_words",
    [
        (lambda T: torch.ones(T, T, dtype=torch.bool).tril(), "not True/False"),
        (lambda T: torch.full((T, T), float("-inf")).tril(diagonal=-1), "blocked the past"),
        (lambda T: torch.full((T, T), float("-inf")).triu(diagonal=0), "diagonal"),
        (lambda T: torch.full((T, T), -1e9).triu(diagonal=1), "-1e9"),
        (lambda T: torch.full((T, T), float("-inf")).triu(diagonal=1).double(), None),
        (lambda T: None, "return"),
    ],
)
def test_causal_mask_check_names_the_mistake(wrong, hint_words):
    report = check_causal_mask(wrong)
    assert not report.passed
    if hint_words:
        assert hint_words in (report.hint or "") + (report.problem or "")


# ---------------------------------------------------------------- exercise 1.2
def solution(q, k, v, mask):
    return attention_ref(q, k, v, mask)


def plain_softmax(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask, -1) @ v


def no_max_subtraction(q, k, v, mask):
    e = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask)
    return e / e.sum(-1, keepdim=True).clamp_min(1e-30) @ v


def unscaled(q, k, v, mask):
    return attention_ref(q, k, v, mask, scale=1.0)


def wrong_axis(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask, -2).nan_to_num(0.0) @ v


def mask_ignored(q, k, v, mask):
    return attention_ref(q, k, v)


def crashes(q, k, v, mask):
    return q @ k  # shape error for T != D


def test_masked_attention_check_passes_on_the_solution_and_fails_on_the_stub():
    assert check_masked_attention(solution).passed
    assert check_masked_attention(stub).problem == "not attempted yet"


@pytest.mark.parametrize(
    "wrong, words",
    [
        (plain_softmax, "did a whole row get -inf?"),
        (no_max_subtraction, "subtract each row's maximum"),
        (unscaled, "divide QKᵀ by √D"),
        (wrong_axis, "dim=-1"),
        (mask_ignored, "the mask was not applied"),
        (crashes, "raised RuntimeError"),
    ],
)
def test_masked_attention_check_gives_a_targeted_hint(wrong, words):
    report = check_masked_attention(wrong)
    assert isinstance(report, CheckReport) and not report.passed
    assert words in f"{report.problem} {report.hint}"


def test_a_check_given_a_non_function_explains_instead_of_raising():
    report = check_causal_mask(causal_mask(3))
    assert not report.passed and "without calling it" in report.hint


# ---------------------------------------------------------------- exercise 1.3
def _cross_by_hand(encoder_attention_mask, tgt_len):
    B, S = encoder_attention_mask.shape
    blocked = (encoder_attention_mask == 0)[:, None, None, :].expand(B, 1, tgt_len, S)
    return torch.zeros(B, 1, tgt_len, S).masked_fill(blocked, float("-inf"))


@pytest.mark.parametrize("solution", [cross_attention_mask, _cross_by_hand])
def test_cross_attention_mask_check_passes_on_solutions_and_refuses_the_stub(solution):
    assert_passes_and_refuses_the_stub(check_cross_attention_mask, solution)


def _with_triangle(keep, T):  # a decoder's self-attention triangle added to the cross mask
    return cross_attention_mask(keep, T) + torch.full((T, keep.shape[1]), float("-inf")).triu(diagonal=1)


def _padding_on_rows(keep, T):  # the source's padding blocks query rows (only possible when T == S)
    return torch.zeros(keep.shape[0], 1, T, keep.shape[1]).masked_fill(keep[:, None, :, None] == 0, float("-inf"))


@pytest.mark.parametrize(
    "wrong, words",
    [
        (_with_triangle, "causal triangle"),
        (lambda keep, T: combine_masks(causal_mask(T), padding_mask(keep)), "causal triangle"),
        (_padding_on_rows, "masks query rows"),
        (lambda keep, T: cross_attention_mask(keep, T).clamp_min(-1e9), "not -1e9"),
        (lambda keep, T: padding_mask(keep), "(B, 1, 1, S) -> (B, 1, T, S)"),
        (lambda keep, T: cross_attention_mask(keep, T)[0, 0], "keep the batch dimension"),
        (lambda keep, T: cross_attention_mask(1 - keep, T), "inverted"),
        (lambda keep, T: (keep == 1)[:, None, None, :].expand(-1, 1, T, -1), "not True/False"),
        (lambda keep, T: cross_attention_mask(keep, T).double(), "expected torch.float32"),
    ],
)
def test_cross_attention_mask_check_names_the_mistake(wrong, words):
    assert_names_the_mistake(check_cross_attention_mask, wrong, words)


def test_masked_attention_check_reports_a_wrong_shape_instead_of_raising():
    report = check_masked_attention(lambda q, k, v, mask: torch.zeros(3))
    assert not report.passed and "expected shape" in report.problem
