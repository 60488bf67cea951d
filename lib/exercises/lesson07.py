"""Checks for lesson 07, "Mixture of Experts".

    check_top_k_gating(fn)         fn(logits (N, E), k) -> (gates (N, k), experts (N, k)): the k largest
                                   logits' experts and the softmax over those k logits (lib.moe's default)
    check_balance_loss(fn)         fn(router_logits (N, E), k) -> scalar, equal to
                                   lib.moe.load_balancing_loss
    check_expert_capacity(fn)      fn(num_tokens, num_experts, top_k, capacity_factor) -> int, equal to
                                   lib.moe.expert_capacity
"""

from __future__ import annotations

import math

import torch

from lib.exercises import CheckReport, call_learner
from lib.moe import expert_capacity, load_balancing_loss

__all__ = ["check_balance_loss", "check_expert_capacity", "check_top_k_gating"]


def _logits(N, E, seed):
    return torch.randn(N, E, generator=torch.Generator().manual_seed(seed)) * 2


def check_top_k_gating(fn) -> CheckReport:
    """fn(logits, k) -> (gates, experts), experts sorted by logit (largest first)."""
    name = "Exercise 7.1 (top-k gating)"
    cases = [("top-1 of 4 experts", _logits(6, 4, 0), 1), ("top-2 of 8 experts", _logits(10, 8, 1), 2),
             ("top-3 of 5, negative logits", _logits(7, 5, 2) - 10, 3)]
    for case, logits, k in cases:
        got, report = call_learner(name, fn, (logits, k), case, len(cases))
        if report is not None:
            return report
        top = logits.topk(k, dim=-1)
        expected = (torch.softmax(top.values, dim=-1), top.indices)

        def fail(problem, hint=None, case=case):
            return CheckReport(name, False, len(cases), case, problem, hint)

        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            return fail(f"returned {type(got).__name__}, expected a tuple (gates, experts)")
        gates, experts = got
        if experts.shape != (logits.shape[0], k) or not torch.equal(experts.long(), expected[1]):
            return fail("wrong experts", "experts = logits.topk(k, dim=-1).indices: the k largest logits per token")
        if gates.shape != expected[0].shape:
            return fail(f"gates have shape {tuple(gates.shape)}, expected {tuple(expected[0].shape)}")
        # fp32 softmax over <= 5 values: rounding only
        if not torch.allclose(gates, expected[0], rtol=1e-5, atol=1e-6):
            full = torch.softmax(logits, dim=-1).gather(1, expected[1])
            if torch.allclose(gates, full, rtol=1e-5, atol=1e-6):
                hint = ("those are the full softmax's probabilities (they do not sum to 1 over the k experts): "
                        "take the softmax over the k selected logits only")
            else:
                hint = "gates = softmax(the k selected logits): torch.softmax(top.values, dim=-1)"
            return fail("wrong gates", hint)
    return CheckReport(name, True, len(cases))


def check_balance_loss(fn) -> CheckReport:
    """fn(router_logits (N, E), k) -> E · Σ f_i P_i as a 0-dim tensor."""
    name = "Exercise 7.2 (the load-balancing loss)"
    even = torch.zeros(8, 4)
    even[torch.arange(8), torch.arange(8) % 4] = 5.0  # every expert first choice of 2 tokens
    skewed = _logits(12, 4, 3)
    skewed[:, 0] += 4  # expert 0 is everyone's favourite
    cases = [("an evenly routed batch, top-1", even, 1), ("a skewed router, top-1", skewed, 1),
             ("a skewed router, top-2", skewed, 2), ("random logits, 8 experts, top-2", _logits(32, 8, 4), 2)]
    for case, logits, k in cases:
        got, report = call_learner(name, fn, (logits, k), case, len(cases))
        if report is not None:
            return report
        expected = load_balancing_loss(logits, k)

        def fail(problem, hint=None, case=case):
            return CheckReport(name, False, len(cases), case, problem, hint)

        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            return fail(f"returned {type(got).__name__}, expected a one-number tensor")
        if torch.allclose(got.reshape(()), expected, rtol=1e-5, atol=1e-6):
            continue
        E = logits.shape[1]
        if torch.allclose(got.reshape(()) * E, expected, rtol=1e-5):
            hint = "multiply by E, the number of experts: perfectly even routing then gives k (1 for top-1)"
        elif k > 1 and torch.allclose(got.reshape(()) * k, expected, rtol=1e-5):
            hint = "f_i counts every token that picks expert i among its k, divided by N tokens (so Σ f_i = k)"
        else:
            hint = ("f_i = share of tokens with expert i among their top k (a count, no gradient), P_i = mean "
                    "softmax probability of expert i; the loss is E · Σ_i f_i · P_i")
        return fail(f"returned {got.reshape(()).item():.4f}, expected {expected.item():.4f}", hint)
    return CheckReport(name, True, len(cases))


def check_expert_capacity(fn) -> CheckReport:
    """fn(num_tokens, num_experts, top_k, capacity_factor) -> ceil(C · N · k / E) as an int."""
    name = "Exercise 7.3 (expert capacity)"
    cases = [("4096 tokens, 8 experts, top-2, C = 1.0", (4096, 8, 2, 1.0)),
             ("C = 1.25", (4096, 8, 2, 1.25)), ("a fraction to round up: 10 tokens, 3 experts, top-1", (10, 3, 1, 1.0)),
             ("top-2 on a fraction: 10 tokens, 3 experts, top-2", (10, 3, 2, 1.0)),
             ("C = 2.0, top-1, 64 experts", (1000, 64, 1, 2.0)),
             ("C = 1.1, exactly 11 slots: 100 tokens, 10 experts, top-1", (100, 10, 1, 1.1))]
    for case, args in cases:
        got, report = call_learner(name, fn, args, case, len(cases))
        if report is not None:
            return report
        expected = expert_capacity(*args)
        if isinstance(got, bool) or not isinstance(got, int):
            return CheckReport(name, False, len(cases), case, f"returned {type(got).__name__}, expected an int",
                               "a capacity counts token slots: return an int (math.ceil gives one)")
        if got != expected:
            N, E, k, C = args
            if got == int(C * N * k / E):
                hint = "round up, not down: a fraction of a slot still needs the slot (math.ceil)"
            elif got == math.ceil(C * N * k / E):
                hint = (f"float rounding: {C} is not exactly {C} in binary, so {C} · {N} · {k} / {E} comes out as "
                        f"{C * N * k / E!r} and rounds up one slot too many; keep the decimal value, "
                        "e.g. fractions.Fraction(str(capacity_factor))")
            elif got == math.ceil(C * N / E) * k:
                hint = "multiply by k before rounding up: ceil(C · N · k / E), not ceil(C · N / E) · k"
            elif got * k == expected or got == expected * k:
                hint = "every token makes k assignments: capacity = ceil(C · N · k / E)"
            else:
                hint = "capacity = ceil(capacity_factor · num_tokens · top_k / num_experts)"
            return CheckReport(name, False, len(cases), case, f"returned {got}, expected {expected}", hint)
    return CheckReport(name, True, len(cases))
