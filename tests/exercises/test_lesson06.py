"""Lesson 06's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import pytest
import torch
import torch.nn.functional as F
from exercise_helpers import assert_names_the_mistake, assert_passes_and_refuses_the_stub, stub

from lib.conv import causal_conv1d, causal_conv1d_ref
from lib.course.exercises.lesson06 import check_causal_conv1d, check_discretize, check_scan_combine, check_ssm_step
from lib.scan import discretize
from lib.scan_parallel import scan_combine


def _lib_step(h, x, delta, A, B, C):
    h_next = torch.exp(delta.unsqueeze(-1) * A) * h + (delta * x).unsqueeze(-1) * B.unsqueeze(1)
    return (h_next * C.unsqueeze(1)).sum(-1), h_next


def test_lesson06_checks_pass_on_lib_and_fail_on_the_stub():
    assert check_discretize(discretize).passed
    assert check_ssm_step(_lib_step).passed
    assert check_scan_combine(scan_combine).passed
    for check in (check_discretize, check_ssm_step, check_scan_combine):
        report = check(stub)
        assert not report.passed and "not attempted" in repr(report)


@pytest.mark.parametrize(
    "check, wrong, words",
    [
        (check_discretize, lambda d, A, B: (1 + d.unsqueeze(-1) * A, d.unsqueeze(-1) * B.unsqueeze(-2)), "Euler"),
        (
            check_discretize,
            lambda d, A, B: (torch.exp(d.unsqueeze(-1) * A), B.unsqueeze(-2).expand(*d.shape, -1)),
            "Δ·B",
        ),
        (check_ssm_step, lambda h, x, d, A, B, C: _lib_step(h, x / d, d, A, B, C), "multiply x by Δ"),
        (
            check_ssm_step,
            lambda h, x, d, A, B, C: ((h * C.unsqueeze(1)).sum(-1), _lib_step(h, x, d, A, B, C)[1]),
            "not the old h",
        ),
        (check_scan_combine, lambda l, r: (l[0] * r[0], l[0] * r[1] + l[1]), "left happens first"),
    ],
)
def test_lesson06_checks_name_the_mistake(check, wrong, words):
    report = check(wrong)
    assert not report.passed and words in report.hint, report


def _conv_by_hand(x, weight, bias):
    B, T, E = x.shape
    K = weight.shape[1]
    padded = torch.cat([x.new_zeros(B, K - 1, E), x], dim=1)  # (B, K - 1 + T, E)
    return sum(weight[:, j] * padded[:, j : j + T] for j in range(K)) + bias


def _conv(x, weight, bias, left, right, flip=False):
    """F.conv1d zero-padded by left and right positions; flip reverses the kernel."""
    w = weight.flip(-1) if flip else weight
    xs = F.pad(x.transpose(1, 2), (left, right))  # (B, E, left + T + right)
    return F.conv1d(xs, w.unsqueeze(1), bias, groups=weight.shape[0]).transpose(1, 2)


@pytest.mark.parametrize("solution", [_conv_by_hand, causal_conv1d_ref, causal_conv1d])
def test_causal_conv1d_check_passes_on_solutions_and_refuses_the_stub(solution):
    assert_passes_and_refuses_the_stub(check_causal_conv1d, solution)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda x, w, b: _conv(x, w, b, w.shape[1] - 1, 0, flip=True), "the weights are reversed"),
        (lambda x, w, b: _conv(x, w, b, 0, w.shape[1] - 1), "reads inputs after t"),
        (
            lambda x, w, b: _conv(x, w, b, (w.shape[1] - 1) // 2, w.shape[1] - 1 - (w.shape[1] - 1) // 2),
            "reads inputs after t",
        ),
        (lambda x, w, b: _conv(x, w, None, w.shape[1] - 1, 0), "bias"),
        (lambda x, w, b: _conv(x, w, b, w.shape[1] - 1, w.shape[1] - 1), "T + K - 1 outputs"),
        (lambda x, w, b: _conv(x, w, b, 0, 0), "pad K - 1 zeros on the left"),
        (lambda x, w, b: _conv(x, w, b, w.shape[1] - 1, 0).transpose(1, 2), "transpose back"),
    ],
)
def test_causal_conv1d_check_names_the_mistake(wrong, words):
    assert_names_the_mistake(check_causal_conv1d, wrong, words)
