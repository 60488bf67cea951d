"""The Mamba mixer's short causal convolution: each channel mixes its last K inputs.

Mamba's mixer (Gu & Dao 2023, Fig. 3) runs a depthwise causal conv1d of width K (d_conv, 4) over
the sequence before the selective scan. Causal: position t sees t − K + 1 .. t, so the mixer can
decode one token at a time from a state of the last K − 1 inputs (`lib.mamba.MixerCache`).

    causal_conv1d_ref    PyTorch's grouped conv1d, as the official code runs it: the definition
    causal_conv1d_cpu    the same by a plain C loop with its backward (`lib.kernels.cpu_layers`):
                         PyTorch's grouped conv1d spends milliseconds per call at this course's
                         sizes, mostly in its backward
    causal_conv1d        the front door: the C loop for CPU tensors where it compiled, else the reference

All three take the state (the inputs before x) and an optional SiLU after the convolution (the
official causal_conv1d_fn's `activation`), which the mixer uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lib._checks import require_int, require_rank, require_tensor
from lib.kernels.runtime import work_dtype

__all__ = ["CONV_ACTIVATIONS", "causal_conv1d", "causal_conv1d_cpu", "causal_conv1d_ref"]

CONV_ACTIVATIONS = (None, "silu")


def _check_conv_inputs(x, weight, bias, state, activation=None) -> None:
    """x (B, T, E); weight (E, 1, K) or (E, K); bias (E,) or None; state (B, E, K − 1) or None;
    activation None or "silu"."""
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    require_tensor("x", x, floating=True)
    require_rank("x", x, 3, "(B, T, E)")
    b, t, e = x.shape
    if b == 0 or t == 0 or e == 0:
        raise ValueError(f"x must have shape (B, T, E) with every size >= 1, got {tuple(x.shape)}")
    require_tensor("weight", weight, floating=True)
    if (
        weight.dim() not in (2, 3)
        or weight.shape[0] != e
        or (weight.dim() == 3 and weight.shape[1] != 1)
        or weight.shape[-1] == 0
    ):
        raise ValueError(
            f"weight must have shape (E, 1, K) (a depthwise nn.Conv1d's) or (E, K) with E = {e} and "
            f"K >= 1, got {tuple(weight.shape)}"
        )
    k = weight.shape[-1]
    for name, t_, shape in (("bias", bias, (e,)), ("state", state, (b, e, k - 1))):
        if t_ is None:
            continue
        require_tensor(name, t_, floating=True)
        if tuple(t_.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t_.shape)}")
    others = {n: t_.device for n, t_ in (("weight", weight), ("bias", bias), ("state", state)) if t_ is not None}
    if any(dev != x.device for dev in others.values()):
        raise ValueError(
            f"x, weight (and bias, state) must share one device, got x: {x.device}, "
            + ", ".join(f"{n}: {d}" for n, d in others.items())
        )


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """The Mamba mixer's causal depthwise convolution by PyTorch's grouped conv1d, as the official
    code runs it: x (B, T, E), weight (E, 1, K) or (E, K), bias (E,) or None, state (B, E, K − 1)
    (the inputs before x; None: zeros) -> y (B, T, E), position t seeing t − K + 1 .. t; with
    activation="silu" (the official causal_conv1d_fn's), SiLU(y), as the mixer uses it."""
    _check_conv_inputs(x, weight, bias, state, activation)
    return _conv_ref(x, weight, bias, state, activation)


def _conv_ref(x, weight, bias, state, activation=None):
    b, t, e = x.shape
    k = weight.shape[-1]
    xs = x.transpose(1, 2)  # (B, E, T)
    window = torch.cat([xs.new_zeros(b, e, k - 1) if state is None else state.to(xs.dtype), xs], dim=-1)
    y = F.conv1d(window, weight.reshape(e, 1, k).to(xs.dtype), None if bias is None else bias.to(xs.dtype), groups=e)
    y = y.transpose(1, 2)  # (B, E, T) -> (B, T, E)
    return F.silu(y) if activation == "silu" else y


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """`causal_conv1d_ref`'s result (up to rounding), by the C loop (`causal_conv1d_cpu`) for
    CPU tensors in fp32 or fp64 where it compiled (PyTorch's grouped conv1d spends milliseconds
    on each of this course's small inputs, mostly in its backward), else by the reference."""
    _check_conv_inputs(x, weight, bias, state, activation)
    return _conv_auto(x, weight, bias, state, activation)


def _conv_auto(x, weight, bias, state, activation=None):
    tensors = (x, weight, bias, state)
    if (
        x.device.type == "cpu"
        and work_dtype(*tensors) in (torch.float32, torch.float64)
        and all(t is None or t.dtype == x.dtype for t in tensors)
    ):
        from lib.kernels import cpu_layers, scan_cpu  # imported on first use (it builds the C library)

        if scan_cpu.cpu_kernel_available():
            return cpu_layers.conv(x, weight, bias, state, activation)
    return _conv_ref(x, weight, bias, state, activation)


def causal_conv1d_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """The causal depthwise convolution by a plain C loop, differentiable: the same result as
    `causal_conv1d_ref` (up to rounding), for CPU tensors.

    x (B, T, E); weight (E, 1, K) as nn.Conv1d(E, E, K, groups=E) holds it, or (E, K); bias (E,) or
    None; state (B, E, K − 1), the inputs before x, or None (zeros) -> y (B, T, E) with
    y[:, t] = bias + Σ_k weight[:, k] ⊙ (state, x)[t + k]: position t sees t − K + 1 .. t; with
    activation="silu", SiLU(y), in the same loop. Computes in fp32 (fp64 if any input is fp64)
    and returns x's dtype. `threads`: how many threads share the sequences (default torch's).
    """
    _check_conv_inputs(x, weight, bias, state, activation)
    if threads is not None:
        require_int("threads", threads, minimum=1)
    from lib.kernels import cpu_layers  # imported on first use (it builds the C library)

    return cpu_layers.conv(x, weight, bias, state, activation, threads)
