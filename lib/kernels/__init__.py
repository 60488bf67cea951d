"""Attention kernels in Triton (lesson 05): a FlashAttention forward and backward.

Importing this package never compiles or launches anything, and works without a GPU and even
without triton installed (then `kernel_mode()` is "unavailable" and `flash_attention` raises a
clear error). Without a CUDA GPU the kernels run in Triton's interpreter: `import lib` sets
TRITON_INTERPRET=1 unless the variable is already set (TRITON_INTERPRET=0 switches them off).
Triton fixes its mode when first imported, so import lib before triton; otherwise the kernels
refuse to run with a message saying so.
"""

from lib.kernels.flash import (
    SUPPORTED_HEAD_DIMS,
    count_visited_tiles,
    default_block_sizes,
    flash_attention,
    kernel_mode,
    key_block_bounds,
    require_kernel_device,
    visited_blocks,
)

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "count_visited_tiles",
    "default_block_sizes",
    "flash_attention",
    "kernel_mode",
    "key_block_bounds",
    "require_kernel_device",
    "visited_blocks",
]
