"""Lesson 07's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import math

import pytest
import torch

from exercise_helpers import stub
from lib.exercises.lesson07 import check_balance_loss, check_expert_capacity, check_top_k_gating
from lib.moe import expert_capacity, load_balancing_loss


def _gating(logits, k):
    top = logits.topk(k, dim=-1)
    return torch.softmax(top.values, dim=-1), top.indices


def test_lesson07_checks_pass_on_lib_and_fail_on_the_stub():
    assert check_top_k_gating(_gating).passed
    assert check_balance_loss(load_balancing_loss).passed
    assert check_expert_capacity(expert_capacity).passed
    for check in (check_top_k_gating, check_balance_loss, check_expert_capacity):
        report = check(stub)
        assert not report.passed and "not attempted" in repr(report)


@pytest.mark.parametrize("check, wrong, words", [
    (check_top_k_gating, lambda l, k: (torch.softmax(l, -1).gather(1, l.topk(k, -1).indices), l.topk(k, -1).indices),
     "full softmax"),
    (check_top_k_gating, lambda l, k: (_gating(l, k)[0], l.topk(k, -1, largest=False).indices), "k largest"),
    (check_balance_loss, lambda l, k: load_balancing_loss(l, k) / l.shape[1], "multiply by E"),
    (check_balance_loss, lambda l, k: load_balancing_loss(l, k) / k, "Σ f_i = k"),
    (check_expert_capacity, lambda N, E, k, C: int(C * N * k / E), "round up"),
    (check_expert_capacity, lambda N, E, k, C: -(-int(C * N) // E), "k assignments"),
    (check_expert_capacity, lambda N, E, k, C: math.ceil(C * N / E) * k, "before rounding up"),  # 8 at (10, 3, 2, 1)
    (check_expert_capacity, lambda N, E, k, C: math.ceil(C * N * k / E), "float rounding"),  # 12 at (100, 10, 1, 1.1)
])
def test_lesson07_checks_name_the_mistake(check, wrong, words):
    report = check(wrong)
    assert not report.passed and words in report.hint, report
