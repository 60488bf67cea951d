"""Checks for lesson 07, "Mixture of Experts".

check_top_k_gating(fn)         fn(logits (N, E), k) -> (gates (N, k), experts (N, k)): the k largest
                               logits' experts and the softmax over those k logits (lib.moe's default)
check_balance_loss(fn)         fn(router_logits (N, E), k) -> scalar, equal to
                               lib.moe.load_balancing_loss
check_expert_capacity(fn)      fn(num_tokens, num_experts, top_k, capacity_factor) -> int, equal to
                               lib.moe.expert_capacity
check_router_z_loss(fn)        fn(router_logits (N, E)) -> scalar, equal to lib.moe.router_z_loss
"""

from __future__ import annotations

import math

import torch

from lib.course.exercises import CheckReport, call_learner
from lib.moe import expert_capacity, load_balancing_loss, router_z_loss

__all__ = ["check_balance_loss", "check_expert_capacity", "check_router_z_loss", "check_top_k_gating"]


def _logits(N, E, seed):
    return torch.randn(N, E, generator=torch.Generator().manual_seed(seed)) * 2


def check_top_k_gating(fn) -> CheckReport:
    """fn(logits, k) -> (gates, experts), experts sorted by logit (largest first)."""
    name = "Exercise 7.1 (top-k gating)"
    cases = [
        ("top-1 of 4 experts", _logits(6, 4, 0), 1),
        ("top-2 of 8 experts", _logits(10, 8, 1), 2),
        ("top-3 of 5, negative logits", _logits(7, 5, 2) - 10, 3),
    ]
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
                hint = (
                    "those are the full softmax's probabilities (they do not sum to 1 over the k experts): "
                    "take the softmax over the k selected logits only"
                )
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
    cases = [
        ("an evenly routed batch, top-1", even, 1),
        ("a skewed router, top-1", skewed, 1),
        ("a skewed router, top-2", skewed, 2),
        ("random logits, 8 experts, top-2", _logits(32, 8, 4), 2),
    ]
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
            hint = (
                "f_i = share of tokens with expert i among their top k (a count, no gradient), P_i = mean "
                "softmax probability of expert i; the loss is E · Σ_i f_i · P_i"
            )
        return fail(f"returned {got.reshape(()).item():.4f}, expected {expected.item():.4f}", hint)
    return CheckReport(name, True, len(cases))


def check_expert_capacity(fn) -> CheckReport:
    """fn(num_tokens, num_experts, top_k, capacity_factor) -> ceil(C · N · k / E) as an int."""
    name = "Exercise 7.3 (expert capacity)"
    cases = [
        ("4096 tokens, 8 experts, top-2, C = 1.0", (4096, 8, 2, 1.0)),
        ("C = 1.25", (4096, 8, 2, 1.25)),
        ("a fraction to round up: 10 tokens, 3 experts, top-1", (10, 3, 1, 1.0)),
        ("top-2 on a fraction: 10 tokens, 3 experts, top-2", (10, 3, 2, 1.0)),
        ("C = 2.0, top-1, 64 experts", (1000, 64, 1, 2.0)),
        ("C = 1.1, exactly 11 slots: 100 tokens, 10 experts, top-1", (100, 10, 1, 1.1)),
    ]
    for case, args in cases:
        got, report = call_learner(name, fn, args, case, len(cases))
        if report is not None:
            return report
        expected = expert_capacity(*args)
        if isinstance(got, bool) or not isinstance(got, int):
            return CheckReport(
                name,
                False,
                len(cases),
                case,
                f"returned {type(got).__name__}, expected an int",
                "a capacity counts token slots: return an int (math.ceil gives one)",
            )
        if got != expected:
            N, E, k, C = args
            if got == int(C * N * k / E):
                hint = "round up, not down: a fraction of a slot still needs the slot (math.ceil)"
            elif got == math.ceil(C * N * k / E):
                hint = (
                    f"float rounding: {C} is not exactly {C} in binary, so {C} · {N} · {k} / {E} comes out as "
                    f"{C * N * k / E!r} and rounds up one slot too many; keep the decimal value, "
                    "e.g. fractions.Fraction(str(capacity_factor))"
                )
            elif got == math.ceil(C * N / E) * k:
                hint = "multiply by k before rounding up: ceil(C · N · k / E), not ceil(C · N / E) · k"
            elif got * k == expected or got == expected * k:
                hint = "every token makes k assignments: capacity = ceil(C · N · k / E)"
            else:
                hint = "capacity = ceil(capacity_factor · num_tokens · top_k / num_experts)"
            return CheckReport(name, False, len(cases), case, f"returned {got}, expected {expected}", hint)
    return CheckReport(name, True, len(cases))


def check_router_z_loss(fn) -> CheckReport:
    """fn(router_logits (N, E)) -> the mean over tokens of logsumexp(logits)² as a 0-dim tensor."""
    name = "Exercise 7.4 (the router z-loss)"
    cases = [
        ("random logits, 16 tokens, 8 experts", _logits(16, 8, 5)),
        ("one token, two experts", torch.tensor([[0.5, -1.0]])),
        ("negative logits: each token's log-sum-exp is below 0", _logits(10, 4, 6) - 6.0),
        ("logits near 100: exp() overflows float32 (its largest value is about e^88)", _logits(5, 4, 7) + 100.0),
    ]
    for case, logits in cases:
        got, report = call_learner(name, fn, (logits.clone(),), case, len(cases))
        if report is not None:
            return report
        expected = router_z_loss(logits)

        def fail(problem, hint=None, case=case):
            return CheckReport(name, False, len(cases), case, problem, hint)

        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            hint = (
                "average over the tokens: one number for the batch"
                if isinstance(got, torch.Tensor)
                else "return the tensor itself, not .item() or float(): the loss must stay in the autograd graph"
            )
            return fail(f"returned {shape}, expected a one-number tensor", hint)
        got = got.reshape(())
        # fp32: a mean of N <= 16 squares, any order: ~1e-7 relative, also for values near 100² = 1e4
        if torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            continue
        lse = torch.logsumexp(logits, dim=-1)
        near = lambda x: bool(torch.allclose(got, x, rtol=1e-4, atol=1e-5))  # noqa: E731
        if not bool(torch.isfinite(got)):
            hint = (
                "exp(100) overflows float32 to inf: use torch.logsumexp(logits, dim=-1), which subtracts each "
                "row's maximum before exp"
            )
        elif near(lse.mean()):
            hint = "square each token's log-sum-exp before averaging"
        elif near(lse.pow(2).sum()):
            hint = "average over the tokens (mean), not sum: the loss must not grow with the batch size"
        elif near(logits.amax(-1).pow(2).mean()):
            hint = "the log-sum-exp log Σ exp(x_i), not the largest logit: torch.logsumexp(logits, dim=-1)"
        elif near(torch.logsumexp(torch.softmax(logits, -1), -1).pow(2).mean()):
            hint = (
                "the z-loss acts on the raw logits, not on softmax probabilities (which stay in [0, 1] "
                "however large the logits grow)"
            )
        elif near(torch.logsumexp(logits, dim=0).pow(2).mean()):
            hint = "the log-sum-exp runs over each token's E expert logits (dim=-1), not over the tokens"
        elif near(logits.pow(2).mean()):
            hint = "that squares each logit: square each token's log-sum-exp, log Σ_i exp(x_i), then average"
        else:
            hint = "z-loss = mean over tokens of (log Σ_i exp(x_i))², the sum over a token's E logits"
        return fail(f"returned {got.item():.6g}, expected {expected.item():.6g}", hint)
    return CheckReport(name, True, len(cases))
