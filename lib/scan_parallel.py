"""The selective scan parallel over time, in PyTorch: the bodies of `lib.scan`'s "chunked" and
"parallel" scans, and the associative operator that makes a linear recurrence a parallel scan.

A step h -> a ⊙ h + b composes with the next into a step of the same form (`scan_combine`), and
that operator is associative, so the L steps may be grouped in any order (Blelloch 1990; Martin &
Cundy 2018). The two scans here group them in two ways:

    chunked_scan     the blocked scan: every chunk of Lc positions scanned from zero at once, a short
                     loop carrying the state across chunks, every chunk again from its true start
                     (about 2·Lc + L/Lc Python steps; Lc from `default_chunk_size`). The algorithm
                     and why not Mamba-2's quadratic form: `lib.scan.selective_scan`'s docstring
    doubling_scan    Hillis-Steele doubling (1986): log2(L) rounds of `scan_combine` over all
                     positions at once, L·log2(L) combines (teaching)
    step_sizes       Δ = delta (+ delta_bias), through softplus if asked: shared with lib.scan

The bodies take `lib.scan.SCANS`'s signature and trust their callers: the front doors, which
check the arguments, are `lib.scan.selective_scan` and `lib.scan.parallel_scan_ref`.

Glossary as in `lib.scan`: B batch, L sequence length, D channels, N state size per channel, Lc
chunk length; in code the sizes are lower case (b, l, d, n).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lib._checks import require_int, require_tensor
from lib.kernels.runtime import work_dtype

__all__ = ["chunked_scan", "default_chunk_size", "doubling_scan", "scan_combine", "step_sizes"]


def step_sizes(delta: torch.Tensor, delta_bias, delta_softplus: bool) -> torch.Tensor:
    """Δ as the scan uses it: delta (+ delta_bias), through softplus if asked (in delta's dtype)."""
    if delta_bias is not None:
        delta = delta + delta_bias.to(delta.dtype)  # (B, L, D) + (D,)
    return F.softplus(delta) if delta_softplus else delta


def _finish(y: torch.Tensor, x: torch.Tensor, D, h: torch.Tensor, return_state: bool, dtype: torch.dtype, z=None):
    """Add the skip D ⊙ x and apply the gate silu(z) (all in the working dtype), return y in
    `dtype` (x's), h as computed."""
    if D is not None:
        y = y + x * D.to(y.dtype)  # (B, L, D) + (B, L, D) * (D,)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))  # (B, L, D)
    y = y.to(dtype)
    return (y, h) if return_state else y


def scan_combine(
    left: tuple[torch.Tensor, torch.Tensor], right: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The associative operator of the linear recurrence.

    A pair (a, b) stands for the step h -> a ⊙ h + b. Doing `left` then `right` is again such a
    step: (a1, b1) ∘ (a2, b2) = (a1 ⊙ a2, a2 ⊙ b1 + b2). Associativity lets a parallel scan group the
    steps in any order (Blelloch 1990; Martin & Cundy 2018). Tensors broadcast.
    """
    (a1, b1), (a2, b2) = left, right
    for name, t in (("left[0]", a1), ("left[1]", b1), ("right[0]", a2), ("right[1]", b2)):
        require_tensor(name, t, floating=True)
    return a1 * a2, torch.addcmul(b2, a2, b1)


def default_chunk_size(L: int) -> int:
    """The chunk length `selective_scan` uses for a sequence of L positions when none is given.

    The chunked scan takes about 2·Lc + L/Lc Python steps (two passes over the positions of a
    chunk, one over the chunks); their sum is smallest near Lc = sqrt(L/2), rounded here to a
    power of two (32 at L = 2048). `python -m lib.course.bench.ssm` sweeps Lc at L = 2048 and records it in
    benchmarks/ssm_cpu.json; on a 2-core CPU with one thread, Lc = 16, 32 and 64 measured within
    10% of each other, smaller and larger chunks slower.
    """
    require_int("L", L, minimum=1)
    return min(L, max(4, 2 ** math.floor(math.log2(math.sqrt(L / 2)) + 0.5)))  # the nearest power of two


def chunked_scan(
    x, delta, A, B, C, D, h0, return_state, chunk_size=None, *, z=None, delta_bias=None, delta_softplus=False
):
    wt = work_dtype(x, delta, A, B, C, D, h0, z, delta_bias)
    x_, delta, A, B, C = (t.to(wt) for t in (x, delta, A, B, C))
    delta = step_sizes(delta, delta_bias, delta_softplus)  # (B, L, D)
    b, l, d = x_.shape
    n = A.shape[1]
    lc = min(chunk_size or default_chunk_size(l), l)
    nc = -(-l // lc)  # chunks, rounded up
    u = delta * x_  # (B, L, D): Δ_t x_t, the input before B spreads it over the state
    if nc * lc != l:  # pad the time axis; Δ = 0 keeps the state unchanged through the padding
        delta, u, B, C = (F.pad(t, (0, 0, 0, nc * lc - l)) for t in (delta, u, B, C))

    def by_position(t):  # (B, nc·Lc, k) -> (Lc, B, nc, k): one slice per position in a chunk
        return t.view(b, nc, lc, t.shape[-1]).permute(2, 0, 1, 3).contiguous()

    delta_p, u_p, B_p, C_p = map(by_position, (delta, u, B, C))
    # The state is held as (N, D), D innermost: reading y_t = C_t · h_t is then a (1, N) @ (N, D)
    # matmul, several times faster on a CPU than a product and a sum over a short innermost N.
    At = A.t()  # (N, D)
    # Ā_t = exp(Δ_t A), (B, nc, N, D) per position, made inside pass 1 where it is first used: a
    # slice that fits in the CPU's cache is written, exponentiated and read there, instead of one
    # (Lc, B, nc, N, D) tensor streamed through main memory twice first. Pass 3 reads the list.
    deltas = delta_p.unsqueeze(-2).unbind(0)  # Lc x (B, nc, 1, D)
    a = []
    # B̄_t x_t = B_t ⊗ (Δ_t x_t) is formed inside each step from its two small factors, not stored
    # for all positions: the loops are memory-bound, and reading one fewer (B, L, N, D) tensor twice
    # saves more than the step's extra multiply costs.
    Bs, us, c = B_p.unsqueeze(-1).unbind(0), u_p.unsqueeze(-2).unbind(0), C_p.unsqueeze(-2).unbind(0)
    # Lc x (B, nc, N, 1), (B, nc, 1, D), (B, nc, 1, N)

    h = Bs[0] * us[0]  # 1. every chunk's own final state, from zero: (B, nc, N, D)
    a.append((deltas[0] * At).exp_())  # (B, nc, 1, D) * (N, D) -> (B, nc, N, D)
    for t in range(1, lc):
        a.append((deltas[t] * At).exp_())
        h = torch.addcmul(a[t] * h, Bs[t], us[t])  # (B, nc, N, D): Ā_t ⊙ h + B_t ⊗ Δ_t x_t
    chunk_decay = torch.exp(delta_p.sum(0).unsqueeze(-2) * At)  # (B, nc, 1, D) * (N, D) -> (B, nc, N, D), <= 1

    carry = x_.new_zeros(b, n, d) if h0 is None else h0.to(wt).transpose(1, 2)  # 2. the carry: (B, N, D)
    starts = []
    for decay_c, own_c in zip(chunk_decay.unbind(1), h.unbind(1)):
        starts.append(carry)
        carry = torch.addcmul(own_c, decay_c, carry)  # the state leaving chunk c
    h = torch.stack(starts, dim=1)  # (B, nc, N, D): the state entering each chunk

    ys = []  # 3. every chunk from its true start
    for t in range(lc):
        h = torch.addcmul(a[t] * h, Bs[t], us[t])  # (B, nc, N, D)
        ys.append(torch.matmul(c[t], h))  # (B, nc, 1, N) @ (B, nc, N, D) -> (B, nc, 1, D)
    y = torch.cat(ys, dim=2).view(b, nc * lc, d)[:, :l]  # Lc x (B, nc, 1, D) -> (B, nc, Lc, D) -> (B, L, D)
    return _finish(y, x_, D, carry.transpose(1, 2).contiguous(), return_state, x.dtype, z)  # state (B, D, N)


def doubling_scan(x, delta, A, B, C, D, h0, return_state, *, z=None, delta_bias=None, delta_softplus=False):
    wt = work_dtype(x, delta, A, B, C, D, h0, z, delta_bias)
    x_, delta, A, B, C = (t.to(wt) for t in (x, delta, A, B, C))
    delta = step_sizes(delta, delta_bias, delta_softplus)  # (B, L, D)
    l = x_.shape[1]
    a = torch.exp(delta.unsqueeze(-1) * A)  # (B, L, D, N)
    h = (delta * x_).unsqueeze(-1) * B.unsqueeze(2)  # (B, L, D, N): becomes h_t once every step is folded in
    if h0 is not None:  # the state before position 0 enters through the first step's offset
        h = torch.cat([h[:, :1] + a[:, :1] * h0.to(wt).unsqueeze(1), h[:, 1:]], dim=1)
    k = 1
    while k < l:
        a_prev = torch.cat([torch.ones_like(a[:, :k]), a[:, :-k]], dim=1)  # (B, L, D, N): steps ending at t - k
        h_prev = torch.cat([torch.zeros_like(h[:, :k]), h[:, :-k]], dim=1)
        a, h = scan_combine((a_prev, h_prev), (a, h))
        k *= 2
    y = (h * C.unsqueeze(2)).sum(-1)  # (B, L, D, N) · (B, L, 1, N) -> (B, L, D)
    return _finish(y, x_, D, h[:, -1], return_state, x.dtype, z)
