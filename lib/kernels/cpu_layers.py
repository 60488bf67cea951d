"""The rest of a Mamba layer as plain C loops for the CPU, beside the fused scan: the mixer's
causal depthwise convolution and RMSNorm, each forward and backward (lesson 06's Mamba block).
At this course's sizes PyTorch spends more on these than it should: its grouped
conv1d costs milliseconds per call, most of it in the backward, and it composes RMSNorm from
about six tensor operations forward and a dozen backward, each a pass over the activations.

The loops are in the same C file and library as the scan (`scan_cpu.c`), built, self-checked and
run on threads by `lib.kernels.scan_cpu`; where it could not be built, `cpu_kernel_status()` says
why and the front doors use their PyTorch references instead.

    conv        the mixer's causal depthwise convolution (lib.conv.causal_conv1d_ref), as a loop
                with its backward, with the SiLU after it optionally fused (front door:
                lib.conv.causal_conv1d_cpu, and lib.conv.causal_conv1d on a CPU)
    rms_norm    RMSNorm over the last axis, forward and backward, for lib.norms.rms_norm
    RMS_ROWS    rows per backward unit of RMSNorm (scan_cpu.c's RMS_ROWS)

Raw launchers: the front doors check the arguments. Glossary: B batch, T time, E channels, K the
convolution's width; R rows and C features for RMSNorm. Every thread split gives the same bits.
"""

from __future__ import annotations

import torch

from lib.kernels.runtime import work_dtype
from lib.kernels.scan_cpu import (
    call_entry_point,
    cpu_kernel_status,
    data_pointers,
    dtype_suffix,
    ensure_built,
    require_cpu,
    threads_for,
)

__all__ = ["RMS_ROWS", "conv", "rms_norm"]


# --------------------------------------------------------------------------- the mixer's convolution
class _CpuConv(torch.autograd.Function):
    """apply(x (B, T, E), wt (K, E), bias (E,) or None, state (B, E, K - 1) or None, silu, threads),
    all contiguous and of one dtype (fp32 or fp64) -> y (B, T, E), the convolution or its SiLU;
    gradients for all four."""

    @staticmethod
    def forward(ctx, x, wt, bias, state, silu, threads):
        b, t, e = x.shape
        k = wt.shape[0]
        y = torch.empty_like(x)
        pre = torch.empty_like(x) if silu and any(ctx.needs_input_grad[:4]) else None  # for silu' in the backward
        call_entry_point(
            ensure_built(),
            f"onemask_conv_{dtype_suffix(x)}",
            data_pointers(x, state, wt, bias, y, pre),
            (int(silu), t, e, k),
            b,
            threads_for(threads, b, b * t * e * k),
        )
        ctx.save_for_backward(x, wt, state, pre)
        ctx.threads, ctx.has_bias = threads, bias is not None
        return y

    @staticmethod
    def backward(ctx, gy):
        x, wt, state, pre = ctx.saved_tensors
        b, t, e = x.shape
        k = wt.shape[0]
        gy = gy.to(x.dtype).contiguous()
        gx = torch.empty_like(x)
        gstate = None if state is None else torch.zeros_like(state)
        gwp, gbp = torch.empty(b, k, e, dtype=x.dtype), torch.empty(b, e, dtype=x.dtype)
        pointers = data_pointers(x, state, wt, pre, gy, gx, gstate, gwp, gbp)
        call_entry_point(
            ensure_built(),
            f"onemask_conv_bwd_{dtype_suffix(x)}",
            pointers,
            (t, e, k),
            b,
            threads_for(ctx.threads, b, 2 * b * t * e * k),
        )
        need = ctx.needs_input_grad
        return (
            gx if need[0] else None,
            gwp.sum(0) if need[1] else None,
            gbp.sum(0) if need[2] and ctx.has_bias else None,
            gstate if need[3] else None,
            None,
            None,
        )


def conv(x, weight, bias, state, activation=None, threads=None):
    """The raw launcher of the causal depthwise convolution, on checked CPU inputs (the shapes of
    `lib.conv.causal_conv1d_ref`): y (B, T, E) in x's dtype. The front door is
    `lib.conv.causal_conv1d_cpu`."""
    require_cpu(x.device)
    if ensure_built() is None:
        raise RuntimeError(f"causal_conv1d_cpu is {cpu_kernel_status()}; use lib.conv.causal_conv1d")
    wt = work_dtype(x, weight, bias, state)
    w2 = weight.reshape(weight.shape[0], weight.shape[-1])  # (E, K)
    y = _CpuConv.apply(
        x.to(wt).contiguous(),
        w2.to(wt).t().contiguous(),
        None if bias is None else bias.to(wt).contiguous(),
        None if state is None else state.to(wt).contiguous(),
        activation == "silu",
        torch.get_num_threads() if threads is None else threads,
    )
    return y.to(x.dtype)


# --------------------------------------------------------------------------- RMSNorm
RMS_ROWS = 16  # rows per backward unit (scan_cpu.c's RMS_ROWS): each writes its own partial sum of gw


class _CpuRMSNorm(torch.autograd.Function):
    """apply(x (R, C), w (C,), eps, threads), contiguous, one dtype (fp32 or fp64) -> y (R, C)."""

    @staticmethod
    def forward(ctx, x, w, eps, threads):
        r, c = x.shape
        y, rstd = torch.empty_like(x), torch.empty(r, dtype=x.dtype)
        call_entry_point(
            ensure_built(),
            f"onemask_rms_{dtype_suffix(x)}",
            data_pointers(x, w, y, rstd),
            (float(eps), c),
            r,
            threads_for(threads, r, r * c),
        )
        ctx.save_for_backward(x, w, rstd)
        ctx.threads = threads
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w, rstd = ctx.saved_tensors
        r, c = x.shape
        units = -(-r // RMS_ROWS)
        gx, gwp = torch.empty_like(x), torch.empty(units, c, dtype=x.dtype)
        call_entry_point(
            ensure_built(),
            f"onemask_rms_bwd_{dtype_suffix(x)}",
            data_pointers(x, w, rstd, gy.to(x.dtype).contiguous(), gx, gwp),
            (r, c),
            units,
            threads_for(ctx.threads, units, 2 * r * c),
        )
        return gx, gwp.sum(0), None, None


def rms_norm(x, weight, eps, threads=None):
    """RMSNorm over x's last axis by the C loop (checked CPU inputs of one dtype, fp32 or fp64)."""
    require_cpu(x.device)
    if ensure_built() is None:
        raise RuntimeError(f"rms_norm_cpu is {cpu_kernel_status()}; use lib.norms.rms_norm")
    shape = x.shape
    y = _CpuRMSNorm.apply(
        x.reshape(-1, shape[-1]).contiguous(),
        weight.contiguous(),
        eps,
        torch.get_num_threads() if threads is None else threads,
    )
    return y.view(shape)
