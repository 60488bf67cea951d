"""Matrix-vector products at the speed of memory on a CPU: the linear layers of a decode step.

Decoding one token multiplies every weight matrix by one vector: each weight is read from memory
once and used for one multiply-add, so the step takes as long as reading the weights (it is
memory-bound). How fast PyTorch's CPU product reads them depends on how the matrix is stored
(`python -m lib.course.bench.decode` measures it on your machine):

- `F.linear(x, W)` with W (out, in) stored row by row, as `nn.Linear` keeps it, runs the BLAS's
  dot-product GEMV on one thread, whatever torch's thread count;
- the same W stored column by column (Wᵀ contiguous, the layout GPT-2's Conv1D keeps) runs the
  BLAS's other GEMV, which streams the matrix faster, still on one thread;
- splitting the inner dimension `in` into P parts, one per thread, turns the product into a batch
  of P smaller ones (`torch.bmm` runs a batch in parallel) whose P partial results are summed:
  every thread streams its own slice of the weights.

    column_major(w)       the same (out, in) matrix, stored column by column
    linear(x, w, b)       x·wᵀ + b: split over threads when w is column-major and x has few rows
                          (a decode step), else F.linear (a prefill, a GPU, a row-major weight)
    linear_ref(x, w, b)   F.linear: the truth

The split sums P partial products, so the result equals F.linear's up to rounding (fp32: a few
units in the last place), not bit for bit. Only the storage changes: the tensor keeps its
(out, in) shape and values, and a state dict saves and loads it as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["MAX_SPLIT_ROWS", "column_major", "is_column_major", "linear", "linear_ref", "split_parts"]

MAX_SPLIT_ROWS = 8  # beyond a few rows the product is a matrix product, which the BLAS threads well itself


def column_major(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """w (out, in) with the same values (cast to `dtype` if given), stored column by column:
    w.t() is contiguous. One copy, made directly in that layout."""
    out = torch.empty(w.shape[::-1], dtype=dtype or w.dtype, device=w.device).t()  # (in, out) storage
    return out.copy_(w)


def is_column_major(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.t().is_contiguous() and not w.is_contiguous()


def split_parts(k: int) -> int:
    """How many slices of the inner dimension k to run in parallel: torch's thread count, or the
    largest count below it that divides k."""
    parts = max(1, torch.get_num_threads())
    while k % parts:
        parts -= 1
    return parts


def linear_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) · w (out, in)ᵀ + b (out,) -> (..., out), by PyTorch."""
    return F.linear(x, w, b)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_ref`'s result; on a CPU, with w column-major and at most MAX_SPLIT_ROWS rows in x,
    computed as P partial products over slices of the inner dimension, one per thread, summed."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if x.device.type != "cpu" or rows == 0 or rows > MAX_SPLIT_ROWS or not is_column_major(w):
        return F.linear(x, w, b)
    P = split_parts(K)
    if P == 1:
        return F.linear(x, w, b)
    N = w.shape[0]
    xs = x.reshape(rows, P, K // P).transpose(0, 1)  # (M, K) -> (P, M, K/P): each part's slice of x
    parts = torch.bmm(xs, w.t().view(P, K // P, N))  # (P, M, K/P) @ (P, K/P, N) -> (P, M, N), one per thread
    y = parts.sum(0)  # (M, N): the P partial products added
    if b is not None:
        y = y + b
    return y.view(*x.shape[:-1], N)
