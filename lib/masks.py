"""Attention masks as additive matrices: the `M` in softmax(QKᵀ/√d + M)V.

Every mask here is a floating tensor holding only 0 (the query may look at this key) and −inf
(it may not). Adding it to the scores before the softmax turns "may not look" into a weight of
exactly zero, because exp(−inf) == 0. One representation for every model in the course:

    bidirectional (BERT)        all zeros
    causal (GPT)                −inf strictly above the diagonal
    padding                     −inf in the columns of padding keys, per sequence
    prefix-LM (T5 prefix, UniLM) zeros among the prefix, causal after it
    sliding window (Mistral)    causal, and only the last `window` keys
    cross-attention (T5, BART)  a decoder's T queries on an encoder's S keys: rectangular,
                                −inf only in the columns of the encoder's padding

Masks combine by addition (0 + 0 = 0, anything + −inf = −inf); `combine_masks` does it with
checks. Shapes follow the course notation: B batch, T query length, S key length (S = T except
when decoding with a KV cache), masks broadcast to (B, H, T, S).
"""

from __future__ import annotations

import torch

from lib._checks import require_int, require_rank, require_tensor, scan_values

__all__ = [
    "MASK_KINDS",
    "additive_from_bool",
    "bidirectional_mask",
    "build_mask",
    "causal_mask",
    "combine_masks",
    "cross_attention_mask",
    "padding_mask",
    "prefix_lm_mask",
    "sliding_window_mask",
]

NEG_INF = float("-inf")
MASK_KINDS = ("bidirectional", "causal", "prefix-lm", "sliding-window")


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (an additive mask holds -inf), got {dtype}")


def additive_from_bool(keep: torch.Tensor, *, dtype=torch.float32) -> torch.Tensor:
    """Turn a boolean "may attend" tensor into an additive mask: True -> 0, False -> −inf."""
    require_tensor("keep", keep)
    if keep.dtype != torch.bool:
        raise TypeError(f"keep must be a torch.bool tensor (True = may attend), got {keep.dtype}")
    _check_dtype(dtype)
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, NEG_INF)


def _positions(seq_len: int, kv_len: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions of queries (T, 1) and keys (1, S).

    With a KV cache the T queries are the *last* T of the S positions, so query i sits at
    position S - T + i (the "bottom-right" alignment FlashAttention 2.1+ uses).
    """
    require_int("seq_len", seq_len, minimum=1)
    S = seq_len if kv_len is None else require_int("kv_len", kv_len, minimum=1)
    if S < seq_len:
        raise ValueError(
            f"kv_len must be >= seq_len (queries are the last positions), got kv_len={S} < seq_len={seq_len}"
        )
    q_pos = torch.arange(S - seq_len, S, device=device).unsqueeze(1)  # (T, 1)
    k_pos = torch.arange(S, device=device).unsqueeze(0)  # (1, S)
    return q_pos, k_pos


def bidirectional_mask(seq_len: int, *, kv_len: int | None = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """(T, S) zeros: every query sees every key (BERT's encoder, before padding)."""
    _check_dtype(dtype)
    q_pos, k_pos = _positions(seq_len, kv_len, device)
    return torch.zeros(q_pos.shape[0], k_pos.shape[1], dtype=dtype, device=device)


def causal_mask(seq_len: int, *, kv_len: int | None = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """(T, S) additive causal mask: query i sees keys at positions <= its own.

    For T == S this is `torch.full((T, T), -inf).triu(diagonal=1)`.
    """
    _check_dtype(dtype)
    q_pos, k_pos = _positions(seq_len, kv_len, device)
    return additive_from_bool(k_pos <= q_pos, dtype=dtype)


def prefix_lm_mask(seq_len: int, prefix_len: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """(T, T) prefix-LM mask: the first `prefix_len` tokens see each other both ways; every later
    token sees the whole prefix and, causally, the tokens after it up to itself."""
    _check_dtype(dtype)
    require_int("prefix_len", prefix_len, minimum=0)
    if prefix_len > seq_len:
        raise ValueError(f"prefix_len must be <= seq_len, got prefix_len={prefix_len} > seq_len={seq_len}")
    q_pos, k_pos = _positions(seq_len, None, device)
    return additive_from_bool((k_pos <= q_pos) | (k_pos < prefix_len), dtype=dtype)


def sliding_window_mask(
    seq_len: int, window: int, *, causal: bool = True, kv_len: int | None = None, device=None, dtype=torch.float32
) -> torch.Tensor:
    """(T, S) local attention: each query sees `window` keys, itself included.

    causal=True (Mistral's sliding window): keys in (i - window, i].
    causal=False (Longformer's local attention): keys with |i - j| < window, on both sides.
    """
    _check_dtype(dtype)
    require_int("window", window, minimum=1)
    q_pos, k_pos = _positions(seq_len, kv_len, device)
    distance = q_pos - k_pos  # (T, S): > 0 for keys in the past
    keep = (distance >= 0) & (distance < window) if causal else distance.abs() < window
    return additive_from_bool(keep, dtype=dtype)


def padding_mask(attention_mask: torch.Tensor, *, dtype=torch.float32) -> torch.Tensor:
    """(B, T) tensor of 1 (real token) / 0 (padding) -> (B, 1, 1, T) additive mask on the keys.

    Only the key columns are masked: a padding *query* still computes an output (from the real
    keys) that later layers and the loss ignore. The Hugging Face `attention_mask` convention.
    """
    require_tensor("attention_mask", attention_mask)
    require_rank("attention_mask", attention_mask, 2, "(B, T)")
    _check_dtype(dtype)
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        values = attention_mask
    else:
        values = attention_mask.to(torch.int64)
    if scan_values() and not bool(((values == 0) | (values == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
    return additive_from_bool(values.bool(), dtype=dtype)[:, None, None, :]  # (B, T) -> (B, 1, 1, T)


def cross_attention_mask(encoder_attention_mask: torch.Tensor, tgt_len: int, *, dtype=torch.float32) -> torch.Tensor:
    """(B, 1, T, S) mask of a decoder's T queries on an encoder's S keys (T5's and BART's
    cross-attention): no causality (the whole source is known before decoding starts), and −inf
    only in the columns of the encoder's padding (`encoder_attention_mask`, (B, S), 1 = real).

    The same numbers as `padding_mask(encoder_attention_mask)` broadcast to T rows; T and S are
    independent, so the mask is rectangular.
    """
    require_int("tgt_len", tgt_len, minimum=1)
    keys = padding_mask(encoder_attention_mask, dtype=dtype)  # (B, 1, 1, S)
    return keys.expand(-1, -1, tgt_len, -1).contiguous()


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Add additive masks (None entries are skipped); the result broadcasts like their sum.

    The sum of 0/−inf masks is again a 0/−inf mask: a key is blocked if any mask blocks it.
    """
    present = [m for m in masks if m is not None]
    for i, m in enumerate(present):
        require_tensor(f"masks[{i}]", m, floating=True)
    if not present:
        return None
    try:
        shape = torch.broadcast_shapes(*(m.shape for m in present))
    except RuntimeError as err:
        shapes = ", ".join(str(tuple(m.shape)) for m in present)
        raise ValueError(f"masks must broadcast to one shape, got {shapes}") from err
    out = torch.zeros(shape, dtype=present[0].dtype, device=present[0].device)
    for m in present:
        out = out + m.to(out.dtype)
    return out


def build_mask(
    kind: str, seq_len: int, *, prefix_len: int = 0, window: int = 1, device=None, dtype=torch.float32
) -> torch.Tensor:
    """The mask zoo by name (one of `MASK_KINDS`): a (T, T) additive mask."""
    if kind == "bidirectional":
        return bidirectional_mask(seq_len, device=device, dtype=dtype)
    if kind == "causal":
        return causal_mask(seq_len, device=device, dtype=dtype)
    if kind == "prefix-lm":
        return prefix_lm_mask(seq_len, prefix_len, device=device, dtype=dtype)
    if kind == "sliding-window":
        return sliding_window_mask(seq_len, window, device=device, dtype=dtype)
    raise ValueError(f"kind must be one of {MASK_KINDS}, got {kind!r}")
