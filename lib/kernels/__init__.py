"""Kernels: attention in Triton (lesson 05: a FlashAttention forward, `flash`, and its backward,
`flash_backward`), and the selective scan fused (lesson 06): in Triton for a GPU (`scan`) and as
a C loop for the CPU (`scan_cpu`, compiled with the machine's C compiler on first use; the
mixer's convolution and RMSNorm from the same C library in `cpu_layers`; the submodules are
imported by name, not here). `runtime`
decides how Triton runs here and is the only module that imports it; `c_build` compiles, caches,
loads and self-checks the C loops.

The scan kernels are raw launchers: their front doors, which check the arguments and give them
gradients, are `lib.scan`, `lib.conv` and `lib.norms`. Kernels import nothing from their callers.

Importing this package never compiles or launches anything, and works without a GPU and even
without triton installed (then `kernel_mode()` is "unavailable" and `flash_attention` raises a
clear error). Without a CUDA GPU the kernels run in Triton's interpreter: `import lib` sets
TRITON_INTERPRET=1 unless the variable is already set (TRITON_INTERPRET=0 switches them off).
Triton fixes its mode when first imported, so import lib before triton; otherwise the kernels
refuse to run with a message saying so.
"""

# The attention kernel's names are read from lib.kernels.flash on first use (PEP 562), so that
# importing a submodule that does not need triton (scan_cpu, which lib.course.doctor asks for its status)
# does not import triton and fix its interpreter mode early.
_FLASH_NAMES = (
    "SUPPORTED_HEAD_DIMS",
    "count_visited_tiles",
    "default_block_sizes",
    "flash_attention",
    "kernel_mode",
    "key_block_bounds",
    "require_kernel_device",
    "visited_blocks",
)
__all__ = list(_FLASH_NAMES)


def __getattr__(name: str):
    if name in ("kernel_mode", "require_kernel_device"):
        from lib.kernels import runtime

        return getattr(runtime, name)
    if name in _FLASH_NAMES:
        from lib.kernels import flash

        return getattr(flash, name)
    raise AttributeError(f"module 'lib.kernels' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
