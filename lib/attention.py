"""Scaled dot-product attention, softmax(QKᵀ/√D + M)V, three ways behind one door.

    attention_ref      materialises the (T, S) score matrix; obviously correct; the truth
    attention_backward_ref   its gradients by the formulas a FlashAttention backward uses
    attention_chunked  online softmax over key blocks, never holds more than a
                       (block_q, block_k) tile of scores: the FlashAttention idea in PyTorch
                       (Dao et al. 2022, arXiv 2205.14135, Algorithm 1; Milakov & Gimelshein 2018)
    attention(..., backend=)  the one entry point: "naive" (= ref), "sdpa"
                       (torch.nn.functional.scaled_dot_product_attention), "chunked", and any
                       backend a later module registers (lesson 05 adds "triton")

Glossary: B batch, H query heads, H_kv key/value heads (H_kv divides H: grouped-query
attention), T query length, S key length (S = T, or the cache length while decoding), D head dim.

Conventions shared by every backend:
- `mask` is additive (0 = may attend, −inf = may not; see lib.masks), broadcastable to
  (B, H, T, S). Boolean masks are refused: True means "attend" in SDPA and "mask" elsewhere.
- `causal=True` means query i (at absolute position S - T + i) sees keys at positions <= its
  own: bottom-right alignment, so one decode step (T = 1) sees the whole cache.
- A query row whose keys are all masked has no distribution to take. Plain softmax gives NaN
  there (0/0); every backend here returns an output row of zeros instead (the rule FlashAttention
  kernels follow), so a padded position cannot poison later layers or the gradients with NaN.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from lib._door import door
from lib.masks import causal_mask

__all__ = [
    "BACKENDS",
    "attention",
    "attention_backward_ref",
    "attention_chunked",
    "attention_ref",
    "attention_scores",
    "attention_weights",
    "online_softmax_update",
    "register_backend",
    "safe_softmax",
]


# --------------------------------------------------------------------------- the contract
# One door for the family; a function without v (or mask) leaves those out (see lib._checks.door).
_ATTENTION = door(
    q="float (B, H, T, D)",
    k="float (B, H_kv, S, D)",
    v="float (B, H_kv, S, D_v)",
    mask="additive (T, S) | (B?, H?, T?, S?) | None",
    causal="bool",
    scale="real > 0 | None",
    same_dtype="q k v",
    where={
        "H % H_kv == 0": "the query heads H must be a multiple of the key/value heads H_kv",
        "not causal or T <= S": "causal attention needs T <= S (the queries are the last T of S positions)",
    },
)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    """The score scale: 1/√D unless given."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _as_4d(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An additive (T, S) or (B, H, T, S) mask as (1, 1, T, S) or (B, H, T, S) in `dtype`."""
    return None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).to(dtype)


def _expand_kv(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: repeat each of the H_kv heads for its H / H_kv query heads."""
    groups = q.shape[1] // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)  # (B, H_kv, S, D) -> (B, H, S, D)


# --------------------------------------------------------------------------- reference
@door(scores="float (..., S)", dim="int")
def safe_softmax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax that maps a row of all −inf to all zeros instead of NaN (otherwise identical)."""
    row_max = scores.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    e = torch.exp(scores - row_max)  # exp(-inf) == 0 exactly
    denom = e.sum(dim=dim, keepdim=True)
    return e / torch.where(denom == 0, torch.ones_like(denom), denom)


@_ATTENTION
def attention_scores(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The raw scores QKᵀ·scale, (B, H, T, S), before any mask. scale defaults to 1/√D."""
    return (q @ _expand_kv(q, k).transpose(-2, -1)) * _scale(q, scale)  # (B, H, T, D) @ (B, H, D, S) -> (B, H, T, S)


@_ATTENTION
def attention_weights(q, k, mask=None, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """softmax(QKᵀ·scale + M) as a (B, H, T, S) tensor, with fully masked rows all zero; the
    weights `attention_ref` multiplies V by (computed in fp32 for fp16/bf16)."""
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = (q.to(work) @ _expand_kv(q, k).to(work).transpose(-2, -1)) * _scale(q, scale)  # (B, H, T, S)
    if mask is not None:
        scores = scores + mask.to(work)
    if causal:
        scores = scores + causal_mask(q.shape[2], kv_len=k.shape[2], device=q.device, dtype=work)
    return safe_softmax(scores, dim=-1)


@_ATTENTION
def attention_ref(q, k, v, mask=None, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """softmax(QKᵀ·scale + M)V with the whole (T, S) matrix in memory; fp32 math for fp16/bf16.

    q (B, H, T, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v) -> (B, H, T, D_v) in q's dtype. `mask`
    is additive, (T, S) or broadcasting to (B, H, T, S); `causal` lets query t (the queries are the
    last T of S positions) see keys up to S - T + t. K and V with fewer heads serve H / H_kv queries.
    """
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    T, S = q.shape[2], k.shape[2]
    scores = (q.to(work) @ _expand_kv(q, k).to(work).transpose(-2, -1)) * _scale(q, scale)  # (B, H, T, S)
    if mask is not None:
        scores = scores + mask.to(work)  # 0 = attend, −inf = blocked
    if causal:
        scores = scores + causal_mask(T, kv_len=S, device=q.device, dtype=work)  # −inf above the diagonal
    weights = safe_softmax(scores, dim=-1)  # each row sums to 1; a row with no visible key is all 0
    return (weights @ _expand_kv(q, v).to(work)).to(q.dtype)  # (B, H, T, S) @ (B, H, S, D_v)


@_ATTENTION.plus(grad_out="float (B, H, T, D_v)")
def attention_backward_ref(q, k, v, grad_out, mask=None, causal: bool = False, scale: float | None = None):
    """The gradients of `attention_ref` by their formulas, as a FlashAttention backward computes
    them (Dao 2023, FlashAttention-2, Algorithm 2), here with whole (T, S) matrices:

        L  = logsumexp(S) per row, S = QKᵀ·scale + M     what the forward saves: T numbers, not T·S
        P  = exp(S − L)                                   recomputed from L, not stored
        dV = Pᵀ dO,  dP = dO Vᵀ
        D  = rowsum(dO ∘ O)  (= rowsum(P ∘ dP))           one number per query row
        dS = P ∘ (dP − D)                                 the softmax's backward
        dQ = dS K · scale,  dK = dSᵀ Q · scale

    Arguments as `attention_ref`, plus grad_out (B, H, T, D_v), the gradient of its output ->
    (dq, dk, dv) shaped like q, k, v (grouped-query heads summed into their key/value head), in
    their dtypes, computed in fp32 (fp64 if given fp64). A fully masked row gets zero gradients.
    """
    scale, m4 = _scale(q, scale), _as_4d(mask, q.dtype)
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qw, kw, vw, dO = (t.to(work) for t in (q, _expand_kv(q, k), _expand_kv(q, v), grad_out))
    scores = (qw @ kw.transpose(-2, -1)) * scale  # (B, H, T, S)
    if m4 is not None:
        scores = scores + m4.to(work)
    if causal:
        scores = scores + causal_mask(q.shape[2], kv_len=k.shape[2], device=q.device, dtype=work)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, H, T, 1); −inf for a fully masked row
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)  # then P = exp(−inf) = 0
    p = torch.exp(scores - lse)  # (B, H, T, S)
    o = p @ vw  # (B, H, T, D_v): the forward's output, which the backward reads for D
    dv = p.transpose(-2, -1) @ dO  # (B, H, S, T) @ (B, H, T, D_v) -> (B, H, S, D_v)
    dp = dO @ vw.transpose(-2, -1)  # (B, H, T, D_v) @ (B, H, D_v, S) -> (B, H, T, S)
    delta = (dO * o).sum(-1, keepdim=True)  # (B, H, T, 1)
    ds = p * (dp - delta)  # (B, H, T, S)
    dq = (ds @ kw) * scale  # (B, H, T, D)
    dk = (ds.transpose(-2, -1) @ qw) * scale  # (B, H, S, D)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # each key/value head served `groups` query heads: its gradient is their sum
        dk, dv = (t.unflatten(1, (k.shape[1], groups)).sum(2) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------- chunked
@door(
    m="float (..., R, 1)",
    l="float (..., R, 1)",
    acc="float (..., R, D_v)",
    scores="float (..., R, bk)",
    values="float (..., bk, D_v)",
)
def online_softmax_update(
    m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one block of keys into a running softmax: the step FlashAttention repeats per tile.

    m (..., R, 1) running max, l (..., R, 1) running denominator, acc (..., R, D_v) running
    unnormalised output, for R query rows; scores (..., R, bk) one block of (masked) scores;
    values (..., bk, D_v) that block's values. Returns the new (m, l, acc), for which
    acc / l == softmax(all scores so far) @ (all values so far). Start from m = -inf, l = 0,
    acc = 0. A row with no visible key yet (all -inf so far) keeps l = 0 and acc = 0.
    """
    m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
    p = torch.exp(scores - m_safe)  # (..., R, bk)
    correction = torch.exp(m - m_safe)  # rescales what was summed under the old max; exp(-inf) = 0 at first
    l = l * correction + p.sum(dim=-1, keepdim=True)
    acc = acc * correction + p @ values.to(p.dtype)  # (..., R, bk) @ (..., bk, D_v)
    return m_new, l, acc


@_ATTENTION.plus(block_q="int >= 1", block_k="int >= 1")
def attention_chunked(
    q, k, v, mask=None, causal: bool = False, scale: float | None = None, *, block_q: int = 64, block_k: int = 64
) -> torch.Tensor:
    """Attention by online softmax over (block_q, block_k) tiles; equal to `attention_ref`.

    For each block of queries we walk the key blocks keeping, per query row, the running
    maximum m, the running denominator l and the unnormalised output acc. A new block with a
    larger maximum rescales what came before by exp(m_old - m_new). Under `causal`, key blocks
    entirely in a query block's future are skipped: the work a flash kernel saves.
    """
    scale, m4 = _scale(q, scale), _as_4d(mask, q.dtype)
    B, H, T, D = q.shape
    S, D_v = k.shape[2], v.shape[3]
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    k_all, v_all = _expand_kv(q, k).to(work), _expand_kv(q, v).to(work)  # (B, H, S, D), (B, H, S, D_v)
    out = torch.empty(B, H, T, D_v, dtype=q.dtype, device=q.device)
    offset = S - T  # absolute position of query 0

    for qs in range(0, T, block_q):
        qe = min(qs + block_q, T)
        q_blk = q[:, :, qs:qe].to(work) * scale  # (B, H, bq, D)
        m = torch.full((B, H, qe - qs, 1), float("-inf"), dtype=work, device=q.device)
        l = torch.zeros(B, H, qe - qs, 1, dtype=work, device=q.device)
        acc = torch.zeros(B, H, qe - qs, D_v, dtype=work, device=q.device)
        q_pos = torch.arange(offset + qs, offset + qe, device=q.device).unsqueeze(1)  # (bq, 1)
        for ks in range(0, S, block_k):
            if causal and ks > offset + qe - 1:
                break  # this key block and all later ones are in every query's future
            ke = min(ks + block_k, S)
            s = q_blk @ k_all[:, :, ks:ke].transpose(-2, -1)  # (B, H, bq, bk)
            if m4 is not None:
                rows = slice(qs, qe) if m4.shape[2] != 1 else slice(None)
                s = s + m4[:, :, rows, ks:ke].to(work)
            if causal:
                k_pos = torch.arange(ks, ke, device=q.device).unsqueeze(0)  # (1, bk)
                s = s.masked_fill(k_pos > q_pos, float("-inf"))
            m, l, acc = online_softmax_update(m, l, acc, s, v_all[:, :, ks:ke])
        out[:, :, qs:qe] = (acc / torch.where(l == 0, torch.ones_like(l), l)).to(q.dtype)
    return out


# --------------------------------------------------------------------------- SDPA and dispatch
@_ATTENTION
def _attention_sdpa(q, k, v, mask=None, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    scale, m4 = _scale(q, scale), _as_4d(mask, q.dtype)
    T, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    k, v = (_expand_kv(q, k), _expand_kv(q, v)) if gqa else (k, v)
    if m4 is None and (not causal or T == S or T == 1):
        # SDPA's is_causal is top-left aligned, which equals ours only when T == S. A single query
        # (a decode step) sits at the last position and sees every key: no mask at all.
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and T > 1, scale=scale)
    full = m4 if m4 is not None else torch.zeros(1, 1, 1, 1, dtype=q.dtype, device=q.device)
    if causal:
        full = full + causal_mask(T, kv_len=S, device=q.device, dtype=q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=scale)
    dead_rows = torch.isneginf(full).all(dim=-1, keepdim=True)  # (.., T, 1): no key visible
    return out.masked_fill(dead_rows, 0.0)  # always: asking whether any row is dead would stall a GPU


Backend = Callable[..., torch.Tensor]
BACKENDS: dict[str, Backend] = {
    "naive": attention_ref,
    "sdpa": _attention_sdpa,
    "chunked": attention_chunked,
}


def register_backend(name: str, fn: Backend) -> None:
    """Add a backend to `attention` (lesson 05 registers its Triton kernel this way)."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"name must be a non-empty string other than 'auto', got {name!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    BACKENDS[name] = fn


def attention(q, k, v, mask=None, causal: bool = False, scale: float | None = None, backend: str = "auto"):
    """softmax(QKᵀ·scale + M)V through the chosen backend; "auto" picks PyTorch's SDPA, or the
    Triton kernel on a CUDA GPU when it supports the call (no mask, T == S, H_kv == H).

    q (B, H, T, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v) -> (B, H, T, D_v).
    """
    if backend == "auto":
        backend = "triton" if _triton_fits(q, k, v, mask) else "sdpa"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    return BACKENDS[backend](q, k, v, mask=mask, causal=causal, scale=scale)


# --------------------------------------------------------------------------- Triton (lesson 05)
@_ATTENTION.plus(where={"mask is None": "backend='triton' takes causal=True or no mask, not a mask (sdpa takes any)"})
def _attention_triton(q, k, v, mask=None, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """lib.kernels.flash_attention behind the door: causal or no mask; the kernel refuses the shapes it
    does not take (it computes self-attention only)."""
    from lib.kernels import flash_attention  # imported here: lib.attention must not need triton

    return flash_attention(q, k, v, causal=causal, sm_scale=scale)


def _triton_fits(q, k, v, mask) -> bool:
    """Whether "auto" should take the Triton kernel: a CUDA GPU and a call the kernel supports."""
    if not (isinstance(q, torch.Tensor) and q.is_cuda and mask is None):
        return False  # on the CPU "auto" stays SDPA without importing the kernels
    if not (
        isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and q.dim() == 4
        and q.shape == k.shape == v.shape
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    ):
        return False
    from lib.kernels import SUPPORTED_HEAD_DIMS, kernel_mode

    return kernel_mode() == "compiled" and q.shape[3] in SUPPORTED_HEAD_DIMS


BACKENDS["triton"] = _attention_triton
