"""Lesson 06's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import pytest
import torch

from exercise_helpers import stub
from lib.exercises.lesson06 import check_discretize, check_scan_combine, check_ssm_step
from lib.scan import discretize, scan_combine


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


@pytest.mark.parametrize("check, wrong, words", [
    (check_discretize, lambda d, A, B: (1 + d.unsqueeze(-1) * A, d.unsqueeze(-1) * B.unsqueeze(-2)), "Euler"),
    (check_discretize, lambda d, A, B: (torch.exp(d.unsqueeze(-1) * A), B.unsqueeze(-2).expand(*d.shape, -1)), "Δ·B"),
    (check_ssm_step, lambda h, x, d, A, B, C: _lib_step(h, x / d, d, A, B, C), "multiply x by Δ"),
    (check_ssm_step, lambda h, x, d, A, B, C: ((h * C.unsqueeze(1)).sum(-1), _lib_step(h, x, d, A, B, C)[1]),
     "not the old h"),
    (check_scan_combine, lambda l, r: (l[0] * r[0], l[0] * r[1] + l[1]), "left happens first"),
])
def test_lesson06_checks_name_the_mistake(check, wrong, words):
    report = check(wrong)
    assert not report.passed and words in report.hint, report
