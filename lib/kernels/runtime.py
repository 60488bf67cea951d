"""The kernels' runtime: the one place that decides how Triton runs here, and imports it.

Without a CUDA GPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1), so every
lesson works on a CPU-only laptop: correct, slow, small sizes. Triton fixes the mode of its own
library functions (tl.max, tl.cdiv, ...) when it is first imported, so the variable must be set
before anything imports triton: `import lib` imports this module, which sets it (an explicit
TRITON_INTERPRET=0 is respected, and then the kernels are unavailable on a CPU). Importing this
module does not import triton; `load_triton()` does, on first use.

    load_triton             (triton, triton.language), or (None, None) where Triton is not installed
    kernel_mode             "compiled" (CUDA), "interpreter" or "unavailable"
    require_kernel_device   the mode, once sure a kernel can run on a device; else a clear error
    LOG2E, cdiv             what every kernel's launcher needs
    work_dtype              fp32, or fp64 when given fp64: what the scans compute in

Kernel modules (`flash`, `scan`, `scan_cpu`) import this module and `lib._checks`, nothing else from
`lib`: their callers (`lib.attention`, `lib.scan`, `lib.conv`, `lib.norms`) check the arguments and
import them, never the reverse (tests/project/test_project.py checks the import graph).
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "dot_launch_opts",
    "LOG2E",
    "cdiv",
    "kernel_mode",
    "load_triton",
    "require_kernel_device",
    "use_interpreter_without_gpu",
    "work_dtype",
]

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x · LOG2E), and exp2 is the cheaper instruction


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: how many blocks of b cover a."""
    return -(-a // b)


def use_interpreter_without_gpu() -> None:
    """Set TRITON_INTERPRET=1 where there is no CUDA GPU, unless the variable is already set."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


use_interpreter_without_gpu()

_loaded: tuple | None = None  # (triton, tl, interpreted) once load_triton has run


def _probe():  # decorated by load_triton: its type says which mode triton.jit is in
    pass


def load_triton():
    """(triton, triton.language), imported on first call; (None, None) where Triton is not installed
    (it publishes wheels for Linux only: the kernels then refuse to launch and say so)."""
    global _loaded
    if _loaded is None:
        use_interpreter_without_gpu()
        try:
            import triton
            import triton.language as tl
        except ImportError:  # pragma: no cover - exercised in a subprocess where triton is hidden
            _loaded = (None, None, False)
        else:
            _loaded = (triton, tl, type(triton.jit(_probe)).__name__ == "InterpretedFunction")
    return _loaded[:2]


def _mixed_modes() -> bool:
    """Whether triton was imported before TRITON_INTERPRET=1 was set: its own library functions
    (tl.max, tl.cdiv, ...) are then compiled-mode and fail inside our interpreted kernels."""
    triton, tl = load_triton()
    if triton is None or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    return type(tl.standard.sum).__name__ != "InterpretedFunction"


def kernel_mode() -> str:
    """How the kernels run here: "compiled" (CUDA), "interpreter" (TRITON_INTERPRET=1 was set
    before triton was imported), or "unavailable" (no triton, or neither of the above)."""
    triton, _ = load_triton()
    if triton is None:
        return "unavailable"
    if _loaded[2]:
        return "interpreter"
    return "compiled" if torch.cuda.is_available() else "unavailable"


def require_kernel_device(device: torch.device, caller: str, fallback: str) -> str:
    """The kernel mode ("compiled" or "interpreter"), once it is sure a kernel can run here on
    tensors on `device`; otherwise an error that says why and what to do. `caller` names the
    public function, `fallback` the PyTorch path to use instead."""
    triton, _ = load_triton()
    if triton is None:
        raise RuntimeError(f"{caller} needs the `triton` package (pip install triton); use {fallback} without it")
    if _mixed_modes():
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so the interpreter cannot run "
            "these kernels. Restart the Python kernel and import lib (or lib.kernels) before "
            "importing triton, or start Python with TRITON_INTERPRET=1 in the environment"
        )
    mode = kernel_mode()
    if mode == "interpreter":
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the Triton interpreter runs on CPU tensors, got device {device}")
    elif device.type != "cuda":
        raise RuntimeError(
            f"{caller} got tensors on {device} but the kernels are compiled for CUDA only. "
            "To run them on the CPU, set the environment variable TRITON_INTERPRET=1 before "
            "importing lib.kernels (e.g. os.environ['TRITON_INTERPRET'] = '1' in the first cell), "
            f"or use {fallback}"
        )
    return mode


def work_dtype(*tensors) -> torch.dtype:
    """fp32, or fp64 if any tensor is fp64 (None entries skipped): what the scans and the CPU loops
    compute in, whatever the inputs' dtype; they never compute in half precision."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def dot_launch_opts(D: int, dtype: torch.dtype) -> dict:
    """Launch options of a kernel whose tiles multiply with tl.dot (the attention kernels), head dim D."""
    # fp32 on a GPU: tl.dot would round its inputs to tf32 (10-bit mantissa); ask for full fp32.
    precision = "ieee" if dtype == torch.float32 else "tf32"
    opts = dict(DOT_PRECISION=precision)
    if kernel_mode() == "compiled":
        opts.update(num_warps=4 if D <= 64 else 8, num_stages=2)
    return opts
