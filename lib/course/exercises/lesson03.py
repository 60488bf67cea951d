"""Checks for lesson 03, "GPT".

check_clm_loss(fn)       fn(logits (B, T, V), idx (B, T)) -> scalar next-token loss, equal to
                         lib.train.clm_loss
check_top_p_filter(fn)   fn(logits (B, V), p) -> logits with the tokens outside the nucleus
                         set to -inf, equal to lib.sampling.top_p_filter
check_rope(fn)           fn(x (B, H, T, D), positions (T,)) -> x rotated by RoPE (rotate-half
                         pairing, base 10000), equal to lib.rope.apply_rope_ref
check_repetition_penalty(fn)
                         fn(logits (B, V), input_ids (B, T), penalty) -> (B, V): CTRL's penalty on
                         every token already in row b's context (Keskar et al. 2019, §4.1)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lib.course.exercises import Case, CheckReport, call_learner, run_checks
from lib.rope import apply_rope_ref
from lib.sampling import top_p_filter
from lib.train import clm_loss

__all__ = ["check_clm_loss", "check_repetition_penalty", "check_rope", "check_top_p_filter"]


def _loss_cases() -> list[Case]:
    g = torch.Generator().manual_seed(0)
    cases = []
    for name, (B, T, V) in [
        ("two tokens, the shortest sequence with a next token", (1, 2, 5)),
        ("a batch of 3 sequences of 9 tokens", (3, 9, 11)),
        ("a larger vocabulary", (2, 6, 50)),
    ]:
        logits = 3 * torch.randn(B, T, V, generator=g)
        idx = torch.randint(V, (B, T), generator=g)
        V_ = V

        def diagnose(got, logits=logits, idx=idx, V=V_):
            unshifted = F.cross_entropy(logits.reshape(-1, V), idx.reshape(-1))
            backwards = F.cross_entropy(logits[:, 1:].reshape(-1, V), idx[:, :-1].reshape(-1))
            if torch.allclose(got, unshifted, atol=1e-5):
                return "no shift: position t must predict token t + 1, so compare logits[:, :-1] with idx[:, 1:]"
            if torch.allclose(got, backwards, atol=1e-5):
                return "shifted the wrong way: the logits at position t predict idx[:, t + 1], not idx[:, t - 1]"
            if torch.allclose(got, clm_loss(logits, idx) * (idx.shape[1] - 1) * idx.shape[0], rtol=1e-4):
                return "that is the sum: average over the B * (T - 1) predictions (cross_entropy's default)"
            return None

        cases.append(Case(name, (logits, idx), clm_loss(logits, idx), atol=1e-5, rtol=1e-5, diagnose=diagnose))
    return cases


def check_clm_loss(fn) -> CheckReport:
    """fn(logits (B, T, V), idx (B, T)) must return the mean next-token cross-entropy (a 0-dim tensor)."""
    return run_checks("Exercise 3.1 (the shifted next-token loss)", fn, _loss_cases())


def _diagnose_top_p(logits: torch.Tensor, p: float):
    def diagnose(got: torch.Tensor) -> str | None:
        expected = top_p_filter(logits, p)
        kept_got, kept_exp = torch.isfinite(got), torch.isfinite(expected)
        if torch.equal(kept_got, kept_exp) and not torch.equal(got[kept_got], logits[kept_exp]):
            return "return the logits themselves where kept (not probabilities, not renormalised)"
        if bool((kept_got.sum(-1) < kept_exp.sum(-1)).any()):
            return (
                "kept too few: include the token that makes the running total reach p "
                "(keep a token if the mass strictly before it is < p)"
            )
        if bool((kept_got.sum(-1) > kept_exp.sum(-1)).any()):
            return "kept too many: stop once the most probable tokens hold p of the mass"
        if not torch.equal(kept_got, kept_exp):
            return "right number of tokens, wrong ones: sort by probability, descending, per row"
        return None

    return diagnose


def check_top_p_filter(fn) -> CheckReport:
    """fn(logits (B, V), p) must return logits with every token outside the nucleus set to -inf."""
    g = torch.Generator().manual_seed(1)
    peaked = torch.tensor([[8.0, 1.0, 0.5, 0.0, -1.0]])
    flat = torch.zeros(1, 6) + torch.arange(6) * 1e-3  # almost uniform, no ties
    rows = 2 * torch.randn(4, 17, generator=g)
    cases = []
    for name, logits, p in [
        ("one dominant token, p = 0.9: only it survives", peaked, 0.9),
        ("a nearly flat distribution, p = 0.5: half the tokens", flat, 0.5),
        ("four random rows, p = 0.75", rows, 0.75),
        ("negative logits, p = 0.3", rows - 10.0, 0.3),
        ("p = 1 keeps every token", rows, 1.0),
    ]:
        cases.append(
            Case(
                name,
                (logits.clone(), p),
                top_p_filter(logits, p),
                exact=False,
                atol=0.0,
                rtol=0.0,
                diagnose=_diagnose_top_p(logits, p),
            )
        )
    return run_checks("Exercise 3.2 (top-p filtering)", fn, cases)


def _diagnose_rope(x: torch.Tensor, positions: torch.Tensor):
    def diagnose(got: torch.Tensor) -> str | None:
        D = x.shape[-1]
        if torch.allclose(got, x, atol=1e-5):
            return "the output equals the input: rotate each pair by the angle position * theta_i"
        theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        angles = positions.double()[:, None] * theta[None, :]  # (T, D/2)
        wrong = angles.repeat_interleave(2, dim=-1)  # neighbours share an angle: the interleaved layout
        x1, x2 = x[..., : D // 2].double(), x[..., D // 2 :].double()
        rotated_half = torch.cat([-x2, x1], dim=-1)
        if torch.allclose(got.double(), x.double() * wrong.cos() + rotated_half * wrong.sin(), atol=1e-4):
            return "angle table repeat-interleaved: channel i pairs with i + D/2, so concatenate the table with itself"
        if (got.double().norm(dim=-1) - x.double().norm(dim=-1)).abs().max() > 1e-3:
            return "a rotation keeps every vector's length; yours changes it (sin and cos swapped, or a sign?)"
        return None

    return diagnose


def check_rope(fn) -> CheckReport:
    """fn(x (B, H, T, D), positions (T,)) must rotate channel pairs (i, i + D/2) by positions * theta_i."""
    g = torch.Generator().manual_seed(2)
    cases = []
    for name, shape, positions in [
        ("a single position 0 (rotation by nothing)", (1, 1, 1, 4), torch.tensor([0])),
        ("positions 0..4, D = 8", (1, 2, 5, 8), torch.arange(5)),
        ("positions 100..106 (a decode step far into a sequence)", (2, 2, 7, 16), torch.arange(100, 107)),
    ]:
        x = torch.randn(*shape, generator=g)
        # fp32 input, float64 reference: the rotation's rounding is ~1e-6 at these angles
        cases.append(
            Case(
                name,
                (x.clone(), positions),
                apply_rope_ref(x, positions),
                atol=1e-5,
                rtol=1e-5,
                diagnose=_diagnose_rope(x, positions),
            )
        )
    return run_checks("Exercise 3.3 (a RoPE rotation)", fn, cases)


# --------------------------------------------------------------------------- 3.4 repetition penalty
def _penalised(logits: torch.Tensor, seen: torch.Tensor, factor) -> torch.Tensor:
    """Positive logits divided by `factor`, negative ones multiplied, where `seen`."""
    return torch.where(seen, torch.where(logits > 0, logits / factor, logits * factor), logits)


def repetition_penalty_ref(logits: torch.Tensor, input_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty, as Hugging Face's RepetitionPenaltyLogitsProcessor applies it:
    each token present in row b's context, once however often it appears, has its logit divided
    by `penalty` if positive and multiplied by it if negative (both make it less likely)."""
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, input_ids, True)  # (B, V)
    return _penalised(logits, seen, penalty)


def _diagnose_penalty(logits: torch.Tensor, ids: torch.Tensor, penalty: float):
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
    counts = torch.zeros_like(logits).scatter_add_(1, ids, torch.ones(ids.shape))
    anywhere = torch.zeros_like(seen)
    anywhere[:, ids.unique()] = True  # every row's context pooled

    def diagnose(got: torch.Tensor) -> str | None:
        near = lambda x: bool(torch.allclose(got, x, rtol=1e-5, atol=1e-6))  # noqa: E731
        if near(torch.where(seen, logits / penalty, logits)):
            return (
                "a negative logit divided by the penalty moves toward 0, which makes the token MORE likely: "
                "divide positive logits by the penalty and multiply negative ones"
            )
        if near(torch.where(seen, torch.where(logits > 0, logits * penalty, logits / penalty), logits)):
            return "backwards: the penalty must lower a repeated token's logit (positive: divide, negative: multiply)"
        if near(_penalised(logits, seen, penalty**counts)):
            return "penalise each token once, however many times it appears in the context"
        if near(_penalised(logits, anywhere, penalty)):
            return "each row has its own context: in row b penalise only the tokens of input_ids[b]"
        if near(_penalised(logits, torch.ones_like(seen), penalty)):
            return "only the tokens that appear in input_ids are penalised, not the whole vocabulary"
        return None

    return diagnose


def check_repetition_penalty(fn) -> CheckReport:
    """fn(logits (B, V), input_ids (B, T), penalty) must return a new (B, V) tensor: logits of tokens
    in each row's context divided by penalty when positive, multiplied by it when negative."""
    name = "Exercise 3.4 (a repetition penalty)"
    g = torch.Generator().manual_seed(3)
    mixed = 2 * torch.randn(2, 12, generator=g)
    mixed[:, 5] = 0.0  # a zero logit stays zero
    cases = []
    for case, logits, ids, penalty in [
        ("one row, a context of one token", torch.tensor([[2.0, -1.0, 0.5, 3.0]]), torch.tensor([[3]]), 1.5),
        ("negative logits in the context", torch.tensor([[1.0, -2.0, 0.5, -0.5, 3.0]]), torch.tensor([[1, 3, 4]]), 1.2),
        (
            "a token repeated three times in the context",
            torch.tensor([[4.0, -3.0, 1.0, 2.0, -1.0]]),
            torch.tensor([[1, 1, 1, 0]]),
            2.0,
        ),
        ("two rows with different contexts, a zero logit", mixed, torch.tensor([[0, 5, 7, 2], [9, 9, 3, 11]]), 1.3),
    ]:
        # fp32: logits / penalty and logits * (1 / penalty) differ by at most one rounding (~1e-7 relative)
        cases.append(
            Case(
                case,
                (logits, ids, penalty),
                repetition_penalty_ref(logits, ids, penalty),
                atol=1e-6,
                rtol=1e-6,
                diagnose=_diagnose_penalty(logits, ids, penalty),
            )
        )
    if not callable(fn):
        return call_learner(name, fn, (), "", len(cases) + 1)[1]
    modified = []

    def learner(logits, ids, penalty):
        before = logits.clone()
        out = fn(logits, ids, penalty)
        if not torch.equal(logits, before):
            modified.append(True)
        return out

    report = run_checks(name, learner, cases)
    if not report.passed:
        return report
    if modified:
        return CheckReport(
            name,
            False,
            len(cases),
            None,
            "the logits passed in were modified",
            "work on a copy (out = logits.clone(), or torch.where): the caller may still need them",
        )
    return CheckReport(name, True, len(cases))
