"""Input checks shared by every public `lib` function.

Each helper raises a `TypeError` or `ValueError` whose message names the argument and says what
was expected, so a student who passes the wrong thing learns what the right thing is instead of
meeting a broadcasting error three calls deeper.
"""

from __future__ import annotations

import torch


def require_tensor(name: str, x, *, floating: bool = False) -> torch.Tensor:
    """`x` must be a torch.Tensor (and, with `floating=True`, of a floating dtype)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), got {x.dtype}"
        )
    return x


def require_rank(name: str, x: torch.Tensor, rank: int, layout: str) -> None:
    """`x` must have `rank` dimensions; `layout` names them, e.g. "(B, H, T, D)"."""
    if x.dim() != rank:
        raise ValueError(f"{name} must have shape {layout} ({rank} dims), got {tuple(x.shape)}")


def require_int(name: str, value, *, minimum: int = 0) -> int:
    """`value` must be a Python int (bools refused) no smaller than `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def require_same(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], what: str) -> None:
    """All tensors must agree on `what` ("dtype" or "device")."""
    values = [getattr(t, what) for t in tensors]
    if any(v != values[0] for v in values[1:]):
        listing = ", ".join(f"{n}: {v}" for n, v in zip(names, values))
        raise ValueError(f"{', '.join(names)} must share one {what}, got {listing}")


def require_token_ids(name: str, ids, *, vocab_size: int, max_len: int, context: str, start: int = 0) -> None:
    """`ids` must be a (B, T) int64/int32 tensor of token ids in [0, vocab_size), non-empty, whose
    positions start..start+T-1 fit a context of `max_len` (`context` names that limit)."""
    require_tensor(name, ids)
    require_rank(name, ids, 2, "(B, T)")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 (or int32) tensor of token ids, got {ids.dtype}")
    B, T = ids.shape
    if B == 0 or T == 0:
        raise ValueError(f"{name} must hold at least one token, got shape {tuple(ids.shape)}")
    if start + T > max_len:
        where = f" from position {start}" if start else ""
        raise ValueError(f"{name} has T={T} tokens{where}, past the context {context}={max_len}")
    if bool((ids < 0).any()) or bool((ids >= vocab_size).any()):
        raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size}), got min {int(ids.min())}, max {int(ids.max())}")


def require_targets(name: str, t, shape: tuple, V: int, ignore_index: int = -100) -> None:
    """Token ids the loss scores against: integer, the given (B, T) shape, in [0, V) or ignore_index."""
    require_tensor(name, t)
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 (or int32) tensor of token ids, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape (B, T) = {shape}, got {tuple(t.shape)}")
    bad = (t != ignore_index) & ((t < 0) | (t >= V))
    if bool(bad.any()):
        raise ValueError(f"{name} must lie in [0, V={V}) (or be {ignore_index} to skip a position), "
                         f"got {int(t[bad][0])}")
