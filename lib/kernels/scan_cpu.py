"""The selective scan as one fused loop in C, for the CPU (lesson 06): the state stays in cache.
The same C library holds the rest of a Mamba layer that costs more in PyTorch than it should, the
mixer's convolution and RMSNorm, launched by `lib.kernels.cpu_layers` with the helpers below.

The chunked PyTorch scan (`lib.scan.selective_scan` with impl="chunked") removes the reference's
Python step per position, but each of its tensor operations still reads and writes a slice of the
(B, L, D, N) state sequence, and on a CPU those passes through memory, not the arithmetic, are what
it spends its time on. The fix is the fused GPU kernel's (lib/kernels/scan.py, and the official
Mamba kernel's "hardware-aware" scan): keep the state of a block of channels in fast memory for
the whole sequence, read Δ, x, B, C once, write y once. On a CPU, fast memory is the L1 cache and
the kernel is a plain loop, written in C (`scan_cpu.c`, beside this file), whose inner loop over
the N state entries is vectorised, exponentials included:

    for t in 0..L-1:  for d in block:  for n in 0..N-1:      (the n loop: 8 floats at a time)
        h[d, n] = exp(Δ[t, d] · A[d, n]) · h[d, n] + Δ[t, d] · x[t, d] · B[t, n]
        y[t, d] += C[t, n] · h[d, n]

A Mamba mixer hands the scan more than Δ: the raw step before its bias and softplus, the skip D
and the gate z, as the official `selective_scan_fn(u, delta, A, B, C, D, z, delta_bias,
delta_softplus)` takes them. The loop applies them too (Δ = softplus(delta + bias) as it reads a
position, (y + D ⊙ x) ⊙ silu(z) as it writes one), which removes a dozen small PyTorch operations
over (B, L, D) per layer and their backward passes: in a training step of lesson 08's Mamba they
cost more than the scan's own forward.

Threads split the (sequence, channel) rows between them (`threads`, default torch's thread count),
and each row's result is the same whatever the split, bit for bit.

Building (`lib.kernels.c_build`): on first use the C file is compiled with the machine's C compiler
into a cached shared library, loaded with ctypes and checked against a few steps of the
recurrence computed here in Python (`_self_check`). That takes about half a second once per machine. With gcc on
x86-64 Linux and an AVX2 CPU it uses glibc's vector exp and log (libmvec); elsewhere the same
loops with scalar calls. Where no compiler works (or ONEMASK_CPU_KERNEL=0 is set), nothing fails:
`cpu_kernel_status()` says why, and `lib.scan.selective_scan` uses its chunked scan instead.

    scan                 the fused scan (raw launcher): the front door with the checks is
                         lib.scan.selective_scan_cpu, with the arguments of lib.scan.selective_scan_ref
    cpu_kernel_status    "compiled ..." or "unavailable: <why>"; builds on first call
    ensure_built         the loaded library (built on first call), or None where it is unavailable
    call_entry_point     run a C entry point over its units on threads (with data_pointers,
                         dtype_suffix, threads_for, require_cpu: shared with lib.kernels.cpu_layers)

Differentiable by its own fused backward, in the same C file: when a gradient will be needed the
forward also keeps the state entering every K-th position (K = CHECKPOINT_EVERY), and the backward
recomputes each segment of K states from its checkpoint into a buffer that stays in cache, then
walks it backwards in time, accumulating the gradients of x, Δ (and through softplus the raw
delta and its bias), A, B, C, the skip D, the gate z and the initial state (the official kernel's
recomputation, Mamba §3.3.2). No (B, L, D, N) tensor is stored for autograd:
the memory kept is B·D·N·L/K numbers. Computes in fp32, or fp64 when given fp64 (half inputs are
read as fp32, like the other scans).
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lib.kernels import c_build
from lib.kernels.runtime import work_dtype

__all__ = [
    "call_entry_point",
    "cpu_kernel_available",
    "cpu_kernel_status",
    "data_pointers",
    "dtype_suffix",
    "ensure_built",
    "require_cpu",
    "scan",
    "threads_for",
]

SOURCE = Path(__file__).with_name("scan_cpu.c")  # built by lib.kernels.c_build
MIN_WORK_PER_THREAD = 1 << 16  # B·D·L·N multiply-adds below which a second thread costs more than it saves
CHECKPOINT_EVERY = 64  # K: the forward keeps the state entering every K-th position for the backward
BACKWARD_BLOCK = 16  # channels one backward unit walks together: K states and decays of them stay in cache

_lock = threading.Lock()
_library = None  # the loaded ctypes library, once built
_status: str | None = None  # why it is or is not available; None until the first attempt
_built_flags: tuple[str, ...] = ()  # the flags of the library in use
_pool: ThreadPoolExecutor | None = None


# --------------------------------------------------------------------------- building (lib.kernels.c_build)
# The C entry points: name -> (how many pointers, the sizes' C types). Each has a range form
# `name(pointers, sizes, begin, end)` and, built with OpenMP, `name_omp(pointers, sizes, total, threads)`.
_I64, _F64 = ctypes.c_int64, ctypes.c_double
ENTRY_POINTS = {
    "scan": (13, (_I64,) * 5),
    "scan_bwd": (20, (_I64,) * 6),
    "conv": (6, (_I64,) * 4),
    "conv_bwd": (9, (_I64,) * 3),
    "rms": (4, (_F64, _I64)),
    "rms_bwd": (6, (_I64,) * 2),
}


def _self_check(library) -> str | None:
    """A few steps of the recurrence in plain Python against the library, in both dtypes, with the
    softplus, skip and gate taken in: None if they agree, else what went wrong (a miscompiled vector
    exp or log would show here; 19 channels run the vector loops over channels and their remainder)."""
    import math

    b, l, d, n = 2, 5, 19, 5  # N = 5: not a multiple of the vector width
    g = torch.Generator().manual_seed(0)
    x, dt, z = (torch.randn(b, l, d, generator=g) * 3 for _ in range(3))  # softplus and SiLU on both sides of 0
    A, B, C = -torch.rand(d, n, generator=g) - 0.1, torch.randn(b, l, n, generator=g), torch.randn(b, l, n, generator=g)
    D, bias = torch.randn(d, generator=g), torch.randn(d, generator=g)
    for dtype in (torch.float32, torch.float64):
        got = _run(library, *(t.to(dtype) for t in (x, dt, A, B, C, D, bias, z)), True, None, False, 2)[0]
        for bi in range(b):
            for di in range(d):
                h = [0.0] * n
                for t in range(l):
                    v = dt[bi, t, di].item() + bias[di].item()
                    delta = v if v > 20 else math.log1p(math.exp(v))
                    h = [
                        math.exp(delta * A[di, k].item()) * h[k] + delta * x[bi, t, di].item() * B[bi, t, k].item()
                        for k in range(n)
                    ]
                    zv = z[bi, t, di].item()
                    want = (
                        (sum(C[bi, t, k].item() * h[k] for k in range(n)) + D[di].item() * x[bi, t, di].item())
                        * zv
                        / (1 + math.exp(-zv))
                    )
                    if not abs(got[bi, t, di].item() - want) <= 1e-5 * (1 + abs(want)):
                        return (
                            f"self-check failed ({dtype}): y[{bi}, {t}, {di}] = {got[bi, t, di].item()!r}, "
                            f"the recurrence gives {want!r}"
                        )
    return None


def ensure_built():
    global _library, _status, _built_flags
    with _lock:
        if _status is None:
            built = c_build.build(
                SOURCE, ENTRY_POINTS, _self_check, fallback="; the chunked PyTorch scan is used instead"
            )
            _library, _status, _built_flags = built.library, built.status, built.flags
    return _library


def cpu_kernel_status() -> str:
    """Whether the fused CPU scan is usable here, and how it was built ("compiled: ...") or why
    not ("unavailable: ..."). Builds (or loads from the cache) on the first call."""
    ensure_built()
    return _status


def cpu_kernel_available(*, fast: bool = False) -> bool:
    """True when the C loops can run here (see `cpu_kernel_status` for why not). With
    fast=True, only if it was built with vector exponentials: with scalar exp the loop spends most
    of its time in exp and measured slower than the chunked PyTorch scan on this course's machine,
    so lib.scan.selective_scan's impl="auto" asks for this."""
    return ensure_built() is not None and (_has_vector_exp() or not fast)


def _has_vector_exp() -> bool:
    """The library in use was built with vector exponentials (it beats the chunked scan; scalar exp may not)."""
    return "-DONEMASK_LIBMVEC" in _built_flags


# --------------------------------------------------------------------------- running
def _thread_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < workers:
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="onemask-scan")
    return _pool


def _forget_pool_after_fork():
    global _pool
    _pool = None  # a forked child has the parent's pool object but none of its threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def dtype_suffix(t: torch.Tensor) -> str:
    """The C entry points' dtype suffix: f64 for float64 tensors, else f32."""
    return "f64" if t.dtype == torch.float64 else "f32"


def data_pointers(*tensors) -> list:
    """Data pointers for ctypes, None (NULL) where a tensor is absent."""
    return [None if t is None else t.data_ptr() for t in tensors]


def threads_for(threads: int, units: int, work: int) -> int:
    return max(1, min(threads, units, work // MIN_WORK_PER_THREAD))


def call_entry_point(library, name: str, pointers: list, sizes: tuple, units: int, threads: int) -> None:
    """Run `name` over units 0 .. units-1 on `threads` threads: in C with OpenMP (the *_omp entry
    point), else from Python threads, each given a contiguous range. Raises if a buffer failed."""
    fn = getattr(library, name)
    if threads == 1:
        codes = [fn(*pointers, *sizes, 0, units)]
    elif hasattr(library, name + "_omp"):  # units split the same way, on PyTorch's OpenMP threads
        codes = [getattr(library, name + "_omp")(*pointers, *sizes, units, threads)]
    else:
        cuts = [units * k // threads for k in range(threads + 1)]
        args = [(*pointers, *sizes, cuts[k], cuts[k + 1]) for k in range(threads)]
        futures = [_thread_pool(threads - 1).submit(fn, *a) for a in args[1:]]
        codes = [fn(*args[0])] + [f.result() for f in futures]  # the inputs stay referenced until all are done
    if any(codes):
        raise MemoryError(f"{name} could not allocate its working buffers")


def _checkpoint_every(L: int) -> int:
    """K, the positions between two states the forward keeps for the backward: fewer states kept
    (B·D·N·L/K numbers) against a longer segment recomputed into each thread's buffer (K·BLOCK·N)."""
    return min(L, CHECKPOINT_EVERY)


def _run(
    library,
    x,
    dt,
    A,
    B,
    C,
    D,
    bias,
    z,
    softplus: bool,
    h0,
    return_state: bool,
    threads: int,
    checkpoints: int | None = None,
    keep_pre_gate: bool = False,
):
    """out (B, L, D) = (scan + D ⊙ x) ⊙ silu(z) with Δ = softplus(dt + bias) (or dt + bias), the
    final state (B, D, N) or None, with `checkpoints` = K the states entering positions 0, K, 2K, ...
    (B, D, ceil(L/K), N), and with `keep_pre_gate` y before the gate (B, L, D), all in x's dtype
    (fp32 or fp64; every input already of that dtype, D and bias (D,) tensors, z None or (B, L, D)).
    Splits the B·D rows into `threads` contiguous ranges."""
    x, dt, A, B, C, D, bias = (t.contiguous() for t in (x, dt, A, B, C, D, bias))
    z = None if z is None else z.contiguous()
    h0 = None if h0 is None else h0.contiguous()
    b, l, d = x.shape
    n = A.shape[1]
    y = torch.empty_like(x)
    ypre = torch.empty_like(x) if keep_pre_gate and z is not None else None
    hl = torch.empty(b, d, n, dtype=x.dtype) if return_state else None
    k = checkpoints or l
    hc = torch.empty(b, d, -(-l // k), n, dtype=x.dtype) if checkpoints else None
    rows = b * d
    call_entry_point(
        library,
        f"onemask_scan_{dtype_suffix(x)}",
        data_pointers(x, dt, A, B, C, h0, D, bias, z, y, ypre, hl, hc),
        (int(softplus), k, l, d, n),
        rows,
        threads_for(threads, rows, rows * l * n),
    )
    return y, hl, hc, ypre


def _run_backward(library, x, dt, A, B, C, D, bias, z, ypre, softplus: bool, hc, k: int, gy, ghl, threads: int):
    """The gradients (x, dt, A, B, C, D, z or None, h0) of `_run`'s out, from the forward's
    checkpoints hc (kept every k positions) and y before the gate (ypre, with z), and the gradients
    of out (B, L, D) and of the final state (B, D, N, or None). The bias's gradient is gdt summed
    over (B, L)."""
    gy = gy.to(x.dtype).contiguous()
    ghl = None if ghl is None else ghl.to(x.dtype).contiguous()
    b, l, d = x.shape
    n = A.shape[1]
    nblk = -(-d // BACKWARD_BLOCK)
    gx, gdt = torch.empty_like(x), torch.empty_like(x)
    gz = None if z is None else torch.empty_like(x)
    gAp, gh0 = torch.empty(b, d, n, dtype=x.dtype), torch.empty(b, d, n, dtype=x.dtype)
    gBp, gCp = torch.empty(b, nblk, l, n, dtype=x.dtype), torch.empty(b, nblk, l, n, dtype=x.dtype)
    gDp = torch.empty(b, d, dtype=x.dtype)
    units = b * nblk
    pointers = data_pointers(x, dt, A, B, C, D, bias, z, ypre, hc, gy, ghl, gx, gdt, gAp, gBp, gCp, gDp, gz, gh0)
    call_entry_point(
        library,
        f"onemask_scan_bwd_{dtype_suffix(x)}",
        pointers,
        (int(softplus), k, BACKWARD_BLOCK, l, d, n),
        units,
        threads_for(threads, units, 3 * b * d * l * n),
    )
    return gx, gdt, gAp.sum(0), gBp.sum(1), gCp.sum(1), gDp.sum(0), gz, gh0


class _CpuScan(torch.autograd.Function):
    """The fused loop with its own fused backward: apply(x, dt, A, B, C, D, bias, z, h0, softplus,
    threads), tensors of one working dtype (fp32 or fp64), D and bias (D,), z and h0 optional ->
    out (B, L, D) and the final state (B, D, N). The forward keeps a state every CHECKPOINT_EVERY
    positions (and, with z, y before the gate) when a gradient will be needed."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, bias, z, h0, softplus, threads):
        x, dt, A, B, C, D, bias = (t.contiguous() for t in (x, dt, A, B, C, D, bias))  # the layouts the C loops read
        z = None if z is None else z.contiguous()
        grad = any(ctx.needs_input_grad[:9])
        every = _checkpoint_every(x.shape[1]) if grad else None
        y, hl, hc, ypre = _run(_library, x, dt, A, B, C, D, bias, z, softplus, h0, True, threads, every, grad)
        if grad:
            ctx.save_for_backward(x, dt, A, B, C, D, bias, z, ypre, hc)
        ctx.threads, ctx.every, ctx.softplus = threads, every, softplus
        return y, hl

    @staticmethod
    def backward(ctx, gy, ghl):
        x, dt, A, B, C, D, bias, z, ypre, hc = ctx.saved_tensors
        if gy is None:
            gy = torch.zeros_like(x)
        gx, gdt, gA, gB, gC, gD, gz, gh0 = _run_backward(
            _library, x, dt, A, B, C, D, bias, z, ypre, ctx.softplus, hc, ctx.every, gy, ghl, ctx.threads
        )
        grads = (gx, gdt, gA, gB, gC, gD, gdt.sum((0, 1)) if ctx.needs_input_grad[6] else None, gz, gh0)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:9])), None, None)


def scan(
    x,
    delta,
    A,
    B,
    C,
    D,
    h0,
    return_state: bool,
    threads: int | None = None,
    *,
    z=None,
    delta_bias=None,
    delta_softplus: bool = False,
):
    """The raw launcher of the fused scan, on checked CPU inputs (the shapes of
    `lib.scan.selective_scan_ref`): y in x's dtype (and the final state). The front door, with the
    checks, is `lib.scan.selective_scan_cpu`."""
    require_cpu(x.device)
    if ensure_built() is None:
        raise RuntimeError(f"selective_scan_cpu is {_status}; use lib.scan.selective_scan")
    wt = work_dtype(x, delta, A, B, C, D, h0, z, delta_bias)
    d = x.shape[-1]
    # casts autograd sees through; an absent skip or bias is a zero vector to the loop
    D_, bias_ = (x.new_zeros(d, dtype=wt) if t is None else t.to(wt) for t in (D, delta_bias))
    y, hl = _CpuScan.apply(
        *(t.to(wt) for t in (x, delta, A, B, C)),
        D_,
        bias_,
        None if z is None else z.to(wt),
        None if h0 is None else h0.to(wt),
        delta_softplus,
        torch.get_num_threads() if threads is None else threads,
    )
    y = y.to(x.dtype)
    return (y, hl) if return_state else y


def require_cpu(device: torch.device) -> None:
    if device.type != "cpu":
        raise ValueError(
            f"selective_scan_cpu runs on CPU tensors, got device {device}; on a GPU use "
            "lib.scan.selective_scan_triton or lib.scan.selective_scan"
        )
