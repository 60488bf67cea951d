"""Tiny, deterministic stand-ins for worked examples before a real model is loaded.

`simple_tokenize` splits a sentence into word and punctuation tokens; `toy_qkv` turns token
strings into queries, keys and values with seeded random projections. A token's embedding is
seeded by a hash of its text (not Python's salted `hash`), so "the" gets the same vector in every
sentence, in every run, on every machine; a sinusoidal position code (Vaswani et al. 2017, §3.5)
keeps two copies of a word apart. Lesson 02 replaces all of this with a real tokenizer and a real
pretrained encoder.
"""

from __future__ import annotations

import hashlib
import math
import re

import torch

from lib._checks import require_int

__all__ = ["PAD", "pad_tokens", "simple_tokenize", "sinusoidal_positions", "toy_qkv"]

PAD = "[PAD]"
_TOKEN = re.compile(r"\[PAD\]|\w+|[^\w\s]")


def simple_tokenize(text: str) -> list[str]:
    """Lower-cased words and single punctuation marks: "The cat sat." -> ["the", "cat", "sat", "."]."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return [t if t == PAD else t.lower() for t in _TOKEN.findall(text)]


def pad_tokens(tokens: list[str], n_pad: int, side: str = "right") -> tuple[list[str], torch.Tensor]:
    """Add `n_pad` PAD tokens on one side; returns the tokens and the (1, T) 0/1 attention mask."""
    require_int("n_pad", n_pad, minimum=0)
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    pads = [PAD] * n_pad
    out = pads + list(tokens) if side == "left" else list(tokens) + pads
    keep = torch.tensor([[0 if t == PAD else 1 for t in out]], dtype=torch.int64)  # (1, T)
    return out, keep


def _token_seed(token: str, seed: int) -> int:
    digest = hashlib.sha256(f"{seed}:{token}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def sinusoidal_positions(T: int, C: int) -> torch.Tensor:
    """(T, C) sinusoidal position codes: sin on even channels, cos on odd ones."""
    require_int("T", T, minimum=0)
    require_int("C", C, minimum=2)
    pos = torch.arange(T, dtype=torch.float64).unsqueeze(1)  # (T, 1)
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, C, 2, dtype=torch.float64) / C)  # (C/2,)
    pe = torch.zeros(T, C, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)[:, : C // 2]
    return pe.float()


def toy_qkv(tokens: list[str], d_k: int = 16, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values, each (1, 1, T, d_k), for a list of token strings.

    x_t = embedding(token_t) + 0.5·position_t with unit-variance embeddings; q = x W_q etc. with
    W ~ N(0, 1/d_k), so every entry of q and k has variance ≈ 1 and QKᵀ/√d_k has variance ≈ 1.
    """
    if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, str) for t in tokens):
        raise TypeError("tokens must be a list of str")
    if len(tokens) == 0:
        raise ValueError("tokens must hold at least one token")
    require_int("d_k", d_k, minimum=2)
    require_int("seed", seed, minimum=0)
    rows = []
    for tok in tokens:
        g = torch.Generator().manual_seed(_token_seed(tok, seed))
        rows.append(torch.randn(d_k, generator=g))
    x = torch.stack(rows) + 0.5 * sinusoidal_positions(len(tokens), d_k)  # (T, d_k)
    g = torch.Generator().manual_seed(seed)
    w_q, w_k, w_v = (torch.randn(d_k, d_k, generator=g) / math.sqrt(d_k) for _ in range(3))
    q, k, v = ((x @ w).view(1, 1, len(tokens), d_k) for w in (w_q, w_k, w_v))  # (T, d_k) -> (1, 1, T, d_k)
    return q, k, v
