"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), the normalisation of
Mamba's blocks (and LLaMA's): LayerNorm without the mean subtraction and the bias,

    y = x / sqrt(mean(x²) + eps) ⊙ w         over the last axis of x (C features)

    rms_norm_ref   torch.nn.functional.rms_norm: the definition
    rms_norm       the same result (up to rounding), by one C loop forward and one backward
                   (`lib.kernels.cpu_layers`) for CPU tensors in fp32 or fp64 where it compiled, else
                   the reference. PyTorch composes RMSNorm from about six tensor operations forward
                   and a dozen backward, each a pass over the activations; at lesson 08's sizes
                   (16 x 25 x 64, float64) that measured three times LayerNorm's fused kernel, and
                   a Mamba block has one per layer
    RMSNorm        torch.nn.RMSNorm whose forward is `rms_norm`: the same parameter (`weight`), the
                   same state dict, so checkpoints load unchanged
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import require_real, require_tensor

__all__ = ["RMSNorm", "rms_norm", "rms_norm_ref"]


def _check(x, weight, eps) -> None:
    require_tensor("x", x, floating=True)
    require_tensor("weight", weight, floating=True)
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"weight must have shape (C,) with C = x.shape[-1], got weight {tuple(weight.shape)} and x {tuple(x.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"x and weight must share one device, got x: {x.device}, weight: {weight.device}")
    require_real("eps", eps, above=0, note=" (it keeps the root mean square away from 0)")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm by PyTorch's own composition: x (..., C), weight (C,) -> y (..., C) in x's dtype."""
    _check(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """`rms_norm_ref`'s result, by the fused C loop where it applies (CPU, fp32 or fp64, weight in
    x's dtype, the loop compiled here), else by the reference. Differentiable."""
    _check(x, weight, eps)
    return _rms_norm_auto(x, weight, eps)


def _rms_norm_auto(x, weight, eps):
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and weight.dtype == x.dtype:
        from lib.kernels import cpu_layers, scan_cpu  # imported on first use (it builds the C library)

        if scan_cpu.cpu_kernel_available():
            return cpu_layers.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class RMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm(C, eps) over the last axis, computed by `rms_norm` (a fused loop on a CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or len(self.normalized_shape) != 1:
            return super().forward(x)  # the loop covers one affine axis, as Mamba uses it
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps  # nn.RMSNorm's default
        return _rms_norm_auto(x, self.weight, eps)
