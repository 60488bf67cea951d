"""The KV cache: keep each layer's keys and values so a decode step computes only the new token.

A causal decoder's keys and values at positions < t never change once computed (the causal mask
makes them independent of later tokens), so generation can store them and, at each step, run the
network on the single newest token: its query attends to the cached keys. This module holds the
cache as a small preallocated buffer per layer, the layout gpt-fast uses
(github.com/pytorch-labs/gpt-fast, `KVCache.update(input_pos, k, v)`):

    KVCache(B, H_kv, S_max, D)   k and v buffers (B, H_kv, S_max, D), filled left to right
    cache.update(pos, k, v)      write the new positions' k, v; return every k, v written so far

Prefill writes the prompt's T positions at once; each decode step writes one. `lib.decode.generate
(use_cache=True)` builds one cache per layer (the model's `new_caches`) for each call.

How much memory the cache takes (lesson 04). Every layer keeps one key and one value vector per
KV head, per cached position, per sequence:

    kv_cache_bytes = 2 (K and V) × bytes_per_elem × L × B × S × H_kv × D

`ModelShape` holds the numbers of a model's config.json that set this, and its weight count;
`PUBLIC_CONFIGS` a few published ones, with full multi-head (MHA), grouped-query (GQA) and
multi-query (MQA) attention. `max_batch` and `max_context` invert the formula: the most sequences,
or the longest context, whose cache fits beside the weights in a given memory. They count weights
and cache only (no activations, workspace or fragmentation), so they are upper bounds.

Units: memory sizes are decimal, 1 GB = 10⁹ bytes (`GPU_MEMORY_GB` reads its labels so);
1 GiB = 2³⁰ bytes. 34,359,738,368 bytes = 34.4 GB = 32 GiB; `format_bytes` writes both.

Glossary: B batch, H query heads, H_kv key/value heads, L layers, S positions cached per sequence,
S_max positions the cache can hold, T new positions, D head dim.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn as nn

from lib._checks import require_int
from lib._door import door

__all__ = [
    "DTYPE_BYTES",
    "GB",
    "GIB",
    "GPU_MEMORY_GB",
    "KVCache",
    "ModelShape",
    "PUBLIC_CONFIGS",
    "bytes_per_element",
    "dtype_bytes",
    "estimate_params",
    "format_bytes",
    "gpu_memory_bytes",
    "kv_cache_bytes",
    "max_batch",
    "max_context",
    "weight_bytes",
]


class KVCache(nn.Module):
    """Preallocated keys and values for one attention layer."""

    @door(batch_size="int >= 1", n_kv_heads="int >= 1", max_len="int >= 1", head_dim="int >= 1")
    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_len, head_dim)  # (B, H_kv, S_max, D)
        # Buffers, not parameters: moved by .to() with the model, never trained, not in state_dict.
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.length = 0  # positions [0, length) hold valid keys and values

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds allocated: keys and values for max_len positions (it is preallocated,
        so this does not change as positions are written)."""
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        self.length = 0  # stale values past `length` are never read, so no need to zero them

    @door(
        start="int >= 0",
        k="float (self.batch_size, self.n_kv_heads, T, self.head_dim)",
        v="float (self.batch_size, self.n_kv_heads, T, self.head_dim)",
        where={
            "start <= self.length": "start must be <= the cache length {self.length} (no gaps), got {start}",
            "start + T <= self.max_len": "the cache holds {self.max_len} positions; writing {start}..{start + T - 1} "
            "would overflow it",
        },
    )
    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H_kv, T, D) at positions start..start+T-1; return k, v (B, H_kv, S, D)
        for all positions 0..S-1 written so far (S = start + T).

        Positions must be written in order without gaps (start <= length): a hole would hand
        attention keys that were never computed.
        """
        end = start + k.shape[2]
        self.k[:, :, start:end] = k.to(self.k.dtype)
        self.v[:, :, start:end] = v.to(self.v.dtype)
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # views, no copy

    def extra_repr(self) -> str:
        B, H_kv, S_max, D = self.k.shape
        return f"B={B}, H_kv={H_kv}, S_max={S_max}, D={D}, length={self.length}, dtype={self.k.dtype}"


# --------------------------------------------------------------------------- memory arithmetic
GB = 10**9  # decimal gigabyte
GIB = 2**30  # binary gibibyte, 7.4% more

# Bytes per stored number. int4 packs two 4-bit values into one byte, hence 0.5; a count of
# bytes is rounded up (an odd number of int4 values still occupies a whole last byte).
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int4": 0.5}

# GPU presets, each label's number read as decimal GB (10⁹ bytes). That reading is conservative:
# these cards hold about the label's number in GiB (an H200 shows about 140 GiB), and what a
# program can use is somewhat less than what the card holds, so a real card has a few percent
# more room than these answers assume.
GPU_MEMORY_GB = {"24 GB (RTX 4090)": 24, "80 GB (A100/H100)": 80, "141 GB (H200)": 141}


def _require_bytes_per_elem(name: str, value) -> Fraction:
    """A positive, finite number of bytes per element, returned exactly (0.5 stays 1/2)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number of bytes per element (2 for fp16, 0.5 for int4; "
            f"bytes_per_element('fp16') converts a dtype name), got {type(value).__name__}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return Fraction(value) if isinstance(value, numbers.Rational) else Fraction(float(value))


def _ceil_bytes(n_elems: int, bytes_per_elem: Fraction) -> int:
    return math.ceil(n_elems * bytes_per_elem)  # exact: Fraction arithmetic, no float rounding


def bytes_per_element(dtype_name: str) -> float:
    """Bytes one number takes in `dtype_name`, a key of DTYPE_BYTES ("int4" -> 0.5)."""
    if not isinstance(dtype_name, str):
        raise TypeError(f"dtype_name must be a str, one of {list(DTYPE_BYTES)}, got {type(dtype_name).__name__}")
    if dtype_name not in DTYPE_BYTES:
        raise ValueError(f"dtype_name must be one of {list(DTYPE_BYTES)}, got {dtype_name!r}")
    return float(DTYPE_BYTES[dtype_name])


def dtype_bytes(dtype) -> float:
    """Bytes per element of a torch.dtype (torch.float16 -> 2) or of a DTYPE_BYTES name ("int4" -> 0.5)."""
    if isinstance(dtype, torch.dtype):
        return float(torch.empty((), dtype=dtype).element_size())
    if isinstance(dtype, str):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be a torch.dtype or one of {list(DTYPE_BYTES)}, got {dtype!r}")
        return float(DTYPE_BYTES[dtype])
    raise TypeError(f"dtype must be a torch.dtype or a name like 'fp16', got {type(dtype).__name__}")


def gpu_memory_bytes(gpu: str) -> int:
    """Bytes of memory of a GPU_MEMORY_GB preset, in decimal GB: "80 GB (A100/H100)" -> 80 * 10⁹."""
    if not isinstance(gpu, str):
        raise TypeError(f"gpu must be a str, one of {list(GPU_MEMORY_GB)}, got {type(gpu).__name__}")
    if gpu not in GPU_MEMORY_GB:
        raise ValueError(f"gpu must be one of {list(GPU_MEMORY_GB)}, got {gpu!r}")
    return GPU_MEMORY_GB[gpu] * GB


def kv_cache_bytes(
    n_layers: int, batch: int, seq_len: int, n_kv_heads: int, head_dim: int, bytes_per_elem: float = 2
) -> int:
    """Bytes of the KV cache: 2 (K and V) × bytes_per_elem × L × B × S × H_kv × D.

    The sizes are ints >= 1; `bytes_per_elem` any positive number (0.5 for int4, two values
    packed per byte). The count is exact and rounded up to whole bytes.
    """
    for name, value in (
        ("n_layers", n_layers),
        ("batch", batch),
        ("seq_len", seq_len),
        ("n_kv_heads", n_kv_heads),
        ("head_dim", head_dim),
    ):
        require_int(name, value, minimum=1)
    bpe = _require_bytes_per_elem("bytes_per_elem", bytes_per_elem)
    n_elems = 2 * n_layers * batch * seq_len * n_kv_heads * head_dim  # K and V, each L × (B, H_kv, S, D)
    return _ceil_bytes(n_elems, bpe)


def weight_bytes(n_params: int, bytes_per_elem: float = 2) -> int:
    """Bytes of `n_params` weights stored at `bytes_per_elem` each, rounded up to whole bytes."""
    require_int("n_params", n_params, minimum=1)
    return _ceil_bytes(n_params, _require_bytes_per_elem("bytes_per_elem", bytes_per_elem))


def estimate_params(n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, *, mlp_ratio: int = 4) -> int:
    """A rough weight count for a decoder of this shape, for shapes no config publishes.

    Per layer, with d = H·D: the Q and output projections 2·d², the K and V projections
    2·d·H_kv·D, an MLP of width mlp_ratio·d 2·mlp_ratio·d². For MHA and mlp_ratio 4 that is the
    familiar 12·L·d². Embeddings, norms and biases are left out, and real MLPs differ (Llama's
    gated MLP, Llama-3's large vocabulary): PUBLIC_CONFIGS carry the exact counts.
    """
    for name, value in (
        ("n_layers", n_layers),
        ("n_heads", n_heads),
        ("n_kv_heads", n_kv_heads),
        ("head_dim", head_dim),
        ("mlp_ratio", mlp_ratio),
    ):
        require_int(name, value, minimum=1)
    d = n_heads * head_dim
    return n_layers * (2 * d * d + 2 * d * n_kv_heads * head_dim + 2 * mlp_ratio * d * d)


def format_bytes(n_bytes: int, *, binary: bool = True) -> str:
    """A byte count in decimal and binary units: 34_359_738_368 -> "34.4 GB (32.0 GiB)";
    with binary=False only the decimal one, "34.4 GB"."""
    require_int("n_bytes", n_bytes, minimum=0)
    if not isinstance(binary, bool):
        raise TypeError(f"binary must be a bool, got {type(binary).__name__}")
    decimal = _scaled(n_bytes, 1000, ("B", "kB", "MB", "GB", "TB", "PB", "EB"))
    if not binary:
        return decimal
    in_binary = _scaled(n_bytes, 1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"))
    return decimal if decimal == in_binary else f"{decimal} ({in_binary})"


def _scaled(n: int, base: int, units: tuple[str, ...]) -> str:
    i = 0
    while i + 1 < len(units) and round(n / base**i, 1) >= base:  # 999.96 kB is written 1.0 MB
        i += 1
    return f"{n:,} B" if i == 0 else f"{n / base**i:,.1f} {units[i]}"


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder's config that set its KV cache and weight memory.

    `n_kv_heads` divides `n_heads`: each KV head serves n_heads / n_kv_heads query heads.
    `source` says where the numbers come from.
    """

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_model: int
    n_params: int
    source: str

    def __post_init__(self):
        for name in ("name", "source"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model", "n_params"):
            require_int(name, getattr(self, name), minimum=1)
        if self.n_kv_heads > self.n_heads:
            raise ValueError(f"n_kv_heads must be <= n_heads = {self.n_heads}, got {self.n_kv_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads must divide n_heads = {self.n_heads} (each KV head serves a whole group "
                f"of query heads), got {self.n_kv_heads}"
            )

    @property
    def attention(self) -> str:
        """ "MHA" (one KV head per query head), "MQA" (one KV head in all) or "GQA" (in between)."""
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    def cache_bytes(self, batch: int, seq_len: int, bytes_per_elem: float = 2) -> int:
        """KV cache bytes for `batch` sequences of `seq_len` positions (see kv_cache_bytes)."""
        return kv_cache_bytes(self.n_layers, batch, seq_len, self.n_kv_heads, self.head_dim, bytes_per_elem)

    def weight_bytes(self, bytes_per_elem: float = 2) -> int:
        """Bytes of the weights at `bytes_per_elem` each."""
        return weight_bytes(self.n_params, bytes_per_elem)


def _config(
    name: str, repo: str, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, d_model: int, n_params: int
) -> ModelShape:
    source = (
        f"config.json of {repo} (Hugging Face Hub); n_params counted from the architecture that "
        f"config builds in transformers, tied embeddings counted once"
    )
    return ModelShape(name, n_layers, n_heads, n_kv_heads, head_dim, d_model, n_params, source)


PUBLIC_CONFIGS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _config("GPT-2", "openai-community/gpt2", 12, 12, 12, 64, 768, 124_439_808),
        _config("OPT-13B", "facebook/opt-13b", 40, 40, 40, 128, 5120, 12_853_473_280),
        _config("Llama-2-7B", "meta-llama/Llama-2-7b-hf", 32, 32, 32, 128, 4096, 6_738_415_616),
        _config("Llama-2-70B", "meta-llama/Llama-2-70b-hf", 80, 64, 8, 128, 8192, 68_976_648_192),
        _config("Mistral-7B-v0.1", "mistralai/Mistral-7B-v0.1", 32, 32, 8, 128, 4096, 7_241_732_096),
        _config("Llama-3-8B", "meta-llama/Meta-Llama-3-8B", 32, 32, 8, 128, 4096, 8_030_261_248),
        _config("Falcon-7B", "tiiuae/falcon-7b", 32, 71, 1, 64, 4544, 6_921_720_704),
    )
}


def _require_model(model) -> ModelShape:
    if not isinstance(model, ModelShape):
        raise TypeError(f"model must be a ModelShape (e.g. PUBLIC_CONFIGS['Llama-2-7B']), got {type(model).__name__}")
    return model


def _free_bytes(model: ModelShape, memory_bytes: int, weight_bytes_per_elem, bytes_per_elem) -> tuple[int, Fraction]:
    """Bytes left for the cache once the weights are in, and the cache's exact bytes per element."""
    require_int("memory_bytes", memory_bytes, minimum=0)
    bpe = _require_bytes_per_elem("bytes_per_elem", bytes_per_elem)
    w_bpe = (
        bpe
        if weight_bytes_per_elem is None
        else _require_bytes_per_elem("weight_bytes_per_elem", weight_bytes_per_elem)
    )
    return memory_bytes - _ceil_bytes(model.n_params, w_bpe), bpe


def max_batch(
    model: ModelShape,
    *,
    seq_len: int,
    memory_bytes: int,
    bytes_per_elem: float = 2,
    weight_bytes_per_elem: float | None = None,
) -> int:
    """The largest batch whose weights + KV cache at `seq_len` fit in `memory_bytes`; 0 if none.

    The cache is stored at `bytes_per_elem`, the weights at `weight_bytes_per_elem` (default: the
    same). Only weights and cache are counted: an upper bound on what a server can run.
    """
    _require_model(model)
    require_int("seq_len", seq_len, minimum=1)
    free, bpe = _free_bytes(model, memory_bytes, weight_bytes_per_elem, bytes_per_elem)
    per_sequence = 2 * model.n_layers * seq_len * model.n_kv_heads * model.head_dim * bpe
    # kv(B) = ceil(B · per_sequence) <= free  <=>  B · per_sequence <= free, as free is an int
    return max(0, math.floor(free / per_sequence))


def max_context(
    model: ModelShape,
    *,
    batch: int,
    memory_bytes: int,
    bytes_per_elem: float = 2,
    weight_bytes_per_elem: float | None = None,
) -> int:
    """The longest context (positions per sequence) whose weights + KV cache for `batch`
    sequences fit in `memory_bytes`; 0 if none. The model's trained context limit is not applied."""
    _require_model(model)
    require_int("batch", batch, minimum=1)
    free, bpe = _free_bytes(model, memory_bytes, weight_bytes_per_elem, bytes_per_elem)
    per_position = 2 * model.n_layers * batch * model.n_kv_heads * model.head_dim * bpe
    return max(0, math.floor(free / per_position))
