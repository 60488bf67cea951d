"""Checks for lesson 06, "Mamba".

check_discretize(fn)     fn(delta (..., D), A (D, N), B (..., N)) -> (A_bar, B_bar) (..., D, N),
                         equal to lib.scan.discretize
check_ssm_step(fn)       fn(h (B, D, N), x (B, D), delta (B, D), A (D, N), B (B, N), C (B, N))
                         -> (y (B, D), h_next (B, D, N)): one step of the selective recurrence
check_scan_combine(fn)   fn((a1, b1), (a2, b2)) -> (a, b): "do left, then right" as one step,
                         equal to lib.scan_parallel.scan_combine
check_causal_conv1d(fn)  fn(x (B, T, E), weight (E, K), bias (E,)) -> (B, T, E): the mixer's short
                         causal depthwise convolution, equal to lib.conv.causal_conv1d_ref
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lib.conv import causal_conv1d_ref
from lib.course.exercises import Case, CheckReport, call_learner, run_checks
from lib.scan import discretize, selective_scan_ref
from lib.scan_parallel import scan_combine

__all__ = ["check_causal_conv1d", "check_discretize", "check_scan_combine", "check_ssm_step"]

# fp32, a handful of terms: any correct order of operations agrees to ~1e-7
_TOL = dict(rtol=1e-5, atol=1e-6)


def _pair_report(name, n, case, got, expected, names, hints, order=(0, 1)) -> CheckReport | None:
    """Compare a returned pair with the expected one (entries in `order`); None when they match."""
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return CheckReport(
            name,
            False,
            n,
            case,
            f"returned {type(got).__name__}, expected a tuple {names}",
            "return both, e.g. `return A_bar, B_bar`",
        )
    for i in order:
        if got[i].shape != expected[i].shape:
            return CheckReport(
                name,
                False,
                n,
                case,
                f"{names[i]} has shape {tuple(got[i].shape)}, expected {tuple(expected[i].shape)}",
                hints.get(f"shape{i}"),
            )
        if not torch.allclose(got[i], expected[i], **_TOL):
            hint = next((h for test, h in hints.get(i, []) if test(got[i])), hints.get(f"default{i}"))
            return CheckReport(name, False, n, case, f"wrong {names[i]}", hint)
    return None


def check_discretize(fn) -> CheckReport:
    """fn(delta, A, B) -> (A_bar, B_bar): Ā = exp(Δ·A), B̄ = Δ·B, broadcast to (..., D, N)."""
    name = "Exercise 6.1 (discretisation)"
    g = torch.Generator().manual_seed(0)
    A = -torch.rand(3, 4, generator=g) * 4 - 0.5  # (D, N) negative
    cases = [
        (
            "fixed Δ, B (the LTI case): delta (D,), B (N,)",
            (torch.rand(3, generator=g) + 0.1, A, torch.randn(4, generator=g)),
        ),
        (
            "selective: delta (B, L, D), B (B, L, N)",
            (torch.rand(2, 5, 3, generator=g) + 0.1, A, torch.randn(2, 5, 4, generator=g)),
        ),
    ]
    for case, (delta, A_, B) in cases:
        got, report = call_learner(name, fn, (delta, A_, B), case, len(cases))
        if report is not None:
            return report
        expected = discretize(delta, A_, B)
        dA = delta.unsqueeze(-1) * A_
        hints = {
            "shape0": "Ā has one entry per channel d and state n: delta[..., :, None] * A gives (..., D, N)",
            "shape1": "B̄ = delta[..., :, None] * B[..., None, :], shape (..., D, N)",
            0: [
                (
                    lambda t: torch.allclose(t, 1 + dA, **_TOL),
                    "that is 1 + ΔA, the first-order Euler step: the zero-order hold gives exp(ΔA)",
                ),
                (lambda t: torch.allclose(t, torch.exp(A_).expand_as(t), **_TOL), "scale A by Δ before exp"),
            ],
            "default0": "Ā = exp(Δ·A), entry by entry: torch.exp(delta[..., :, None] * A)",
            "default1": "B̄ = Δ·B: delta[..., :, None] * B[..., None, :]",
        }
        report = _pair_report(name, len(cases), case, got, expected, ("A_bar", "B_bar"), hints)
        if report is not None:
            return report
    return CheckReport(name, True, len(cases))


def check_ssm_step(fn) -> CheckReport:
    """fn(h, x, delta, A, B, C) -> (y, h_next): h_next = exp(ΔA) ⊙ h + (Δx) ⊗ B, y = h_next · C."""
    name = "Exercise 6.2 (one step of the recurrence)"
    g = torch.Generator().manual_seed(1)
    Bsz, D, N = 2, 3, 4
    A = -torch.rand(D, N, generator=g) * 3 - 0.5
    cases = []
    for case, h_scale in (("from a zero state", 0.0), ("from a non-zero state, negative inputs", 1.0)):
        h = torch.randn(Bsz, D, N, generator=g) * h_scale
        x, delta = torch.randn(Bsz, D, generator=g) - 0.5, torch.rand(Bsz, D, generator=g) + 0.05
        Bm, C = torch.randn(Bsz, N, generator=g), torch.randn(Bsz, N, generator=g)
        cases.append((case, (h, x, delta, A, Bm, C)))
    for case, (h, x, delta, A_, Bm, C) in cases:
        got, report = call_learner(name, fn, (h.clone(), x, delta, A_, Bm, C), case, len(cases))
        if report is not None:
            return report
        y, h_next = selective_scan_ref(
            x.unsqueeze(1), delta.unsqueeze(1), A_, Bm.unsqueeze(1), C.unsqueeze(1), h0=h, return_state=True
        )
        expected = (y[:, 0], h_next)
        no_delta = torch.exp(delta.unsqueeze(-1) * A_) * h + x.unsqueeze(-1) * Bm.unsqueeze(1)
        hints = {
            "shape0": "y has one value per channel: sum h_next * C[:, None, :] over the state dim (-1)",
            "shape1": "h_next keeps h's shape (B, D, N)",
            1: [
                (lambda t: torch.allclose(t, no_delta, **_TOL), "the input enters as B̄x = (Δ·x) ⊗ B: multiply x by Δ"),
                (
                    lambda t: torch.allclose(t, h + (delta * x).unsqueeze(-1) * Bm.unsqueeze(1), **_TOL),
                    "decay the old state first: Ā ⊙ h with Ā = exp(Δ·A)",
                ),
            ],
            "default1": "h_next = exp(delta[..., None] * A) * h + (delta * x)[..., None] * B[:, None, :]",
            0: [
                (
                    lambda t: torch.allclose(t, (h * C.unsqueeze(1)).sum(-1), **_TOL),
                    "read y from the new state h_next, not the old h",
                )
            ],
            "default0": "y = (h_next * C[:, None, :]).sum(-1)",
        }
        report = _pair_report(name, len(cases), case, got, expected, ("y", "h_next"), hints, order=(1, 0))
        if report is not None:
            return report
    return CheckReport(name, True, len(cases))


def check_scan_combine(fn) -> CheckReport:
    """fn((a1, b1), (a2, b2)) -> (a1·a2, a2·b1 + b2)."""
    name = "Exercise 6.3 (the associative combine)"
    g = torch.Generator().manual_seed(2)
    pairs = [(torch.rand(3, 4, generator=g), torch.randn(3, 4, generator=g)) for _ in range(3)]
    cases = [
        ("two steps", (pairs[0], pairs[1])),
        ("the other order (the combine is not commutative)", (pairs[1], pairs[0])),
    ]
    for case, (left, right) in cases:
        got, report = call_learner(name, fn, (left, right), case, len(cases) + 1)
        if report is not None:
            return report
        expected = scan_combine(left, right)
        swapped = left[0] * right[1] + left[1]
        hints = {
            1: [
                (
                    lambda t: torch.allclose(t, swapped, **_TOL),
                    "left happens first: its offset b1 is then decayed by the right step's a2: a2 * b1 + b2",
                )
            ],
            "default1": "apply h -> a1 h + b1, then h -> a2 h + b2: the offset is a2 * b1 + b2",
            "default0": "the decays multiply: a1 * a2",
        }
        report = _pair_report(name, len(cases) + 1, case, got, expected, ("a", "b"), hints)
        if report is not None:
            return report
    # a fold of the learner's combine must reproduce the recurrence from h = 0
    case = "folding three steps equals running them one by one"
    h = torch.zeros(3, 4)
    for a, b in pairs:
        h = a * h + b
    acc, report = pairs[0], None
    for p in pairs[1:]:
        acc, report = call_learner(name, fn, (acc, p), case, len(cases) + 1)
        if report is not None:
            return report
    if not torch.allclose(acc[1], h, **_TOL):
        return CheckReport(name, False, len(cases) + 1, case, "the folded offset is not the final state")
    return CheckReport(name, True, len(cases) + 1)


# --------------------------------------------------------------------------- 6.4 the short convolution
def _conv_padded(x, weight, bias, left: int, right: int):
    """A depthwise conv1d over x (B, T, E) zero-padded by `left` and `right` positions -> (B, T', E)."""
    E, K = weight.shape
    xs = F.pad(x.transpose(1, 2), (left, right))  # (B, E, left + T + right)
    return F.conv1d(xs, weight.unsqueeze(1), bias, groups=E).transpose(1, 2)


def _diagnose_conv(x, weight, bias):
    B, T, E = x.shape
    K = weight.shape[1]

    def diagnose(got: torch.Tensor) -> str | None:
        if got.shape == (B, E, T) and E != T:
            return "conv1d works on (B, E, T): transpose back to (B, T, E)"
        if got.shape == (B, T + K - 1, E):
            return (
                "padding K - 1 on both sides gives T + K - 1 outputs: pad on the left only, or keep the first T outputs"
            )
        if got.shape == (B, T - K + 1, E) or (T < K and got.numel() == 0):
            return "without padding the first K - 1 positions have no output: pad K - 1 zeros on the left"
        if got.shape != (B, T, E):
            return None
        near = lambda y: bool(torch.allclose(got, y, rtol=1e-4, atol=1e-4))  # noqa: E731
        if K > 1 and near(_conv_padded(x, weight.flip(-1), bias, K - 1, 0)):
            return (
                "the weights are reversed: weight[:, K - 1] multiplies the current input x_t and weight[:, 0] "
                "the oldest, x_(t-K+1) (conv1d slides the kernel as it is, it does not flip it)"
            )
        if K > 1 and any(
            near(_conv_padded(x, w, bias, left, K - 1 - left))
            for left in range(K - 1)
            for w in (weight, weight.flip(-1))
        ):
            return (
                "the output at t reads inputs after t, which a decoder has not seen yet: pad K - 1 zeros on the "
                "left only, so that y_t sees x_(t-K+1) .. x_t"
            )
        if near(_conv_padded(x, weight, None, K - 1, 0)):
            return "add each channel's bias"
        return None

    return diagnose


def check_causal_conv1d(fn) -> CheckReport:
    """fn(x (B, T, E), weight (E, K), bias (E,)) -> y (B, T, E), y[b, t, e] = bias[e] +
    sum_j weight[e, j] · x[b, t - K + 1 + j, e], with x = 0 before the first position."""
    g = torch.Generator().manual_seed(3)
    cases = []
    for name, (B, T, E, K) in [
        ("two sequences, T = 6, E = 3 channels, K = 4", (2, 6, 3, 4)),
        ("one token (T = 1), K = 4: only weight[:, 3] meets a real input", (1, 1, 2, 4)),
        ("a sequence shorter than the kernel: T = 3, K = 4", (2, 3, 5, 4)),
        ("K = 3, T = 10, negative inputs", (1, 10, 4, 3)),
    ]:
        x = torch.randn(B, T, E, generator=g) - (0.5 if T == 10 else 0.0)
        weight, bias = torch.randn(E, K, generator=g), torch.randn(E, generator=g)
        # fp32, sums of K <= 4 products of size ~1: any order agrees to ~1e-6
        cases.append(
            Case(
                name,
                (x, weight, bias),
                causal_conv1d_ref(x, weight, bias),
                atol=1e-5,
                rtol=1e-5,
                diagnose=_diagnose_conv(x, weight, bias),
            )
        )
    return run_checks("Exercise 6.4 (the short causal convolution)", fn, cases)
