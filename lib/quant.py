"""Block quantisation as GGUF files store weights: Q4_1 and Q8_0, read by their definitions.

A quantised tensor is cut into blocks of 32 consecutive weights (along a row); each block stores
one or two fp16 numbers for the whole block and a small integer code per weight
(ggml's `block_q4_1` and `block_q8_0`, ggml-common.h in llama.cpp):

    Q4_1   20 bytes per 32 weights   d (fp16 scale), m (fp16 minimum), 16 bytes of 4-bit codes q
           w = d · q + m,  q in 0..15: byte j holds weight j in its low 4 bits and weight j + 16
           in its high 4 bits                                              5 bits per weight
    Q8_0   34 bytes per 32 weights   d (fp16 scale), 32 signed bytes q
           w = d · q,  q in −128..127                                      8.5 bits per weight

against 32 bits for fp32. Only 16 levels per block for Q4_1: within a block the weights are
rounded to a grid of step d between m and m + 15·d.

    dequantize_q4_1_ref   one or more Q4_1 blocks -> float32 weights, by the definition
    dequantize_q8_0_ref   the same for Q8_0
    BLOCK_BYTES           bytes per block of each type

The `gguf` package's `gguf.quants.dequantize` does the same with vectorised numpy; the tests
check the two agree on every block of the real file.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK", "BLOCK_BYTES", "bits_per_weight", "dequantize_q4_1_ref", "dequantize_q8_0_ref"]

BLOCK = 32  # weights per block, for both types
BLOCK_BYTES = {"Q4_1": 2 + 2 + BLOCK // 2, "Q8_0": 2 + BLOCK, "F32": 4 * BLOCK, "F16": 2 * BLOCK}


def bits_per_weight(kind: str) -> float:
    """Storage per weight, the block's shared numbers included: Q4_1 5.0, Q8_0 8.5, F16 16, F32 32."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"kind must be one of {sorted(BLOCK_BYTES)}, got {kind!r}")
    return 8 * BLOCK_BYTES[kind] / BLOCK


def _blocks(name: str, raw, kind: str) -> np.ndarray:
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise TypeError(
            f"{name} must be a numpy uint8 array of raw {kind} bytes, got "
            f"{type(raw).__name__}{'' if not isinstance(raw, np.ndarray) else ' of ' + str(raw.dtype)}"
        )
    size = BLOCK_BYTES[kind]
    if raw.size == 0 or raw.size % size:
        raise ValueError(f"{name} must hold whole {kind} blocks of {size} bytes, got {raw.size} bytes")
    return raw.reshape(-1, size)  # (n_blocks, bytes per block)


def dequantize_q4_1_ref(raw: np.ndarray) -> np.ndarray:
    """Q4_1 bytes (any shape, a multiple of 20 in all) -> (n_blocks · 32,) float32, block by block."""
    blocks = _blocks("raw", raw, "Q4_1")
    out = np.empty(len(blocks) * BLOCK, dtype=np.float32)
    for b, block in enumerate(blocks):
        d = float(block[0:2].view(np.float16)[0])  # the block's scale
        m = float(block[2:4].view(np.float16)[0])  # and its minimum
        codes = block[4:]  # 16 bytes, two 4-bit codes each
        for j in range(BLOCK // 2):
            low, high = int(codes[j]) & 0x0F, int(codes[j]) >> 4
            out[b * BLOCK + j] = np.float32(d) * np.float32(low) + np.float32(m)
            out[b * BLOCK + j + BLOCK // 2] = np.float32(d) * np.float32(high) + np.float32(m)
    return out


def dequantize_q8_0_ref(raw: np.ndarray) -> np.ndarray:
    """Q8_0 bytes (any shape, a multiple of 34 in all) -> (n_blocks · 32,) float32, block by block."""
    blocks = _blocks("raw", raw, "Q8_0")
    out = np.empty(len(blocks) * BLOCK, dtype=np.float32)
    for b, block in enumerate(blocks):
        d = np.float32(block[0:2].view(np.float16)[0])
        codes = block[2:].view(np.int8)  # 32 signed bytes
        out[b * BLOCK : (b + 1) * BLOCK] = d * codes.astype(np.float32)
    return out
