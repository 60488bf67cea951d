"""FlashAttention in Triton: a fused, tiled attention forward, differentiable.

Follows FlashAttention (Dao et al. 2022, arXiv 2205.14135) in the FlashAttention-2 arrangement
(Dao 2023, arXiv 2307.08691): the outer loop runs over query blocks (one program each), the
inner loop over key blocks with an online softmax. The forward saves the log-sum-exp, from which
the backward (`lib.kernels.flash_backward`, Algorithm 2) recomputes the attention probabilities
instead of storing the (T, T) matrix.

    _fwd_tile               one online-softmax step: fold one key block into (acc, l, m)
    _flash_fwd_kernel       O and the log-sum-exp L for one (query block, batch*head)
    key_block_bounds        the key blocks a query block visits: the causal schedule
    flash_attention         the public entry point (autograd-aware; its backward is `flash_backward`)

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
from lib.kernels.flash_backward import flash_backward
from lib.kernels.runtime import LOG2E, cdiv, dot_launch_opts, kernel_mode, require_kernel_device

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
            "flash_attention needs q, k, v of one shape (B, H, T, D): self-attention only, no grouped-query "
            "heads (H_kv != H) or T != S (attention's backend='sdpa' takes any); "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
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
        **dot_launch_opts(D, q.dtype),
    )
    return (o, lse, visits) if count_visits else (o, lse)


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
        dq, dk, dv = flash_backward(
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
