"""The FlashAttention-2 backward in Triton: dQ, dK, dV from dO without the (T, T) matrix.

Follows FlashAttention-2 (Dao 2023, arXiv 2307.08691), Algorithm 2: the forward saved only O and
the log-sum-exp L per query row; the backward recomputes the attention probabilities tile by tile,
P = exp(S - L), first computing delta = rowsum(dO * O) once per row, then dS = P * (dP - delta).
dK, dV and dQ come from two kernels, so that no two programs ever add to the same rows.

    _flash_bwd_preprocess   delta = rowsum(dO * O), the softmax-gradient correction term
    _bwd_tile               one tile: P recomputed from q, k and L; dS = P * (dP - delta)
    _flash_bwd_dkdv_kernel  dK, dV for one key block, looping over the query blocks that see it
    _flash_bwd_dq_kernel    dQ for one query block (a separate kernel: no atomic adds)
    flash_backward          the launcher: (dq, dk, dv) for contiguous (B, H, T, D) tensors

The public door, which checks the arguments and wires this in as the gradient of the forward, is
`lib.kernels.flash.flash_attention`; this module imports nothing from it.

Glossary: B batch, H heads, T sequence length (queries and keys: self-attention only), D head
dim; BLOCK_M queries and BLOCK_N keys per tile. A tile is one (query block, key block) pair.
"""

from __future__ import annotations

import torch

from lib.kernels import runtime
from lib.kernels.runtime import LOG2E, cdiv, dot_launch_opts

triton, tl = runtime.load_triton()  # (None, None) without triton: importing works, launching refuses

__all__ = ["flash_backward"]


# --------------------------------------------------------------------------- kernels
if triton is not None:
    LOG2E_C = tl.constexpr(LOG2E)  # a global a kernel may read must be a constexpr

    @triton.jit
    def _flash_bwd_preprocess(
        O, DO, DELTA, stride_oh, stride_ot, stride_doh, stride_dot, T, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr
    ):
        """delta[i] = sum_d dO[i, d] * O[i, d] = sum_j P[i, j] dP[i, j]; grid (cdiv(T, BLOCK_M), B*H)."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        mask = (offs_m[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
        o = tl.load(O + pid_bh * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :], mask=mask, other=0.0)
        do = tl.load(DO + pid_bh * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :], mask=mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + pid_bh * T + offs_m, delta, mask=offs_m < T)

    @triton.jit
    def _bwd_tile(
        q, k, v, do, lse, delta, offs_m, offs_n, row_ok, T, qk_scale, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr
    ):
        """One tile of the backward, shared by both backward kernels: P recomputed from q, k and the
        saved log-sum-exp (not stored by the forward), and dS = P ∘ (dP − delta), dP = dO Vᵀ."""
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        keep = row_ok[:, None] & (offs_n[None, :] < T)
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        p = tl.exp2(tl.where(keep, s - lse[:, None] * LOG2E_C, float("-inf")))  # (BLOCK_M, BLOCK_N)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        return p, p * (dp - delta[:, None])  # the softmax backward

    @triton.jit
    def _flash_bwd_dkdv_kernel(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DK,
        DV,
        stride_qh,
        stride_qt,
        stride_kh,
        stride_kt,
        stride_vh,
        stride_vt,
        stride_doh,
        stride_dot,
        stride_dkh,
        stride_dkt,
        stride_dvh,
        stride_dvt,
        T,
        sm_scale,
        qk_scale,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Grid (cdiv(T, BLOCK_N), B*H): dV = Pᵀ dO and dK = dSᵀ Q · scale for one key block."""
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        kv_mask = (offs_n[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + pid_bh * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + pid_bh * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

        # Causal: query blocks that end before this key block's first key never see it.
        if CAUSAL:
            m_start = ((pid_n * BLOCK_N) // BLOCK_M) * BLOCK_M
        else:
            m_start = 0
        for start_m in range(m_start, T, BLOCK_M):
            offs_m = start_m + offs_m0
            row_ok = offs_m < T
            q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
            q = tl.load(Q + pid_bh * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(
                DO + pid_bh * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :], mask=q_mask, other=0.0
            )
            lse = tl.load(LSE + pid_bh * T + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + pid_bh * T + offs_m, mask=row_ok, other=0.0)
            p, ds = _bwd_tile(q, k, v, do, lse, delta, offs_m, offs_n, row_ok, T, qk_scale, CAUSAL, DOT_PRECISION)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)  # (BLOCK_N, D)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)  # (BLOCK_N, D)
        dk = dk * sm_scale
        tl.store(
            DK + pid_bh * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :],
            dk.to(DK.dtype.element_ty),
            mask=kv_mask,
        )
        tl.store(
            DV + pid_bh * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :],
            dv.to(DV.dtype.element_ty),
            mask=kv_mask,
        )

    @triton.jit
    def _flash_bwd_dq_kernel(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ,
        stride_qh,
        stride_qt,
        stride_kh,
        stride_kt,
        stride_vh,
        stride_vt,
        stride_doh,
        stride_dot,
        stride_dqh,
        stride_dqt,
        T,
        sm_scale,
        qk_scale,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Grid (cdiv(T, BLOCK_M), B*H): dQ = dS K · scale over the key blocks the forward visited."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < T
        q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + pid_bh * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + pid_bh * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :], mask=q_mask, other=0.0)
        lse = tl.load(LSE + pid_bh * T + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + pid_bh * T + offs_m, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        if CAUSAL:  # same n_end as key_block_bounds()
            n_end = tl.cdiv(tl.minimum((pid_m + 1) * BLOCK_M, T), BLOCK_N)
        else:
            n_end = tl.cdiv(T, BLOCK_N)
        for start_n in range(0, n_end * BLOCK_N, BLOCK_N):
            offs_n = start_n + offs_n0
            kv_mask = (offs_n[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(K + pid_bh * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + pid_bh * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
            _, ds = _bwd_tile(q, k, v, do, lse, delta, offs_m, offs_n, row_ok, T, qk_scale, CAUSAL, DOT_PRECISION)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)  # (BLOCK_M, D)
        dq = dq * sm_scale
        tl.store(
            DQ + pid_bh * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
            dq.to(DQ.dtype.element_ty),
            mask=q_mask,
        )


# --------------------------------------------------------------------------- launchers
def flash_backward(do, q, k, v, o, lse, causal: bool, sm_scale: float, block_m: int, block_n: int):
    """Gradients (dq, dk, dv) of sum(dO * O); every tensor contiguous (B, H, T, D)."""
    B, H, T, D = q.shape
    q3, k3, v3, o3, do3 = (x.view(B * H, T, D) for x in (q, k, v, o, do))  # (B*H, T, D) each
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq3, dk3, dv3 = (x.view(B * H, T, D) for x in (dq, dk, dv))
    delta = torch.empty(B * H, T, dtype=torch.float32, device=q.device)
    opts = dot_launch_opts(D, q.dtype)
    precision = opts.pop("DOT_PRECISION")

    _flash_bwd_preprocess[(cdiv(T, block_m), B * H)](
        o3,
        do3,
        delta,
        o3.stride(0),
        o3.stride(1),
        do3.stride(0),
        do3.stride(1),
        T,
        HEAD_DIM=D,
        BLOCK_M=block_m,
        **opts,
    )
    _flash_bwd_dkdv_kernel[(cdiv(T, block_n), B * H)](
        q3,
        k3,
        v3,
        do3,
        lse,
        delta,
        dk3,
        dv3,
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        v3.stride(0),
        v3.stride(1),
        do3.stride(0),
        do3.stride(1),
        dk3.stride(0),
        dk3.stride(1),
        dv3.stride(0),
        dv3.stride(1),
        T,
        sm_scale,
        sm_scale * LOG2E,
        HEAD_DIM=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        DOT_PRECISION=precision,
        **opts,
    )
    _flash_bwd_dq_kernel[(cdiv(T, block_m), B * H)](
        q3,
        k3,
        v3,
        do3,
        lse,
        delta,
        dq3,
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        v3.stride(0),
        v3.stride(1),
        do3.stride(0),
        do3.stride(1),
        dq3.stride(0),
        dq3.stride(1),
        T,
        sm_scale,
        sm_scale * LOG2E,
        HEAD_DIM=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        DOT_PRECISION=precision,
        **opts,
    )
    return dq, dk, dv
