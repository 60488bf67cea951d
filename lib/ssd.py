"""The selective SSM as a masked attention: the recurrence unrolled into one matrix (lesson 06).

Unroll h_t = Ā_t ⊙ h_{t−1} + B̄_t x_t from a zero state and read y_t = C_t · h_t. With
Ā_t = exp(Δ_t A), B̄_t = Δ_t B_t (`lib.scan.discretize`) and S_t = Δ_0 + ... + Δ_t per channel d:

    y_t = Σ_{s<=t} W_ts x_s,   W_ts = Σ_n C_t[n] · exp(A[n] · (S_t − S_s)) · B_s[n] · Δ_s

one lower-triangular (L, L) matrix per channel, applied to the inputs as attention's weights are
applied to its values. C plays the query, B the key, Δ·x the value, and in place of
softmax(QKᵀ/√d + M) there is exp(M) ∘ C Bᵀ, no softmax, with the additive mask

    M_ts = A · (S_t − S_s) for s <= t,   −∞ for s > t        (exp(−∞) = 0)

lesson 01's causal mask with a decay written under its diagonal: how much of x_s is left at t.
This is the structured masked attention of Mamba-2 (Dao & Gu 2024, "Transformers are SSMs:
Generalized Models and Efficient Algorithms Through Structured State Space Duality", §3-5).
Mamba-2 ties A to one scalar per head, so the mask is the same for every state entry and the
matrix is L ∘ (C Bᵀ), computed with matrix products; Mamba-1's A (D, N), used here, gives each
state entry its own decay, so W sums N such masked products. Either way W is L × L: O(L²) work
and memory, as attention's, where the scan (`lib.scan`) does O(L). The course builds W to show
that the two are one computation, and scans to compute.

    decay_mask                 M (B, D, N, L, L): the additive log-decay mask, −inf above the diagonal
    ssm_attention_matrix       W (B, D, L, L), so that y[..., d] = W[:, d] @ x[..., d]
    selective_scan_attention   y = W x (+ D ⊙ x): `lib.scan.selective_scan_ref`'s result from a zero state

Glossary as in `lib.scan`: B batch, L length, D channels, N state size per channel.
"""

from __future__ import annotations

import torch

from lib._checks import require_rank, require_tensor
from lib.kernels.runtime import work_dtype
from lib.scan import SCAN_CONTRACT

__all__ = ["decay_mask", "selective_scan_attention", "ssm_attention_matrix"]


def decay_mask(delta: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """M (B, D, N, L, L) with M[b, d, n, t, s] = A[d, n] · (Δ_{s+1} + ... + Δ_t) for s <= t (0 on the
    diagonal: nothing has decayed yet) and −inf for s > t. delta (B, L, D) >= 0, A (D, N) < 0;
    computed in fp32 (fp64 if given fp64). exp(M) is how much of position s's input is left at t."""
    for name, t, layout, rank in (("delta", delta, "(B, L, D)", 3), ("A", A, "(D, N)", 2)):
        require_tensor(name, t, floating=True)
        require_rank(name, t, rank, layout)
    if A.shape[0] != delta.shape[2]:
        raise ValueError(f"A must have shape (D, N) with D = delta.shape[2] = {delta.shape[2]}, got {tuple(A.shape)}")
    wt = work_dtype(delta, A)
    return _decay_mask(delta.to(wt), A.to(wt))


def _decay_mask(delta: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    S = delta.cumsum(1).transpose(1, 2)  # (B, L, D) -> (B, D, L): S_t, the summed step sizes up to t
    gap = S.unsqueeze(-1) - S.unsqueeze(-2)  # (B, D, L, 1) - (B, D, 1, L) -> (B, D, L, L): S_t − S_s
    M = A[None, :, :, None, None] * gap.unsqueeze(2)  # (1, D, N, 1, 1) * (B, D, 1, L, L) -> (B, D, N, L, L)
    L = delta.shape[1]
    above = torch.ones(L, L, dtype=torch.bool, device=delta.device).triu(1)  # s > t: the future
    return M.masked_fill(above, float("-inf"))


def ssm_attention_matrix(delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """W (B, D, L, L): W[b, d, t, s] = Σ_n C_t[n] exp(M[b, d, n, t, s]) B_s[n] · Δ_s[d] (`decay_mask`),
    zero above the diagonal. delta (B, L, D) >= 0; A (D, N) < 0; B, C (B, L, N). Then
    y[b, :, d] = W[b, d] @ x[b, :, d] is the selective scan of x from a zero state, without D."""
    SCAN_CONTRACT.check(delta=delta, A=A, B=B, C=C, delta_bias=None, delta_softplus=False)
    return _attention_matrix(*(t.to(work_dtype(delta, A, B, C)) for t in (delta, A, B, C)))


def _attention_matrix(delta, A, B, C) -> torch.Tensor:
    decay = _decay_mask(delta, A).exp()  # (B, D, N, L, L), 0 above the diagonal
    scores = torch.einsum("btn,bsn,bdnts->bdts", C, B, decay)  # Σ_n C_t[n] B_s[n] decay: (B, D, L, L)
    return scores * delta.transpose(1, 2).unsqueeze(-2)  # · Δ_s: (B, D, L, L) * (B, D, 1, L)


def selective_scan_attention(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """The selective scan as y = W x (+ D ⊙ x), W from `ssm_attention_matrix`: the arguments and the
    result of `lib.scan.selective_scan_ref` started from a zero state (up to rounding), in x's
    dtype, computed in fp32 (fp64 if given fp64). O(L²) time and memory: for showing, not for speed."""
    SCAN_CONTRACT.check(x=x, delta=delta, A=A, B=B, C=C, D=D, delta_bias=None, delta_softplus=False)
    wt = work_dtype(x, delta, A, B, C, D)
    W = _attention_matrix(*(t.to(wt) for t in (delta, A, B, C)))  # (B, D, L, L)
    y = torch.einsum("bdts,bsd->btd", W, x.to(wt))  # (B, D, L, L) @ (B, L, D) -> (B, L, D)
    if D is not None:
        y = y + x.to(wt) * D.to(wt)
    return y.to(x.dtype)
