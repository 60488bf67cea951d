"""FlashAttention in Triton: a fused, tiled attention forward and backward.

Follows FlashAttention (Dao et al. 2022, arXiv 2205.14135) in the FlashAttention-2 arrangement
(Dao 2023, arXiv 2307.08691): the outer loop runs over query blocks (one program each), the
inner loop over key blocks with an online softmax, and the backward recomputes the attention
probabilities from q, k and the saved log-sum-exp instead of storing the (T, T) matrix.

    _flash_fwd_kernel       O and the log-sum-exp L for one (query block, batch*head)
    _flash_bwd_preprocess   delta = rowsum(dO * O), the softmax-gradient correction term
    _flash_bwd_dkdv_kernel  dK, dV for one key block, looping over the query blocks that see it
    _flash_bwd_dq_kernel    dQ for one query block (a separate kernel: no atomic adds)
    flash_attention         the public entry point (autograd-aware)

Glossary: B batch, H heads, T sequence length (queries and keys: self-attention only), D head
dim; BLOCK_M queries and BLOCK_N keys per tile. A tile is one (query block, key block) pair.

Scope: q, k, v share one shape (B, H, T, D). Cross-attention (T != S) and grouped-query heads
(H_kv != H) are refused: with T == S the causal mask is the same whether aligned top-left or
bottom-right, which keeps the block-skipping arithmetic to one formula, `key_block_bounds`.
"""

from __future__ import annotations

import math

import torch

from lib._checks import require_rank, require_real, require_tensor
from lib.kernels import runtime
from lib.kernels.runtime import LOG2E, cdiv, kernel_mode, require_kernel_device

triton, tl = runtime.load_triton()  # (None, None) without triton: importing works, launching refuses

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "count_visited_tiles",
    "default_block_sizes",
    "flash_attention",
    "kernel_mode",
    "key_block_bounds",
    "require_kernel_device",
    "visited_blocks",
]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


# --------------------------------------------------------------------------- the tile schedule
def key_block_bounds(block_index: int, T: int, block_m: int, block_n: int, causal: bool) -> tuple[int, int]:
    """Key blocks visited by query block `block_index`: (n_full, n_end).

    Key blocks [0, n_full) are visible to every query in the block and need no mask; blocks
    [n_full, n_end) need an element mask (the causal diagonal, or the ragged tail when T is no
    multiple of BLOCK_N); blocks from n_end on are skipped. The forward kernel computes exactly
    these bounds (mirrored in `_flash_fwd_kernel`); the dQ kernel loops to the same n_end.
    """
    if causal:
        # a key block is fully visible when it ends at or before the block's first query
        n_full = (block_index * block_m) // block_n
        # the block's last query (capped at T - 1) is the furthest key anyone here may see
        n_end = cdiv(min((block_index + 1) * block_m, T), block_n)
    else:
        n_full = T // block_n
        n_end = cdiv(T, block_n)
    return n_full, n_end


def visited_blocks(T: int, block_m: int, block_n: int, causal: bool) -> int:
    """Number of (query block, key block) tiles the forward visits for one (batch, head).

    Non-causal: every tile, cdiv(T, BLOCK_M) * cdiv(T, BLOCK_N). Causal: the tiles on or below
    the diagonal, which tends to half of that (plus the diagonal) as T grows.
    """
    for name, value in (("T", T), ("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return sum(key_block_bounds(i, T, block_m, block_n, causal)[1] for i in range(cdiv(T, block_m)))


# --------------------------------------------------------------------------- kernels
if triton is not None:
    LOG2E_C = tl.constexpr(LOG2E)  # a global a kernel may read must be a constexpr

    @triton.jit
    def _fwd_tile(
        acc,
        l_i,
        m_i,
        q,
        K_head,
        V_head,
        stride_kt,
        stride_vt,
        start_n,
        offs_m,
        offs_n,
        offs_d,
        T,
        qk_scale,
        HEAD_DIM: tl.constexpr,
        MASK_TILE: tl.constexpr,
        CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One online-softmax step: fold key block [start_n, start_n + BLOCK_N) into (acc, l, m)."""
        cols = start_n + offs_n  # (BLOCK_N,) key positions
        kv_mask = (cols[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K_head + cols[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, D)
        v = tl.load(V_head + cols[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASK_TILE:
            keep = cols[None, :] < T
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
        p = tl.exp2(s - m_safe[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.exp2(m_i - m_safe)  # rescales what was summed under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return acc, l_i, m_new

    @triton.jit
    def _flash_fwd_kernel(
        Q,
        K,
        V,
        O,
        LSE,
        VISITS,
        stride_qh,
        stride_qt,
        stride_kh,
        stride_kt,
        stride_vh,
        stride_vt,
        stride_oh,
        stride_ot,
        T,
        qk_scale,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        COUNT_VISITS: tl.constexpr,
    ):
        """Grid (cdiv(T, BLOCK_M), B*H). qk_scale = sm_scale * log2(e). LSE (B*H, T) float32 (natural log)."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1).to(tl.int64)  # B*H*T*D can pass 2**31 on a GPU
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_mask = (offs_m[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + pid_bh * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_mask, other=0.0)
        K_head = K + pid_bh * stride_kh
        V_head = V + pid_bh * stride_vh

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running unnormalised output

        # Mirrors key_block_bounds(): [0, n_full) unmasked, [n_full, n_end) masked, the rest skipped.
        if CAUSAL:
            n_full = (pid_m * BLOCK_M) // BLOCK_N
            n_end = tl.cdiv(tl.minimum((pid_m + 1) * BLOCK_M, T), BLOCK_N)
        else:
            n_full = T // BLOCK_N
            n_end = tl.cdiv(T, BLOCK_N)
        visits = 0
        for start_n in range(0, n_full * BLOCK_N, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(
                acc,
                l_i,
                m_i,
                q,
                K_head,
                V_head,
                stride_kt,
                stride_vt,
                start_n,
                offs_m,
                offs_n,
                offs_d,
                T,
                qk_scale,
                HEAD_DIM,
                False,
                CAUSAL,
                DOT_PRECISION,
            )
            if COUNT_VISITS:
                visits += 1
        for start_n in range(n_full * BLOCK_N, n_end * BLOCK_N, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(
                acc,
                l_i,
                m_i,
                q,
                K_head,
                V_head,
                stride_kt,
                stride_vt,
                start_n,
                offs_m,
                offs_n,
                offs_d,
                T,
                qk_scale,
                HEAD_DIM,
                True,
                CAUSAL,
                DOT_PRECISION,
            )
            if COUNT_VISITS:
                visits += 1

        empty = l_i == 0.0  # no visible key: output zeros (cannot happen for T == S, kept as the rule)
        l_safe = tl.where(empty, 1.0, l_i)
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("inf"), (m_fin + tl.log2(l_safe)) / LOG2E_C)
        tl.store(
            O + pid_bh * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
            out.to(O.dtype.element_ty),
            mask=row_mask,
        )
        tl.store(LSE + pid_bh * T + offs_m, lse, mask=offs_m < T)
        if COUNT_VISITS:
            tl.store(VISITS + pid_bh * tl.num_programs(0) + pid_m, visits)

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


# --------------------------------------------------------------------------- checks
def default_block_sizes(D: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) the launcher uses for head dim D in the current mode."""
    if runtime.kernel_mode() == "interpreter":
        return 64, 64  # each tile is a numpy op: fewer, bigger tiles run much faster
    return (64, 64) if D <= 64 else (64, 32)  # keeps the fp32 D=128 tiles within shared memory


def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (16, 32, 64, 128):
        raise ValueError(
            f"{name} must be one of 16, 32, 64, 128 (tl.dot needs >= 16, tiles a power of 2), got {value!r}"
        )
    return value


def _check_inputs(q, k, v, causal, sm_scale) -> float:
    for name, x in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, x, floating=True)
        require_rank(name, x, 4, "(B, H, T, D)")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"flash_attention needs q, k, v of one shape (B, H, T, D): self-attention only, no "
            f"grouped-query heads (H_kv != H) or T != S; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got q: {q.dtype}, k: {k.dtype}, v: {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share one device, got q: {q.device}, k: {k.device}, v: {v.device}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"flash_attention supports float16, bfloat16 and float32 inputs, got {q.dtype}")
    B, H, T, D = q.shape
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D={D} is not supported: D must be one of {SUPPORTED_HEAD_DIMS}")
    if B == 0 or H == 0 or T == 0:
        raise ValueError(f"q, k, v must have no empty dimension, got {tuple(q.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    sm_scale = require_real("sm_scale", sm_scale, above=0, note=" or None (meaning 1/sqrt(D))")

    mode = runtime.require_kernel_device(q.device, "flash_attention", "lib.attention.attention(..., backend='sdpa')")
    if mode == "interpreter" and q.dtype == torch.bfloat16:
        raise ValueError(
            "bfloat16 is refused under the Triton interpreter: its bf16 tl.dot gives silently "
            "wrong results (errors ~1e10). Use float32 or float16 on the CPU, bfloat16 on a GPU"
        )
    return float(sm_scale)


# --------------------------------------------------------------------------- launchers
def _launch_opts(D: int, dtype: torch.dtype) -> dict:
    # fp32 on a GPU: tl.dot would round its inputs to tf32 (10-bit mantissa); ask for full fp32.
    precision = "ieee" if dtype == torch.float32 else "tf32"
    opts = dict(DOT_PRECISION=precision)
    if runtime.kernel_mode() == "compiled":
        opts.update(num_warps=4 if D <= 64 else 8, num_stages=2)
    return opts


def _flash_forward(q, k, v, causal: bool, sm_scale: float, block_m: int, block_n: int, count_visits: bool = False):
    """q, k, v contiguous (B, H, T, D) -> O (B, H, T, D), LSE (B*H, T) float32[, visits (B*H, n_m) int32]."""
    B, H, T, D = q.shape
    q3, k3, v3 = (x.view(B * H, T, D) for x in (q, k, v))  # (B, H, T, D) -> (B*H, T, D)
    o = torch.empty_like(q)
    o3 = o.view(B * H, T, D)
    lse = torch.empty(B * H, T, dtype=torch.float32, device=q.device)
    n_m = cdiv(T, block_m)
    visits = torch.zeros(B * H, n_m if count_visits else 1, dtype=torch.int32, device=q.device)
    grid = (n_m, B * H)
    _flash_fwd_kernel[grid](
        q3,
        k3,
        v3,
        o3,
        lse,
        visits,
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        v3.stride(0),
        v3.stride(1),
        o3.stride(0),
        o3.stride(1),
        T,
        sm_scale * LOG2E,
        HEAD_DIM=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        COUNT_VISITS=count_visits,
        **_launch_opts(D, q.dtype),
    )
    return (o, lse, visits) if count_visits else (o, lse)


def _flash_backward(do, q, k, v, o, lse, causal: bool, sm_scale: float, block_m: int, block_n: int):
    """Gradients (dq, dk, dv) of sum(dO * O); every tensor contiguous (B, H, T, D)."""
    B, H, T, D = q.shape
    q3, k3, v3, o3, do3 = (x.view(B * H, T, D) for x in (q, k, v, o, do))  # (B*H, T, D) each
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq3, dk3, dv3 = (x.view(B * H, T, D) for x in (dq, dk, dv))
    delta = torch.empty(B * H, T, dtype=torch.float32, device=q.device)
    opts = _launch_opts(D, q.dtype)
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


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, block_m, block_n):
        o, lse = _flash_forward(q, k, v, causal, sm_scale, block_m, block_n)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.block_m, ctx.block_n = causal, sm_scale, block_m, block_n
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _flash_backward(
            do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.sm_scale, ctx.block_m, ctx.block_n
        )
        return dq, dk, dv, None, None, None, None


def _prepare(q, k, v, causal, sm_scale, block_m, block_n):
    sm_scale = _check_inputs(q, k, v, causal, sm_scale)
    D = q.shape[-1]
    default_m, default_n = default_block_sizes(D)
    block_m = default_m if block_m is None else _check_block("block_m", block_m)
    block_n = default_n if block_n is None else _check_block("block_n", block_n)
    q, k, v = (x.contiguous() for x in (q, k, v))  # the kernels assume a unit stride along D
    return q, k, v, sm_scale, block_m, block_n


def flash_attention(
    q,
    k,
    v,
    causal: bool = True,
    sm_scale: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """softmax(QKᵀ·sm_scale [+ causal mask])V by the fused Triton kernels, differentiable.

    q, k, v (B, H, T, D) of one shape, dtype and device; D in {16, 32, 64, 128}; any T >= 1.
    float16/bfloat16/float32 on CUDA; float32/float16 under the interpreter (TRITON_INTERPRET=1).
    sm_scale defaults to 1/sqrt(D). block_m/block_n override the tile sizes (default:
    `default_block_sizes(D)`). Accumulates in float32; returns (B, H, T, D) in q's dtype.
    """
    q, k, v, sm_scale, block_m, block_n = _prepare(q, k, v, causal, sm_scale, block_m, block_n)
    return _FlashAttention.apply(q, k, v, causal, sm_scale, block_m, block_n)


def count_visited_tiles(q, k, v, causal: bool = True, *, block_m: int | None = None, block_n: int | None = None) -> int:
    """Run the forward kernel with its loop counter on: the tiles it visited, summed over query blocks, for
    one (batch, head) (every head visits the same tiles; checked). Counts what the kernel did, so
    it can be set beside `visited_blocks`, the count predicted from the bounds."""
    q, k, v, sm_scale, block_m, block_n = _prepare(q, k, v, causal, None, block_m, block_n)
    _, _, visits = _flash_forward(q, k, v, causal, sm_scale, block_m, block_n, count_visits=True)
    per_head = visits.sum(dim=1)  # (B*H,)
    if not bool((per_head == per_head[0]).all()):
        raise RuntimeError(f"heads visited different tile counts: {per_head.tolist()}")
    return int(per_head[0])
