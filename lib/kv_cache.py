"""The KV cache: keep each layer's keys and values so a decode step computes only the new token.

A causal decoder's keys and values at positions < t never change once computed (the causal mask
makes them independent of later tokens), so generation can store them and, at each step, run the
network on the single newest token: its query attends to the cached keys. This module holds the
cache as a small preallocated buffer per layer, the layout gpt-fast uses
(github.com/pytorch-labs/gpt-fast, `KVCache.update(input_pos, k, v)`):

    KVCache(B, H_kv, S_max, D)   k and v buffers (B, H_kv, S_max, D), filled left to right
    cache.update(pos, k, v)      write the new positions' k, v; return every k, v written so far

Prefill writes the prompt's T positions at once; each decode step writes one. `lib.gpt.generate
(use_cache=True)` builds one cache per layer and resets them per call.

Glossary: B batch, H_kv key/value heads, S_max positions the cache can hold, T new positions,
D head dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lib._checks import require_int, require_rank, require_tensor

__all__ = ["KVCache"]


class KVCache(nn.Module):
    """Preallocated keys and values for one attention layer."""

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        for name, value in (("batch_size", batch_size), ("n_kv_heads", n_kv_heads), ("max_len", max_len),
                            ("head_dim", head_dim)):
            require_int(name, value, minimum=1)
        shape = (batch_size, n_kv_heads, max_len, head_dim)  # (B, H_kv, S_max, D)
        # Buffers, not parameters: moved by .to() with the model, never trained, not in state_dict.
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.length = 0  # positions [0, length) hold valid keys and values

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def reset(self) -> None:
        self.length = 0  # stale values past `length` are never read, so no need to zero them

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H_kv, T, D) at positions start..start+T-1; return k, v (B, H_kv, S, D)
        for all positions 0..S-1 written so far (S = start + T).

        Positions must be written in order without gaps (start <= length): a hole would hand
        attention keys that were never computed.
        """
        require_int("start", start, minimum=0)
        for name, x in (("k", k), ("v", v)):
            require_tensor(name, x, floating=True)
            require_rank(name, x, 4, "(B, H_kv, T, D)")
            expected = (self.k.shape[0], self.k.shape[1], x.shape[2], self.k.shape[3])
            if tuple(x.shape) != expected:
                raise ValueError(f"{name} must have shape (B, H_kv, T, D) = {expected}, got {tuple(x.shape)}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v must hold the same number of positions, got {k.shape[2]} and {v.shape[2]}")
        if start > self.length:
            raise ValueError(f"start must be <= the cache length {self.length} (no gaps), got {start}")
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; writing {start}..{end - 1} would overflow it")
        self.k[:, :, start:end] = k.to(self.k.dtype)
        self.v[:, :, start:end] = v.to(self.v.dtype)
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # views, no copy

    def extra_repr(self) -> str:
        B, H_kv, S_max, D = self.k.shape
        return f"B={B}, H_kv={H_kv}, S_max={S_max}, D={D}, length={self.length}, dtype={self.k.dtype}"
