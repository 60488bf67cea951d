"""Lesson 07's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import math

import pytest
import torch
from exercise_helpers import assert_names_the_mistake, assert_passes_and_refuses_the_stub, stub

from lib.course.exercises.lesson07 import (
    check_balance_loss,
    check_expert_capacity,
    check_router_z_loss,
    check_top_k_gating,
)
from lib.moe import expert_capacity, load_balancing_loss, router_z_loss


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


@pytest.mark.parametrize(
    "check, wrong, words",
    [
        (
            check_top_k_gating,
            lambda l, k: (torch.softmax(l, -1).gather(1, l.topk(k, -1).indices), l.topk(k, -1).indices),
            "full softmax",
        ),
        (check_top_k_gating, lambda l, k: (_gating(l, k)[0], l.topk(k, -1, largest=False).indices), "k largest"),
        (check_balance_loss, lambda l, k: load_balancing_loss(l, k) / l.shape[1], "multiply by E"),
        (check_balance_loss, lambda l, k: load_balancing_loss(l, k) / k, "Σ f_i = k"),
        (check_expert_capacity, lambda N, E, k, C: int(C * N * k / E), "round up"),
        (check_expert_capacity, lambda N, E, k, C: -(-int(C * N) // E), "k assignments"),
        (
            check_expert_capacity,
            lambda N, E, k, C: math.ceil(C * N / E) * k,
            "before rounding up",
        ),  # 8 at (10, 3, 2, 1)
        (
            check_expert_capacity,
            lambda N, E, k, C: math.ceil(C * N * k / E),
            "float rounding",
        ),  # 12 at (100, 10, 1, 1.1)
    ],
)
def test_lesson07_checks_name_the_mistake(check, wrong, words):
    report = check(wrong)
    assert not report.passed and words in report.hint, report


@pytest.mark.parametrize("solution", [router_z_loss, lambda logits: torch.logsumexp(logits, dim=-1).square().mean()])
def test_router_z_loss_check_passes_on_solutions_and_refuses_the_stub(solution):
    assert_passes_and_refuses_the_stub(check_router_z_loss, solution)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda l: torch.logsumexp(l, dim=-1).mean(), "square each token's log-sum-exp"),
        (lambda l: torch.logsumexp(l, dim=-1).pow(2).sum(), "not sum"),
        (lambda l: l.amax(dim=-1).pow(2).mean(), "not the largest logit"),
        (lambda l: torch.logsumexp(l.softmax(dim=-1), dim=-1).pow(2).mean(), "not on softmax probabilities"),
        (lambda l: torch.logsumexp(l, dim=0).pow(2).mean(), "not over the tokens"),
        (lambda l: l.pow(2).mean(), "that squares each logit"),
        (lambda l: l.exp().sum(-1).log().pow(2).mean(), "overflows float32"),
        (lambda l: torch.logsumexp(l, dim=-1).pow(2), "one number for the batch"),
        (lambda l: router_z_loss(l).item(), "not .item()"),
    ],
)
def test_router_z_loss_check_names_the_mistake(wrong, words):
    assert_names_the_mistake(check_router_z_loss, wrong, words)
