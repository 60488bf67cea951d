"""Rotary position embedding (RoPE): position enters attention as a rotation of q and k.

Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding",
arXiv 2104.09864, section 3.4 (eq. 34): each pair of channels of a query or key at position p is
rotated by the angle p·θ_i, θ_i = base^(-2i/D). A rotation is orthogonal, so the score
(R_m q)·(R_n k) = q·R_(n-m) k depends on the positions only through their offset n - m.

    rope_frequencies    θ_i for the D/2 channel pairs
    rope_cos_sin        the full-width (T, D) cos and sin tables for positions offset..offset+T-1
    rotate_half         (x1, x2) -> (-x2, x1) on the two halves of the last dim
    rotate_interleaved  (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)
    apply_rope          x·cos + rotate(x)·sin: the fast path every model uses
    apply_rope_ref      the same rotation done pair by pair with an explicit 2x2 matrix (float64)

Two pairing conventions, both correct RoPE (`layout`):
    "half"         rotate-half (GPT-NeoX, Hugging Face Llama; this course's models): channel i is
                   paired with channel i + D/2, so the (T, D/2) angle table is concatenated with
                   itself, [θ_0 .. θ_{D/2-1}, θ_0 .. θ_{D/2-1}].
    "interleaved"  the paper's (x_0, x_1), (x_2, x_3), ... (GPT-J; Meta's Llama reference views q as
                   D/2 complex numbers, the same pairs): the table is repeat-interleaved,
                   [θ_0, θ_0, θ_1, θ_1, ...].
The two are the same model up to a fixed permutation of channels, but a checkpoint trained with
one gives wrong scores under the other, and mixing them (one's table with the other's rotation)
is no rotation at all.

Glossary: B batch, H heads, T positions, D head dim (even), D/2 channel pairs.
"""

from __future__ import annotations

import torch

from lib._checks import checking, require_int, require_rank, require_real, require_same, require_tensor

__all__ = [
    "LAYOUTS",
    "apply_rope",
    "apply_rope_ref",
    "rope_cos_sin",
    "rope_frequencies",
    "rotate_half",
    "rotate_interleaved",
]

LAYOUTS = ("half", "interleaved")


# --------------------------------------------------------------------------- input checks
def _check_head_dim(name: str, D) -> int:
    require_int(name, D, minimum=1)
    if D % 2:
        raise ValueError(f"{name} must be even (channels are rotated in pairs), got {D}")
    return D


def _check_base(base) -> float:
    return require_real("base", base, above=1, note=" (10000.0 in the paper and Llama)")


def _check_x(x) -> tuple[int, int, int, int]:
    require_tensor("x", x, floating=True)
    require_rank("x", x, 4, "(B, H, T, D)")
    B, H, T, D = x.shape
    if D % 2:
        raise ValueError(f"x must have an even head dim D (channels are rotated in pairs), got x {tuple(x.shape)}")
    return B, H, T, D


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} (which channels form a pair), got {layout!r}")
    return layout


def _frequencies64(D: int, base: float, device=None) -> torch.Tensor:
    i = torch.arange(D // 2, dtype=torch.float64, device=device)
    return base ** (-2.0 * i / D)  # (D/2,)


# --------------------------------------------------------------------------- tables
def rope_frequencies(D: int, base: float = 10000.0) -> torch.Tensor:
    """θ_i = base^(-2i/D) for i = 0 .. D/2 - 1: a (D/2,) float32 tensor, from 1 down to ~1/base."""
    _check_head_dim("D", D)
    return _frequencies64(D, _check_base(base)).to(torch.float32)


def rope_cos_sin(
    T: int,
    D: int,
    *,
    base: float = 10000.0,
    offset: int = 0,
    device=None,
    dtype=torch.float32,
    layout: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles p·θ_i for positions p = offset .. offset+T-1, each (T, D), laid
    out for `layout`'s pairs ("half": concatenated, "interleaved": repeat-interleaved).

    `offset` is the absolute position of the first row: with a KV cache, a new token's position is
    the cache length, and its query must be rotated for that position, not for 0.
    """
    _check_layout(layout)
    require_int("T", T, minimum=1)
    _check_head_dim("D", D)
    base = _check_base(base)
    require_int("offset", offset, minimum=0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype}")
    # The angles are built in float64: in float32 the product p·θ_0 = p is rounded to a relative
    # 6e-8, an absolute error of ~6e-4 rad at p = 10^4 that grows with the context length.
    # In float64 the angle is exact to ~1e-12 rad and only the final cos/sin are rounded to dtype.
    positions = torch.arange(offset, offset + T, dtype=torch.float64, device=device)  # (T,)
    angles = torch.outer(positions, _frequencies64(D, base, device))  # (T, D/2)
    if layout == "half":  # rotate-half pairs channel i with i + D/2: both halves need the same angles
        angles = torch.cat([angles, angles], dim=-1)  # (T, D/2) -> (T, D)
    else:  # interleaved pairs channels 2i and 2i + 1: each angle twice, in place
        angles = angles.repeat_interleave(2, dim=-1)  # (T, D/2) -> (T, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


# --------------------------------------------------------------------------- rotation
def _check_even(x) -> None:
    require_tensor("x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must have shape (..., D) with D even, got {tuple(x.shape)}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): cat(-x[..., D/2:], x[..., :D/2]), the 90° turn of every pair (i, i + D/2)."""
    if checking():
        _check_even(x)
    x1, x2 = x.chunk(2, dim=-1)  # (..., D) -> two (..., D/2)
    return torch.cat([-x2, x1], dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): (-x1, x0, -x3, x2, ...), the 90° turn of every pair (2i, 2i + 1)."""
    if checking():
        _check_even(x)
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)  # (..., D/2, 2) -> (..., D)


def _check_table(name: str, table, T: int, D: int, x: torch.Tensor) -> None:
    require_tensor(name, table, floating=True)
    require_same(("x", name), (x, table), "device")
    if table.dim() == 2 and tuple(table.shape) == (T, D // 2):
        raise ValueError(
            f"{name} has shape {tuple(table.shape)} = (T, D/2): that is the half-width angle table, one angle per "
            f"channel pair. Both channels of a pair need it, so it must be widened to (T, D) = {(T, D)}: "
            f"torch.cat([{name}, {name}], dim=-1) for the rotate-half pairs (i, i + D/2), or "
            f"{name}.repeat_interleave(2, dim=-1) for the interleaved pairs (2i, 2i + 1), each with its own "
            f"rotation; rope_cos_sin does this (layout='half' or 'interleaved')"
        )
    if tuple(table.shape) != (T, D):
        raise ValueError(f"{name} must have shape (T, D) = {(T, D)} to match x (B, H, T, D), got {tuple(table.shape)}")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: str = "half") -> torch.Tensor:
    """Rotate x (B, H, T, D) by the angles whose cos and sin are (T, D) tables (see `rope_cos_sin`,
    with the same `layout`).

    Returns x·cos + rotate(x)·sin in x's dtype, rotate = rotate_half or rotate_interleaved;
    float16/bfloat16 are computed in float32 so the output is rounded once, not after each product.
    """
    if checking():
        _check_layout(layout)
        _, _, T, D = _check_x(x)
        _check_table("cos", cos, T, D, x)
        _check_table("sin", sin, T, D, x)
    rotate = rotate_half if layout == "half" else rotate_interleaved
    work = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xw = x.to(work)
    out = xw * cos.to(work) + rotate(xw) * sin.to(work)  # (B, H, T, D) * (T, D) broadcasts over B, H
    return out.to(x.dtype)


def apply_rope_ref(
    x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0, *, layout: str = "half"
) -> torch.Tensor:
    """The rotation, one channel pair at a time: pair i, (x_i, x_{i+D/2}) under layout="half" or
    (x_{2i}, x_{2i+1}) under "interleaved", at position p is multiplied by the 2x2 matrix
    [[cos pθ_i, -sin pθ_i], [sin pθ_i, cos pθ_i]]. Float64 throughout; slow; the yardstick for
    `apply_rope`. x (B, H, T, D), positions (T,) integers -> (B, H, T, D) in x's dtype.
    """
    _check_layout(layout)
    _, _, T, D = _check_x(x)
    base = _check_base(base)
    require_tensor("positions", positions)
    if positions.dtype == torch.bool or positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    if tuple(positions.shape) != (T,):
        raise ValueError(
            f"positions must have shape (T,) = ({T},) to match x (B, H, T, D), got {tuple(positions.shape)}"
        )
    require_same(("x", "positions"), (x, positions), "device")
    x64, p64 = x.to(torch.float64), positions.to(torch.float64)
    out = torch.empty_like(x64)
    half = D // 2
    for i in range(half):
        theta = base ** (-2.0 * i / D)  # a Python float: independent of rope_frequencies
        c, s = torch.cos(p64 * theta), torch.sin(p64 * theta)  # (T,)
        rotation = torch.stack([torch.stack([c, -s], dim=-1), torch.stack([s, c], dim=-1)], dim=-2)  # (T, 2, 2)
        a, b = (i, i + half) if layout == "half" else (2 * i, 2 * i + 1)  # the pair's two channels
        pair = torch.stack([x64[..., a], x64[..., b]], dim=-1)  # (B, H, T, 2)
        turned = torch.einsum("tij,bhtj->bhti", rotation, pair)  # (B, H, T, 2)
        out[..., a], out[..., b] = turned[..., 0], turned[..., 1]
    return out.to(x.dtype)
