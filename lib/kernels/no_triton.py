"""Stand-ins for `triton` and `triton.language` where Triton is not installed.

Triton publishes wheels for Linux only. On macOS and Windows a lesson that defines a kernel
(`@triton.jit def ...`) still runs its cell with these stand-ins, and launching the kernel raises
one clear error, `NO_TRITON`, instead of a NameError deep in the cell. Nothing here computes.
"""

from __future__ import annotations

__all__ = ["NO_TRITON", "tl", "triton"]

NO_TRITON = (
    "Triton is not installed on this machine (it publishes wheels for Linux only): this cell needs "
    "Linux, or WSL2 on Windows; the lesson's other cells run here"
)


class _Kernel:
    """What `@triton.jit` returns here: the function is kept, launching it (`kernel[grid](...)`) refuses."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise RuntimeError(NO_TRITON)


class _Language:
    constexpr = int  # only read in annotations (`BLOCK: tl.constexpr`)

    def __getattr__(self, name):
        raise RuntimeError(NO_TRITON)


class _Triton:
    language = _Language()

    @staticmethod
    def jit(fn=None, **options):
        return _Kernel(fn) if fn is not None else _Kernel

    def __getattr__(self, name):
        raise RuntimeError(NO_TRITON)


triton = _Triton()
tl = triton.language
