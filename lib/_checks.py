"""Input checks shared by every public `lib` function.

Each helper raises a `TypeError` or `ValueError` whose message names the argument and says what
was expected, so a student who passes the wrong thing learns what the right thing is instead of
meeting a broadcasting error three calls deeper.

Two kinds of check. Checks of types, shapes, dtypes and devices read metadata only. Value scans
(NaN in logits, token ids out of range, a mask row with nothing visible) read the data: on a GPU
each is a host synchronisation, which stalls the GPU's queue and defeats CUDA graphs and
`torch.compile`. Both run at a public door when a call starts from the caller's data, and both are
skipped inside the loops `lib` drives itself over data it has already checked (a decode loop:
`inputs_checked()`; a callback into the caller's code runs checked again: `caller_code()`), so
that a decoded token costs a handful of `checking()` calls, not a hundred checks. A door reads
`if checking(): _check_...(...)` and then its math. Debug mode (`lib.debug(True)`, or
ONEMASK_DEBUG=1 in the environment) runs every check everywhere, inside those loops too.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
from contextlib import contextmanager

import torch

_debug = os.environ.get("ONEMASK_DEBUG", "0") not in ("", "0")
_local = threading.local()


def debug(on: bool | None = None) -> bool:
    """Debug mode: with `on` True, value scans run everywhere, also inside lib's own loops; False
    turns it off; None leaves it. Returns the mode now. Starts on when ONEMASK_DEBUG=1 is set."""
    global _debug
    if on is not None:
        if not isinstance(on, bool):
            raise TypeError(f"on must be a bool or None, got {type(on).__name__}")
        _debug = on
    return _debug


@contextmanager
def _trusted(value: bool):
    """Value scans skipped (True) or run (False) inside the block, as they were after it."""
    before = getattr(_local, "trusted", False)
    _local.trusted = value
    try:
        yield
    finally:
        _local.trusted = before


def inputs_checked():
    """Inside this block doors skip their checks and value scans (unless in debug mode): for a loop
    that lib runs over values it checked at its door, such as generating token after token."""
    return _trusted(True)


def caller_code():
    """Inside this block checks and value scans run again: for the caller's code that a checked loop
    calls back (a progress callback), whose arguments lib has not checked."""
    return _trusted(False)


def checking() -> bool:
    """Whether a door checks its arguments here: always in debug mode, else outside `inputs_checked`."""
    return _debug or not getattr(_local, "trusted", False)


# Whether a value scan should run here: where `checking()` says (a door that checks scans too).
scan_values = checking


def require_tensor(name: str, x, *, floating: bool = False) -> torch.Tensor:
    """`x` must be a torch.Tensor (and, with `floating=True`, of a floating dtype)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), got {x.dtype}")
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


def require_real(
    name: str, value, *, above: float | None = None, at_least: float | None = None, note: str = ""
) -> float:
    """`value` must be a finite real number (bools refused), > `above` and >= `at_least` where
    given; returned as a float. `note` says why, e.g. " (10000.0 in the paper and Llama)"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number{note}, got {type(value).__name__}")
    if not (math.isfinite(value) and (above is None or value > above) and (at_least is None or value >= at_least)):
        bound = f" > {above:g}" if above is not None else f" >= {at_least:g}" if at_least is not None else ""
        raise ValueError(f"{name} must be a finite number{bound}{note}, got {value!r}")
    return float(value)


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
    if scan_values() and (bool((ids < 0).any()) or bool((ids >= vocab_size).any())):
        raise ValueError(
            f"{name} must lie in [0, vocab_size={vocab_size}), got min {int(ids.min())}, max {int(ids.max())}"
        )


def require_targets(name: str, t, shape: tuple, V: int, ignore_index: int = -100) -> None:
    """Token ids the loss scores against: integer, the given (B, T) shape, in [0, V) or ignore_index."""
    require_tensor(name, t)
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 (or int32) tensor of token ids, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape (B, T) = {shape}, got {tuple(t.shape)}")
    if not scan_values():
        return
    bad = (t != ignore_index) & ((t < 0) | (t >= V))
    if bool(bad.any()):
        raise ValueError(
            f"{name} must lie in [0, V={V}) (or be {ignore_index} to skip a position), got {int(t[bad][0])}"
        )


def require_left_padded(name: str, mask: torch.Tensor) -> None:
    """A (B, S) padding mask's values: only 0 and 1, every row's zeros before its ones, the last real."""
    keep = mask.bool()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} must hold only 1 (token) and 0 (padding), as an integer or bool tensor")
    if bool((keep[:, :-1] & ~keep[:, 1:]).any()):
        raise ValueError(
            f"{name} must be left-padded: in each row every 0 comes before every 1 "
            "(right padding would put new tokens after the padding)"
        )
    if not bool(keep[:, -1].all()):
        raise ValueError(f"{name}: every row needs at least one real token, at the last position")


def require_state_dict_fits(ours: dict, theirs: dict, config_name: str) -> None:
    """A checkpoint's state dict (`theirs`, already renamed to the model's names) must have
    exactly the model's keys (`ours`) with the same shapes; else a ValueError listing the
    missing keys, the unexpected keys and the shape mismatches, naming the config class."""
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    mismatched = [
        f"{k}: checkpoint {tuple(theirs[k].shape)} vs model {tuple(ours[k].shape)}"
        for k in sorted(set(ours) & set(theirs))
        if theirs[k].shape != ours[k].shape
    ]
    if missing or unexpected or mismatched:
        parts = [
            f"{what} ({len(items)}): {items[:6]}{' …' if len(items) > 6 else ''}"
            for what, items in (
                ("missing keys", missing),
                ("unexpected keys", unexpected),
                ("shape mismatches", mismatched),
            )
            if items
        ]
        raise ValueError(f"the state dict does not fit this {config_name}: " + "; ".join(parts))
