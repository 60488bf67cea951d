"""A time-invariant SSM is a convolution: S4's view of the recurrence (lesson 06).

When Ā, B̄ and C do not depend on the input (one Δ per channel, as in S4 and S4D), unrolling
h_t = Ā ⊙ h_{t-1} + B̄ x_t, y_t = C · h_t from h_{-1} = 0 gives

    y_t = Σ_{k<=t} K_k ⊙ x_{t−k},    K_k = Σ_n C_n Ā_n^k B̄_n        (Gu et al. 2021, S4, §3.2)

so the whole sequence is one long causal convolution, computed by FFT in O(L log L) and trained
in parallel. Mamba's selective SSM gives this up: its Ā_t, B̄_t, C_t change with the token, there
is no single kernel K, and the recurrence needs a scan (`lib.scan`). The tests check both forms
against the recurrence (tests/lib/test_scan.py, test_mamba.py).

    lti_kernel        K (D, L) from Ā, B̄ (D, N) and C: the Vandermonde form of S4D
    ssm_convolution   y = K * x (+ D ⊙ x), causal, by FFT

Glossary as in `lib.scan`: B batch, L length, D channels, N state size per channel.
"""

from __future__ import annotations

import torch

from lib._checks import require_int, require_rank, require_tensor
from lib.kernels.runtime import work_dtype

__all__ = ["lti_kernel", "ssm_convolution"]


def lti_kernel(A_bar: torch.Tensor, B_bar: torch.Tensor, C: torch.Tensor, L: int) -> torch.Tensor:
    """The convolution kernel of a time-invariant diagonal SSM: K_k = Σ_n C_n Ā_n^k B̄_n, k < L.

    A_bar, B_bar (D, N) (fixed over time: one Δ per channel); C (N,) or (D, N) -> K (D, L). Then
    y = K * x (`ssm_convolution`) equals the recurrence h_t = Ā ⊙ h_{t-1} + B̄ x_t, y_t = C · h_t
    started from zero (S4, Gu et al. 2021, §3.2; the Vandermonde form of S4D).
    """
    for name, t in (("A_bar", A_bar), ("B_bar", B_bar), ("C", C)):
        require_tensor(name, t, floating=True)
    require_rank("A_bar", A_bar, 2, "(D, N)")
    require_int("L", L, minimum=1)
    if tuple(B_bar.shape) != tuple(A_bar.shape):
        raise ValueError(f"B_bar must have shape (D, N) = {tuple(A_bar.shape)} like A_bar, got {tuple(B_bar.shape)}")
    if tuple(C.shape) not in ((A_bar.shape[1],), tuple(A_bar.shape)):
        raise ValueError(
            f"C must have shape (N,) = ({A_bar.shape[1]},) or (D, N) = {tuple(A_bar.shape)}, got {tuple(C.shape)}"
        )
    k = torch.arange(L, device=A_bar.device, dtype=A_bar.dtype)  # (L,)
    powers = A_bar.unsqueeze(-1) ** k  # (D, N, 1) ** (L,) -> (D, N, L): Ā^k, a Vandermonde matrix per channel
    return torch.einsum("dnl,dn->dl", powers, C * B_bar)  # (D, N, L) · (D, N) -> (D, L)


def ssm_convolution(x: torch.Tensor, K: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise convolution y_t = Σ_{k<=t} K_k ⊙ x_{t−k} (+ D ⊙ x_t), by FFT (as S4).

    x (B, L, D); K (D, L_K) with L_K >= L (`lti_kernel`); D (D,) or None -> y (B, L, D). Both
    signals are zero-padded to 2L so the FFT's circular convolution does not wrap around.
    """
    require_tensor("x", x, floating=True)
    require_tensor("K", K, floating=True)
    require_rank("x", x, 3, "(B, L, D)")
    require_rank("K", K, 2, "(D, L_K)")
    b, l, d = x.shape
    if K.shape[0] != d or K.shape[1] < l:
        raise ValueError(f"K must have shape (D, L_K) with D = {d} and L_K >= L = {l}, got {tuple(K.shape)}")
    if D is not None:
        require_tensor("D", D, floating=True)
        if tuple(D.shape) != (d,):
            raise ValueError(f"D must have shape (D,) = ({d},), got {tuple(D.shape)}")
    wt = work_dtype(x, K)
    xf = torch.fft.rfft(x.to(wt).transpose(1, 2), n=2 * l)  # (B, D, L) -> (B, D, L + 1) complex
    kf = torch.fft.rfft(K[:, :l].to(wt), n=2 * l)  # (D, L) -> (D, L + 1)
    y = torch.fft.irfft(xf * kf, n=2 * l)[..., :l].transpose(1, 2)  # (B, D, 2L) -> (B, L, D)
    if D is not None:
        y = y + x.to(wt) * D.to(wt)
    return y.to(x.dtype)
