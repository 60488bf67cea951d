"""Checks for lesson 01, "One equation, one mask".

check_causal_mask(fn)      fn(T) -> (T, T) additive causal mask, equal to lib.masks.causal_mask
check_masked_attention(fn) fn(q, k, v, mask) -> softmax(QKᵀ/√D + M)V, equal to
                           lib.attention.attention_ref, zeros for rows with no visible key
check_cross_attention_mask(fn)
                           fn(encoder_attention_mask (B, S), tgt_len) -> (B, 1, T, S) additive
                           mask, equal to lib.masks.cross_attention_mask
"""

from __future__ import annotations

import math

import torch

from lib.attention import attention_ref
from lib.course.exercises import Case, CheckReport, run_checks
from lib.masks import causal_mask, combine_masks, cross_attention_mask, padding_mask

__all__ = ["check_causal_mask", "check_cross_attention_mask", "check_masked_attention"]

NEG_INF = float("-inf")


def _diagnose_causal(T: int):
    def diagnose(got: torch.Tensor) -> str | None:
        if got.dtype == torch.bool:
            return "return an additive float mask (0 = may look, -inf = may not), not True/False"
        if not got.is_floating_point():
            return "the mask must be a floating tensor so that it can hold -inf"
        if torch.equal(got, causal_mask(T).T):
            return "you blocked the past instead of the future: row i is the query, column j the key; block j > i"
        if torch.equal(got, torch.full((T, T), NEG_INF).triu(diagonal=0)):
            return "the diagonal is -inf, so a token cannot see itself: use triu(diagonal=1)"
        finite = got[torch.isfinite(got)]
        if finite.numel() and bool((finite != 0).any()):
            return "allowed entries must be exactly 0 and blocked ones exactly -inf (float('-inf'), not -1e9)"
        return None

    return diagnose


def check_causal_mask(fn) -> CheckReport:
    """fn(T) must return the (T, T) float32 mask with -inf strictly above the diagonal."""
    cases = [Case(f"T={T}", (T,), causal_mask(T), exact=True, diagnose=_diagnose_causal(T)) for T in (1, 2, 5, 8)]
    return run_checks("Exercise 1.1 (causal mask)", fn, cases)


def _qkv(seed: int, B: int, H: int, T: int, D: int, score_scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g) * score_scale
    k = torch.randn(B, H, T, D, generator=g)
    v = torch.randn(B, H, T, D, generator=g)
    return q, k, v


def _diagnose_attention(q, k, v, mask):
    D = q.shape[-1]

    def variant(scale: float = 1 / math.sqrt(D), dim: int = -1, use_mask: bool = True) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) * scale + (mask if use_mask else 0)
        return torch.softmax(scores, dim=dim).nan_to_num(0.0) @ v

    def diagnose(got: torch.Tensor) -> str | None:
        near = lambda x: got.shape == x.shape and bool(torch.allclose(got.nan_to_num(0.0), x, atol=1e-4))  # noqa: E731
        if near(variant(scale=1.0)):
            return "the scores were not scaled: divide QKᵀ by √D (D = q.shape[-1])"
        if near(variant(dim=-2)):
            return "softmax ran over the queries: normalise over the keys, the last dimension (dim=-1)"
        if near(variant(use_mask=False)):
            return "the mask was not applied: add M to the scores before the softmax"
        return None

    return diagnose


def check_masked_attention(fn) -> CheckReport:
    """fn(q, k, v, mask) with q, k, v (B, H, T, D) and an additive mask broadcastable to
    (B, H, T, T) must equal lib.attention.attention_ref, with all-zero rows where every key is
    masked."""
    cases = []
    # 1. A single token: the softmax of one score is 1, so the output is v itself.
    q, k, v = _qkv(1, 1, 1, 1, 8)
    mask = causal_mask(1)
    cases.append(
        Case("T=1, causal", (q, k, v, mask), attention_ref(q, k, v, mask), diagnose=_diagnose_attention(q, k, v, mask))
    )
    # 2. Plain causal attention with several heads.
    q, k, v = _qkv(2, 2, 3, 6, 8)
    mask = causal_mask(6)
    cases.append(
        Case(
            "B=2, H=3, T=6, causal",
            (q, k, v, mask),
            attention_ref(q, k, v, mask),
            diagnose=_diagnose_attention(q, k, v, mask),
        )
    )
    # 3. Padding on both sides plus causal: the first query's only key is padding.
    q, k, v = _qkv(3, 2, 2, 7, 8)
    keep = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]])
    mask = combine_masks(causal_mask(7), padding_mask(keep))  # (2, 1, 7, 7)
    cases.append(
        Case(
            "padding on both sides + causal (a query with no visible key)",
            (q, k, v, mask),
            attention_ref(q, k, v, mask),
            diagnose=_diagnose_attention(q, k, v, mask),
        )
    )
    # 4. Very negative, very spread scores: exp() underflows unless the row max is subtracted.
    q, k, v = _qkv(4, 1, 2, 5, 16, score_scale=-400.0)
    mask = causal_mask(5)
    cases.append(
        Case(
            "large negative scores (|QKᵀ/√D| in the hundreds)",
            (q, k, v, mask),
            attention_ref(q, k, v, mask),
            diagnose=_diagnose_attention(q, k, v, mask),
        )
    )

    def nan_hint(case: Case) -> str:
        mask = case.args[3]
        if bool(torch.isneginf(mask).all(dim=-1).any()):
            return (
                "NaNs after softmax: did a whole row get -inf? Then softmax computes 0/0. "
                "Rows with no visible key must give zeros (see lib.attention.safe_softmax)"
            )
        return "NaN or inf from exp(): subtract each row's maximum from the scores before exp"

    return run_checks("Exercise 1.2 (masked attention)", fn, cases, nan_hint=nan_hint)


# --------------------------------------------------------------------------- 1.3 cross-attention
def _diagnose_cross(keep: torch.Tensor, T: int):
    B, S = keep.shape
    expected = cross_attention_mask(keep, T)
    blocked = torch.isneginf(expected)  # (B, 1, T, S)
    # the two ways a causal triangle gets added: top-left (triu) and bottom-right (kv_len) aligned
    triangles = [torch.ones(T, S, dtype=torch.bool).triu(diagonal=1)]
    if S >= T:
        triangles.append(torch.isneginf(causal_mask(T, kv_len=S)))

    def diagnose(got: torch.Tensor) -> str | None:
        if got.dtype == torch.bool:
            return "return an additive float mask (0 = may look, -inf = may not), not True/False"
        if not got.is_floating_point():
            return "the mask must be a floating tensor so that it can hold -inf"
        if got.shape == (B, 1, 1, S):
            return (
                "that is BERT's padding mask, one row shared by all queries: give each of the T decoder "
                "queries its own row, (B, 1, 1, S) -> (B, 1, T, S), e.g. with .expand(-1, -1, tgt_len, -1)"
            )
        if got.shape == (T, S):
            return "each sequence has its own source padding: keep the batch dimension, (B, 1, T, S)"
        if got.shape != expected.shape:
            return None
        got_blocked = torch.isneginf(got)
        if any(torch.equal(got_blocked, blocked | tri) for tri in triangles):
            return (
                "that adds a causal triangle: cross-attention has none, since the whole source is known before "
                "decoding starts; block only the encoder's padding columns"
            )
        if torch.equal(got_blocked, ~blocked):
            return "inverted: 1 marks a real source token (0 in the mask), 0 marks padding (-inf)"
        if S == T and torch.equal(got_blocked, (keep == 0)[:, None, :, None].expand(B, 1, T, S)):
            return (
                "that masks query rows: padding in the source must block keys, the columns "
                "(the last dimension), whatever the decoder's row"
            )
        finite = got[torch.isfinite(got)]
        if finite.numel() and bool((finite != 0).any()):
            return "allowed entries must be exactly 0 and blocked ones exactly -inf (float('-inf'), not -1e9)"
        return None

    return diagnose


def check_cross_attention_mask(fn) -> CheckReport:
    """fn(encoder_attention_mask (B, S) of 1/0, tgt_len T) must return lib.masks.cross_attention_mask's
    (B, 1, T, S) float32 mask: -inf in the columns of the source's padding, for every query row."""
    cases = []
    for name, keep, T in [
        ("T = S = 5, source padding on both sides", torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]]), 5),
        ("one target token (T = 1), S = 4, right padding", torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), 1),
        ("a target longer than the source: T = 7, S = 3", torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1]]), 7),
        ("T = 3, S = 6, left padding", torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]), 3),
    ]:
        cases.append(
            Case(name, (keep, T), cross_attention_mask(keep, T), exact=True, diagnose=_diagnose_cross(keep, T))
        )
    return run_checks("Exercise 1.3 (the cross-attention mask)", fn, cases)
