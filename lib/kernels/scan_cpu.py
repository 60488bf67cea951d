"""The selective scan as one fused loop in C, for the CPU (lesson 06): the state stays in cache.

The chunked PyTorch scan (`lib.ssm.selective_scan` with impl="chunked") removes the reference's
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

Threads split the (sequence, channel) rows between them (`threads`, default torch's thread count),
and each row's result is the same whatever the split, bit for bit.

Building: on first use the C file is compiled with the machine's C compiler (`$CC`, else cc, gcc
or clang) into a shared library cached under ~/.cache/onemask (or $ONEMASK_CACHE), keyed by the
source, the compiler and the flags, then loaded with ctypes and checked against a few steps of the
recurrence computed here in Python. That takes about half a second once per machine. With gcc on
x86-64 Linux and an AVX2 CPU it uses glibc's vector exponentials (libmvec); elsewhere the same
loop with scalar exp. Where no compiler works (or ONEMASK_CPU_KERNEL=0 is set), nothing fails:
`cpu_kernel_status()` says why, and `lib.ssm.selective_scan` uses its chunked scan instead.

    selective_scan_cpu   same arguments and returns as lib.ssm.selective_scan_ref, plus `threads`
    causal_conv1d_cpu    the mixer's causal depthwise convolution (lib.ssm.causal_conv1d_ref), as a
                         loop with its backward: PyTorch's grouped conv1d costs milliseconds per
                         call at this course's sizes, most of it in the backward
    cpu_kernel_status    "compiled ..." or "unavailable: <why>"; builds on first call

Differentiable by its own fused backward, in the same C file: when a gradient will be needed the
forward also keeps the state entering every K-th position (K = CHECKPOINT_EVERY), and the backward
recomputes each segment of K states from its checkpoint into a buffer that stays in cache, then
walks it backwards in time, accumulating the gradients of x, Δ, A, B, C and the initial state (the
official kernel's recomputation, Mamba §3.3.2). No (B, L, D, N) tensor is stored for autograd:
the memory kept is B·D·N·L/K numbers. Computes in fp32, or fp64 when given fp64 (half inputs are
read as fp32, like the other scans).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lib._checks import require_int

__all__ = ["causal_conv1d_cpu", "cpu_kernel_available", "cpu_kernel_status", "selective_scan_cpu"]

SOURCE = Path(__file__).with_name("scan_cpu.c")
BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd")
VECTOR_EXP_FLAGS = ("-mavx2", "-mfma", "-DONEMASK_LIBMVEC")  # gcc, x86-64 Linux, an AVX2 CPU: glibc's vector exp
OPENMP_FLAGS = ("-fopenmp",)  # threads from PyTorch's own OpenMP pool (see scan_cpu.c); else Python threads
MIN_WORK_PER_THREAD = 1 << 16  # B·D·L·N multiply-adds below which a second thread costs more than it saves
CHECKPOINT_EVERY = 64  # K: the forward keeps the state entering every K-th position for the backward
BACKWARD_BLOCK = 16  # channels one backward unit walks together: K states and decays of them stay in cache

_lock = threading.Lock()
_library = None  # the loaded ctypes library, once built
_status: str | None = None  # why it is or is not available; None until the first attempt
_built_flags: tuple[str, ...] = ()  # the flags of the library in use
_pool: ThreadPoolExecutor | None = None


# --------------------------------------------------------------------------- building
def _compiler() -> str | None:
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _compiler_version(cc: str) -> str:
    """What `cc --version` prints (all of it; "" if it fails)."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _wants_vector_exp(version: str) -> bool:
    """glibc's libmvec has AVX2 expf/exp on x86-64 Linux; gcc calls them from the simd loop.
    (gcc installed as `cc` names itself "cc" but keeps the FSF's copyright line.)"""
    text = version.lower()
    is_gcc = ("gcc" in text or "free software foundation" in text) and "clang" not in text
    return (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64") and is_gcc
            and _cpu_has_avx2_fma())


def _cpu_has_avx2_fma() -> bool:
    """The CPU itself runs AVX2 and FMA instructions (its flags in /proc/cpuinfo). Not ATen's
    capability, which ATEN_CPU_CAPABILITY lowers on purpose (the course's perturbed test runs) while
    the CPU, and this loop's code, stay the same; where cpuinfo is unreadable, ATen's detection."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _cache_dir() -> Path:
    chosen = os.environ.get("ONEMASK_CACHE")
    base = Path(chosen) if chosen else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onemask"
    for candidate in (base, Path(tempfile.gettempdir()) / f"onemask-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise OSError(f"no writable cache directory (tried {base} and the temporary directory)")


def _compile(cc: str, version: str, flags: tuple[str, ...]) -> Path:
    """The shared library for these flags: from the cache, or compiled into it (atomically)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), version.encode(), " ".join(flags).encode(),
                                     platform.machine().encode(), sys.platform.encode()])).hexdigest()[:16]
    target = _cache_dir() / f"scan_cpu-{key}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        out = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed: {(out.stderr or out.stdout).strip()[-400:]}")
        os.replace(tmp, target)  # atomic: a concurrent build writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def _torch_uses_gomp() -> bool:
    """PyTorch parallelises with GNU OpenMP (libgomp.so.1, which an -fopenmp library from gcc shares)."""
    return "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux")


def _load(path: Path):
    library = ctypes.CDLL(str(path))  # ctypes.CDLL releases the GIL during calls: threads run in parallel
    for name in ("onemask_scan_f32", "onemask_scan_f64", "onemask_scan_bwd_f32", "onemask_scan_bwd_f64"):
        for fn_name in (name, name + "_omp"):
            if fn_name.endswith("_omp") and not hasattr(library, fn_name):
                continue  # built without OpenMP
            fn = getattr(library, fn_name)
            fn.restype = ctypes.c_int
            pointers = 9 if "bwd" not in name else 14
            fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * (6 if "bwd" not in name else 7)
    for suffix in ("f32", "f64"):
        fwd, bwd = getattr(library, f"onemask_conv_{suffix}"), getattr(library, f"onemask_conv_{suffix}_bwd")
        fwd.restype = bwd.restype = ctypes.c_int
        fwd.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
        bwd.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 5
    return library


def _self_check(library) -> str | None:
    """A few steps of the recurrence in plain Python against the library, in both dtypes: None if
    they agree, else what went wrong (a miscompiled vector exp would show here)."""
    import math

    b, l, d, n = 2, 5, 3, 5  # N = 5: not a multiple of the vector width
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(b, l, d, generator=g), torch.rand(b, l, d, generator=g)
    A, B, C = -torch.rand(d, n, generator=g) - 0.1, torch.randn(b, l, n, generator=g), torch.randn(b, l, n, generator=g)
    for dtype in (torch.float32, torch.float64):
        got = _run(library, *(t.to(dtype) for t in (x, dt, A, B, C)), None, False, 2)[0]
        for bi in range(b):
            for di in range(d):
                h = [0.0] * n
                for t in range(l):
                    h = [math.exp(dt[bi, t, di].item() * A[di, k].item()) * h[k] + dt[bi, t, di].item()
                         * x[bi, t, di].item() * B[bi, t, k].item() for k in range(n)]
                    want = sum(C[bi, t, k].item() * h[k] for k in range(n))
                    if not abs(got[bi, t, di].item() - want) <= 1e-5 * (1 + abs(want)):
                        return (f"self-check failed ({dtype}): y[{bi}, {t}, {di}] = {got[bi, t, di].item()!r}, "
                                f"the recurrence gives {want!r}")
    return None


def _build() -> None:
    global _library, _status, _built_flags
    if os.environ.get("ONEMASK_CPU_KERNEL", "1") == "0":
        _status = "unavailable: switched off (ONEMASK_CPU_KERNEL=0)"
        return
    cc = _compiler()
    if cc is None:
        _status = ("unavailable: no C compiler found (set CC, or install gcc or clang); "
                   if os.environ.get("CC") is None else f"unavailable: CC={os.environ['CC']!r} is not an executable; ")
        _status += "the chunked PyTorch scan is used instead"
        return
    version = _compiler_version(cc)
    vector_options = [VECTOR_EXP_FLAGS, ()] if _wants_vector_exp(version) else [()]
    # best first: each option that fails to compile, load or self-check falls back to the next
    attempts = [BASE_FLAGS + v + o for v in vector_options for o in ((OPENMP_FLAGS, ()) if _torch_uses_gomp() else ((),))]
    problems = []
    for flags in attempts:
        try:
            library = _load(_compile(cc, version, flags))
            problem = _self_check(library)
        except Exception as err:  # any failure to build, load or run it means: not here (the reason is kept)
            problem = f"{type(err).__name__}: {err}"
        if problem is None:
            _library = library
            _built_flags = flags
            vector = "vector exp (glibc libmvec, AVX2)" if _has_vector_exp() else "scalar exp"
            threads = "PyTorch's OpenMP threads" if hasattr(library, "onemask_scan_f32_omp") else "Python threads"
            name = version.splitlines()[0] if version else Path(cc).name
            _status = f"compiled: {name}, {' '.join(f for f in flags if f.startswith('-O'))}, {vector}, {threads}"
            return
        problems.append(problem)
    _status = "unavailable: " + "; then ".join(problems) + "; the chunked PyTorch scan is used instead"


def _ensure_built():
    with _lock:
        if _status is None:
            _build()
    return _library


def cpu_kernel_status() -> str:
    """Whether the fused CPU scan is usable here, and how it was built ("compiled: ...") or why
    not ("unavailable: ..."). Builds (or loads from the cache) on the first call."""
    _ensure_built()
    return _status


def cpu_kernel_available(*, fast: bool = False) -> bool:
    """True when `selective_scan_cpu` can run here (see `cpu_kernel_status` for why not). With
    fast=True, only if it was built with vector exponentials: with scalar exp the loop spends most
    of its time in exp and measured slower than the chunked PyTorch scan on this course's machine,
    so lib.ssm.selective_scan's impl="auto" asks for this."""
    return _ensure_built() is not None and (_has_vector_exp() or not fast)


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


def _suffix(t: torch.Tensor) -> str:
    """The C entry points' dtype suffix: f64 for float64 tensors, else f32."""
    return "f64" if t.dtype == torch.float64 else "f32"


def _pointers(*tensors) -> list:
    """Data pointers for ctypes, None (NULL) where a tensor is absent."""
    return [None if t is None else t.data_ptr() for t in tensors]


def _threads_for(threads: int, units: int, work: int) -> int:
    return max(1, min(threads, units, work // MIN_WORK_PER_THREAD))


def _call(library, name: str, pointers: list, sizes: tuple, units: int, threads: int) -> None:
    """Run `name` over units 0 .. units-1 on `threads` threads: in C with OpenMP (the *_omp entry
    point), else from Python threads, each given a contiguous range. Raises if a buffer failed."""
    if hasattr(library, name + "_omp"):  # units split the same way, on PyTorch's OpenMP threads
        codes = [getattr(library, name + "_omp")(*pointers, *sizes, units, threads)]
    else:
        fn = getattr(library, name)
        cuts = [units * k // threads for k in range(threads + 1)]
        args = [(*pointers, *sizes, cuts[k], cuts[k + 1]) for k in range(threads)]
        futures = [_thread_pool(threads - 1).submit(fn, *a) for a in args[1:]] if threads > 1 else []
        codes = [fn(*args[0])] + [f.result() for f in futures]  # the inputs stay referenced until all are done
    if any(codes):
        raise MemoryError("selective_scan_cpu could not allocate its working buffers")


def _checkpoint_every(L: int) -> int:
    """K, the positions between two states the forward keeps for the backward: fewer states kept
    (B·D·N·L/K numbers) against a longer segment recomputed into each thread's buffer (K·BLOCK·N)."""
    return min(L, CHECKPOINT_EVERY)


def _run(library, x, dt, A, B, C, h0, return_state: bool, threads: int, checkpoints: int | None = None):
    """y (B, L, D), the final state (B, D, N) or None, and (with `checkpoints` = K) the states
    entering positions 0, K, 2K, ... (B, D, ceil(L/K), N), in x's dtype (fp32 or fp64; all inputs
    already of that dtype). Splits the B·D rows into `threads` contiguous ranges."""
    x, dt, A, B, C = (t.contiguous() for t in (x, dt, A, B, C))
    h0 = None if h0 is None else h0.contiguous()
    b, l, d = x.shape
    n = A.shape[1]
    y = torch.empty_like(x)
    hl = torch.empty(b, d, n, dtype=x.dtype) if return_state else None
    k = checkpoints or l
    hc = torch.empty(b, d, -(-l // k), n, dtype=x.dtype) if checkpoints else None
    rows = b * d
    _call(library, f"onemask_scan_{_suffix(x)}", _pointers(x, dt, A, B, C, h0, y, hl, hc), (k, l, d, n), rows,
          _threads_for(threads, rows, rows * l * n))
    return y, hl, hc


def _run_backward(library, x, dt, A, B, C, hc, k: int, gy, ghl, threads: int):
    """The gradients (x, Δ, A, B, C, h0) of the scan without the skip, from the forward's
    checkpoints hc (kept every k positions) and the gradients of y (B, L, D) and of the final
    state (B, D, N, or None)."""
    gy = gy.to(x.dtype).contiguous()
    ghl = None if ghl is None else ghl.to(x.dtype).contiguous()
    b, l, d = x.shape
    n = A.shape[1]
    nblk = -(-d // BACKWARD_BLOCK)
    gx, gdt = torch.empty_like(x), torch.empty_like(x)
    gAp, gh0 = torch.empty(b, d, n, dtype=x.dtype), torch.empty(b, d, n, dtype=x.dtype)
    gBp, gCp = torch.empty(b, nblk, l, n, dtype=x.dtype), torch.empty(b, nblk, l, n, dtype=x.dtype)
    units = b * nblk
    pointers = _pointers(x, dt, A, B, C, hc, gy, ghl, gx, gdt, gAp, gBp, gCp, gh0)
    _call(library, f"onemask_scan_bwd_{_suffix(x)}", pointers, (k, BACKWARD_BLOCK, l, d, n), units,
          _threads_for(threads, units, 3 * b * d * l * n))
    return gx, gdt, gAp.sum(0), gBp.sum(1), gCp.sum(1), gh0


class _CpuScan(torch.autograd.Function):
    """The fused loop with its own fused backward: apply(x, dt, A, B, C, h0, threads), all of one
    working dtype (fp32 or fp64) -> y (B, L, D) without the skip, and the final state (B, D, N).
    The forward keeps a state every CHECKPOINT_EVERY positions when a gradient will be needed."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, h0, threads):
        x, dt, A, B, C = (t.contiguous() for t in (x, dt, A, B, C))  # the C loops read these layouts
        every = _checkpoint_every(x.shape[1]) if any(ctx.needs_input_grad[:6]) else None
        y, hl, hc = _run(_library, x, dt, A, B, C, h0, True, threads, every)
        if every:
            ctx.save_for_backward(x, dt, A, B, C, hc)
        ctx.threads, ctx.every = threads, every
        return y, hl

    @staticmethod
    def backward(ctx, gy, ghl):
        x, dt, A, B, C, hc = ctx.saved_tensors
        if gy is None:
            gy = torch.zeros_like(x)
        grads = _run_backward(_library, x, dt, A, B, C, hc, ctx.every, gy, ghl, ctx.threads)
        return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:6])), None)


def _scan(x, delta, A, B, C, D, h0, return_state: bool, threads: int | None = None):
    """selective_scan_cpu without the input checks: lib.ssm calls it after its own."""
    from lib.ssm import _finish, _work_dtype

    _require_cpu(x.device)
    if _ensure_built() is None:
        raise RuntimeError(f"selective_scan_cpu is {_status}; use lib.ssm.selective_scan")
    wt = _work_dtype(x, delta, A, B, C, D, h0)
    x_, dt_, A_, B_, C_ = (t.to(wt) for t in (x, delta, A, B, C))  # casts autograd sees through
    y, hl = _CpuScan.apply(x_, dt_, A_, B_, C_, None if h0 is None else h0.to(wt),
                           torch.get_num_threads() if threads is None else threads)
    return _finish(y, x_, D, hl, return_state, x.dtype)  # the skip D ⊙ x, by autograd


def _require_cpu(device: torch.device) -> None:
    if device.type != "cpu":
        raise ValueError(f"selective_scan_cpu runs on CPU tensors, got device {device}; on a GPU use "
                         "lib.kernels.scan.selective_scan_triton or lib.ssm.selective_scan")


def selective_scan_cpu(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor | None = None, *, h0: torch.Tensor | None = None, return_state: bool = False,
                       threads: int | None = None):
    """The selective scan by one fused C loop: the same arguments and result as
    `lib.ssm.selective_scan_ref` (up to rounding), differentiable, for CPU tensors.

    x, delta (B, L, D); A (D, N), negative; B, C (B, L, N); D (D,) or None; h0 (B, D, N) or None
    -> y (B, L, D) in x's dtype, and with `return_state` also the final state (B, D, N) in the
    working dtype (fp32, or fp64 if any input is fp64). `threads`: how many threads share the rows
    (default torch.get_num_threads()); the result does not depend on it. Raises RuntimeError,
    saying why, where the kernel could not be built (then use lib.ssm.selective_scan).
    """
    from lib.ssm import _check_scan_inputs

    _check_scan_inputs(x, delta, A, B, C, D, h0)
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be a bool, got {type(return_state).__name__}")
    if threads is not None:
        require_int("threads", threads, minimum=1)
    return _scan(x, delta, A, B, C, D, h0, return_state, threads)


# --------------------------------------------------------------------------- the mixer's convolution
class _CpuConv(torch.autograd.Function):
    """apply(x (B, T, E), wt (K, E), bias (E,) or None, state (B, E, K - 1) or None, threads), all
    contiguous and of one dtype (fp32 or fp64) -> y (B, T, E); gradients for all four."""

    @staticmethod
    def forward(ctx, x, wt, bias, state, threads):
        b, t, e = x.shape
        k = wt.shape[0]
        y = torch.empty_like(x)
        _call(_library, f"onemask_conv_{_suffix(x)}", _pointers(x, state, wt, bias, y), (t, e, k), b,
              _threads_for(threads, b, b * t * e * k))
        ctx.save_for_backward(x, wt, state)
        ctx.threads, ctx.has_bias = threads, bias is not None
        return y

    @staticmethod
    def backward(ctx, gy):
        x, wt, state = ctx.saved_tensors
        b, t, e = x.shape
        k = wt.shape[0]
        gy = gy.to(x.dtype).contiguous()
        gx = torch.empty_like(x)
        gstate = None if state is None else torch.zeros_like(state)
        gwp, gbp = torch.empty(b, k, e, dtype=x.dtype), torch.empty(b, e, dtype=x.dtype)
        pointers = _pointers(x, state, wt, gy, gx, gstate, gwp, gbp)
        _call(_library, f"onemask_conv_{_suffix(x)}_bwd", pointers, (t, e, k), b,
              _threads_for(ctx.threads, b, 2 * b * t * e * k))
        need = ctx.needs_input_grad
        return (gx if need[0] else None, gwp.sum(0) if need[1] else None,
                gbp.sum(0) if need[2] and ctx.has_bias else None, gstate if need[3] else None, None)


def causal_conv1d_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      state: torch.Tensor | None = None, *, threads: int | None = None) -> torch.Tensor:
    """The Mamba mixer's causal depthwise convolution by a plain C loop, differentiable: the same
    result as `lib.ssm.causal_conv1d_ref` (up to rounding), for CPU tensors.

    x (B, T, E); weight (E, 1, K) as nn.Conv1d(E, E, K, groups=E) holds it, or (E, K); bias (E,) or
    None; state (B, E, K − 1), the inputs before x, or None (zeros) -> y (B, T, E) with
    y[:, t] = bias + Σ_k weight[:, k] ⊙ (state, x)[t + k]: position t sees t − K + 1 .. t.
    Computes in fp32 (fp64 if any input is fp64) and returns x's dtype.
    """
    from lib.ssm import _check_conv_inputs

    _check_conv_inputs(x, weight, bias, state)
    if threads is not None:
        require_int("threads", threads, minimum=1)
    return _conv(x, weight, bias, state, threads)


def _conv(x, weight, bias, state, threads=None):
    """causal_conv1d_cpu without the checks: lib.ssm calls it after its own."""
    from lib.ssm import _work_dtype

    _require_cpu(x.device)
    if _ensure_built() is None:
        raise RuntimeError(f"causal_conv1d_cpu is {_status}; use lib.ssm.causal_conv1d")
    wt = _work_dtype(x, weight, bias, state)
    w2 = weight.reshape(weight.shape[0], weight.shape[-1])  # (E, K)
    y = _CpuConv.apply(x.to(wt).contiguous(), w2.to(wt).t().contiguous(),
                       None if bias is None else bias.to(wt).contiguous(),
                       None if state is None else state.to(wt).contiguous(),
                       torch.get_num_threads() if threads is None else threads)
    return y.to(x.dtype)
