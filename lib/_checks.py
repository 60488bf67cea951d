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


def require_attention_mask(attention_mask, shape: tuple, device) -> torch.Tensor:
    """A decoder's padding mask: (B, S) of 1 (token) / 0 (padding), or True/False, left-padded,
    on `device`; returns it as bool. Its values are scanned only where `scan_values()` says."""
    require_tensor("attention_mask", attention_mask)
    if tuple(attention_mask.shape) != shape:
        raise ValueError(
            f"attention_mask must have shape (B, start + T) = {shape}, covering cached positions "
            f"too, got {tuple(attention_mask.shape)}"
        )
    if attention_mask.device != device:
        raise ValueError(f"attention_mask must be on idx's device {device}, got {attention_mask.device}")
    if attention_mask.is_floating_point():
        raise ValueError("attention_mask must hold only 1 (token) and 0 (padding), as an integer or bool tensor")
    if scan_values():
        _left_padded("attention_mask", attention_mask)
    return attention_mask.bool()


def _left_padded(name: str, mask: torch.Tensor) -> None:
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


# --------------------------------------------------------------------------- declared contracts
# A door declares what each argument must be, one line per argument, and one helper checks them all:
#
#     @door(
#         q="float (B, H, T, D)",            # a floating tensor of 4 dims; the names bind sizes
#         k="float (B, H_kv, S, D)",         # B and D must equal q's
#         mask="additive (T, S) | (B?, H?, T?, S?) | None",   # X?: 1 or X (broadcasts)
#         causal="bool",
#         scale="real > 0 | None",
#         same_dtype="q k",
#         where={"H % H_kv == 0": "the query heads H must be a multiple of the key/value heads H_kv"},
#     )
#     def attention_ref(q, k, v, mask=None, causal=False, scale=None): ...math only...
#
# Tensor kinds: float, int (int64 or int32), bool, tensor (any dtype), additive (a floating mask of 0
# and -inf: no NaN, no +inf), padding (a (B, S) mask of 1 = token, 0 = padding, left-padded), ids
# (int64 or int32; with `< bound` its values in [0, bound), the bound an int argument or an attribute
# path such as self.config.vocab_size). Layouts: named sizes (each >= 1, the same wherever the name
# recurs), digits, `_` (any size), `X?` (X or 1), a leading `...`
# (any leading dims, the same in every tensor). `|` separates alternatives; `| None` allows None.
# Scalars: "int >= 1", "real > 0", "real >= 0", "bool", "str". Every tensor must be on the first
# tensor's device. `where` rules are Python expressions over the sizes, the arguments (sizes win a
# clash of names) and the declaring module's globals, checked in order after the arguments; a rule
# naming a tensor reads its data (a value scan). A failed rule's message is followed by the values
# it names ("..., got H=4, H_kv=3"), or is an f-string over the same names. A callable stands for a
# check written out: it is called as check(name, value). Arguments are checked in declared order.
_KINDS = {"float", "int", "bool", "tensor", "additive", "ids", "padding"}
_SCALARS = {"int", "real", "bool", "str"}


def _parse_layout(text: str) -> tuple[str, ...]:
    inner = text.strip()
    if not (inner.startswith("(") and inner.endswith(")")):
        raise ValueError(f"a layout is written (A, B, ...), got {text!r}")
    return tuple(p.strip() for p in inner[1:-1].split(",") if p.strip())


def _shown(layout: tuple[str, ...], first: bool = True) -> str:
    """'have shape (B, T)' ('(B, T)' after an 'or'), or for broadcast sizes 'broadcast to (B, H, T, S)'."""
    shown = "(" + ", ".join(p.rstrip("?") for p in layout) + (",)" if len(layout) == 1 else ")")
    if any(p.endswith("?") for p in layout):
        return f"broadcast to {shown}"
    return f"have shape {shown}" if first else shown


class _Arg:
    """One argument's declaration, parsed once."""

    def __init__(self, name: str, text):
        self.name, self.text, self.optional, self.custom = name, text, False, None
        if callable(text):
            self.custom = text
            return
        parts = [p.strip() for p in text.split("|")]
        if parts[-1] == "None":
            self.optional, parts = True, parts[:-1]
        head, _, rest = parts[0].partition(" ")
        self.kind, self.bound, self.layouts = head, None, []
        if head in _KINDS and rest.strip().startswith("("):
            layout, _, tail = rest.partition(")")
            self.layouts.append(_parse_layout(layout + ")"))
            self.layouts += [_parse_layout(p) for p in parts[1:]]
            tail = tail.strip()
            if tail:  # ids (B, T) < vocab_size
                op, _, bound = tail.partition(" ")
                if op != "<" or head != "ids":
                    raise ValueError(f"{name}: only ids take a bound (< name), got {text!r}")
                self.bound = bound.strip()
        elif head in _SCALARS and len(parts) == 1:
            self.cmp = rest.split() if rest else []  # e.g. [">=", "1"]
        else:
            raise ValueError(f"{name}: cannot read the declaration {text!r}")

    def describe(self) -> str:
        if not self.layouts:
            return {"int": "an int", "real": "a real number", "bool": "a bool", "str": "a string"}[self.kind]
        return " or ".join(_shown(lay, i == 0) for i, lay in enumerate(self.layouts))


def _attr(path: str, values: dict):
    head, *rest = path.split(".")
    value = values[head]
    for part in rest:
        value = getattr(value, part)
    return value


class door:
    """A declared contract, usable as a decorator (the door checks its arguments, where
    `checking()` says, then runs the function) or called directly with `.check(**arguments)`."""

    def __init__(self, where: dict | None = None, same_dtype: str = "", **args):
        import sys

        self.args = {name: _Arg(name, text) for name, text in args.items()}
        self.same_dtype = same_dtype.split()
        self.rules = [(compile(expr, expr, "eval"), says) for expr, says in (where or {}).items()]
        self.scope = sys._getframe(1).f_globals  # rules may name the declaring module's globals

    def plus(self, where: dict | None = None, **args) -> door:
        """This contract with more arguments (and rules) declared."""
        more = door(where, **args)
        return self._made(self.args | more.args, self.same_dtype, self.rules + more.rules)

    def __str__(self) -> str:
        """The contract as a table a student can read: one line per argument, then the rules."""
        width = max(len(n) for n in [*self.args, "same dtype"])
        lines = [
            f"{n:<{width}}  {a.text if not a.custom else a.custom.__name__ + '(...)'}" for n, a in self.args.items()
        ]
        if self.same_dtype:
            lines.append(f"{'same dtype':<{width}}  {' '.join(self.same_dtype)}")
        lines += [f"{'where':<{width}}  {code.co_filename}  ({says})" for code, says in self.rules]
        return "\n".join(lines)

    def _without(self, absent: set) -> door:
        """This contract less the arguments `absent`, and less the rules that name them."""
        if not absent:
            return self
        return self._made(
            {n: a for n, a in self.args.items() if n not in absent},
            [n for n in self.same_dtype if n not in absent],
            [(code, says) for code, says in self.rules if not absent & set(code.co_names)],
        )

    def _made(self, args: dict, same_dtype: list, rules: list) -> door:
        new = door.__new__(door)
        new.args, new.same_dtype, new.rules, new.scope = args, same_dtype, rules, self.scope
        return new

    def __call__(self, fn):
        """Decorate `fn`: the arguments it lacks are dropped from its door, with the rules naming them
        (one contract serves a family: attention_scores has no v, no mask)."""
        import functools
        import inspect

        signature = inspect.signature(fn)
        contract = self._without(set(self.args) - set(signature.parameters))

        @functools.wraps(fn)
        def _door(*args, **kwargs):
            if checking():
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                contract.check(**bound.arguments)
            return fn(*args, **kwargs)

        _door.contract, _door.declared = contract, self
        return _door

    def check(self, /, **values) -> dict:
        """Raise a TypeError or ValueError naming the first argument that breaks the contract;
        return the sizes bound (e.g. {"B": 2, "H": 4, ...}). Declared arguments not given are left
        out, with the rules naming them, as a decorated function leaves out what it lacks."""
        if not set(self.args) <= set(values):
            return self._without(set(self.args) - set(values)).check(**values)
        sizes: dict[str, tuple[int, str]] = {}
        later = []  # the arguments' value scans, run after every shape, device and rule
        first = None  # the first tensor: every tensor must be on its device
        for name, arg in self.args.items():
            value = values.get(name)
            if arg.custom is not None:
                arg.custom(name, value)
            elif value is None and arg.optional:
                continue
            elif not arg.layouts:
                self._scalar(arg, value)
            else:
                self._tensor(arg, value, sizes, values, first, later)
                first = first or name
        present = [n for n in self.same_dtype if values.get(n) is not None]
        if any(values[n].dtype != values[present[0]].dtype for n in present):
            listing = ", ".join(f"{n}: {values[n].dtype}" for n in present)
            raise ValueError(f"{', '.join(present)} must share one dtype, got {listing}")
        dims = {k: v for k, (v, _) in sizes.items() if k != "..."}
        scope = {**values, **dims}
        for code, says in self.rules:
            if not eval(code, self.scope, scope):
                shown = ", ".join(
                    f"{n}={scope[n]!r}"
                    for n in code.co_names
                    if n in dims or isinstance(scope.get(n), (int, float, str))
                )
                if "{" in says:  # the message is an f-string over the sizes and arguments
                    raise ValueError(eval("f" + repr(says), self.scope, scope))
                raise ValueError(f"{says}, got {shown}" if shown else says)
        for scan in later:
            scan()
        return dims

    @staticmethod
    def _scalar(arg: _Arg, value) -> None:
        name, kind = arg.name, arg.kind
        if kind == "bool" and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if kind == "str" and not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {type(value).__name__}")
        if kind == "int":
            require_int(name, value, minimum=int(arg.cmp[1]) if arg.cmp else -(2**63))
        if kind == "real":
            op, limit = (arg.cmp + [None, None])[:2]
            note = " or None" if arg.optional else ""
            if op == ">":
                require_real(name, value, above=float(limit), note=note)
            else:
                require_real(name, value, at_least=None if limit is None else float(limit), note=note)

    @staticmethod
    def _tensor(arg: _Arg, value, sizes: dict, values: dict, first: str | None, later: list) -> None:
        name, kind = arg.name, arg.kind
        if not isinstance(value, torch.Tensor):
            maybe = " or None" if arg.optional else ""
            raise TypeError(f"{name} must be a torch.Tensor{maybe}, got {type(value).__name__}")
        if kind in ("float", "additive") and not value.is_floating_point():
            if kind == "additive":
                hint = "; convert with lib.masks.additive_from_bool(keep)" if value.dtype == torch.bool else ""
                raise TypeError(
                    f"{name} must be an additive floating mask (0 = attend, -inf = blocked), got {value.dtype}{hint}"
                )
            raise TypeError(
                f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), got {value.dtype}"
            )
        if kind in ("int", "ids") and value.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be an int64 (or int32) tensor, got {value.dtype}")
        if kind == "bool" and value.dtype != torch.bool:
            raise TypeError(f"{name} must be a bool tensor, got {value.dtype}")
        if kind == "padding" and value.is_floating_point():
            raise ValueError(f"{name} must hold only 1 (token) and 0 (padding), as an integer or bool tensor")
        if first is not None and value.device != values[first].device:
            raise ValueError(f"{name} must be on {first}'s device {values[first].device}, got {value.device}")
        shape = tuple(value.shape)
        layouts = [
            lay for lay in arg.layouts if len(lay) == len(shape) or (lay[:1] == ("...",) and len(shape) >= len(lay) - 1)
        ]
        if not layouts:
            dims = " or ".join(f"{len(lay)}" if lay[:1] != ("...",) else f">= {len(lay) - 1}" for lay in arg.layouts)
            raise ValueError(f"{name} must {arg.describe()} ({dims} dims), got {shape}")
        layout = whole = layouts[0]
        if layout[0] == "...":  # any leading dims, the same in every tensor that declares them
            layout, lead, shape = (
                layout[1:],
                shape[: len(shape) - len(layout) + 1],
                shape[len(shape) - len(layout) + 1 :],
            )
            if sizes.setdefault("...", (lead, name))[0] != lead:
                raise ValueError(
                    f"{name} must {_shown(whole)} with ... = {sizes['...'][0]} as in "
                    f"{sizes['...'][1]}, got {tuple(value.shape)}"
                )
        for part, size in zip(layout, shape):
            broadcast, dim = part.endswith("?"), part.rstrip("?")
            if dim.isdigit():
                ok, want = size == int(dim), dim
            elif dim in sizes:
                ok = size == sizes[dim][0] or (broadcast and size == 1)
                want = f"{dim} = {sizes[dim][0]} as in {sizes[dim][1]}" + (" (or 1)" if broadcast else "")
            elif dim == "_":
                ok = True
            else:
                if size == 0:
                    raise ValueError(f"{name} must {_shown(whole)} with every size >= 1, got {tuple(value.shape)}")
                if not broadcast or size != 1:
                    sizes[dim] = (size, name)
                ok = True
            if not ok:
                raise ValueError(f"{name} must {_shown(whole)} with {want}, got {tuple(value.shape)}")
        if kind == "padding" and scan_values():
            later.append(lambda: _left_padded(name, value))
        if arg.bound is not None and scan_values():
            later.append(lambda: door._in_range(name, value, arg.bound, values))
        if kind == "additive" and scan_values():
            later.append(lambda: door._no_nan(name, value))

    @staticmethod
    def _no_nan(name: str, value: torch.Tensor) -> None:
        if bool(torch.isnan(value).any()) or bool(torch.isposinf(value).any()):
            raise ValueError(f"{name} must hold finite values or -inf (no NaN, no +inf)")

    @staticmethod
    def _in_range(name: str, value: torch.Tensor, path: str, values: dict) -> None:
        high = _attr(path, values)
        if bool((value < 0).any()) or bool((value >= high).any()):
            bound = path.split(".")[-1]
            raise ValueError(
                f"{name} must lie in [0, {bound}={high}), got min {int(value.min())}, max {int(value.max())}"
            )


# The door of every decoder's forward in lib (GPT and the models built on it, Llama): token ids that
# fit the vocabulary and the context from `start`, on the model's device, and caches that fit them.
DECODER_FORWARD = door(
    start="int >= 0",
    idx="ids (B, T) < self.config.vocab_size",
    targets="int (B, T) | None",
    attention_mask="padding (B, S) | None",
    where={
        "start + T <= self.config.block_size": "idx has T={T} tokens from position {start}, past the context "
        "block_size={self.config.block_size}",
        "idx.device == self.get_input_embeddings().weight.device": "idx must be on the model's device "
        "{self.get_input_embeddings().weight.device}, got {idx.device}",
        "caches is not None or not start": "start > 0 needs caches: without them the earlier positions are not "
        "there to attend to",
        "caches is None or len(caches) == self.config.n_layer": "caches must hold one cache per layer "
        "({self.config.n_layer}), got {len(caches)}",
        "caches is None or caches[0].batch_size == B": "caches were built for batch size {caches[0].batch_size}, "
        "idx has batch size {B}",
        "attention_mask is None or S == start + T": "attention_mask must have shape (B, start + T) = ({B}, "
        "{start + T}), covering cached positions too, got ({B}, {S})",
        "targets is None or bool((((targets >= 0) & (targets < self.config.vocab_size)) | (targets == -100)).all())": (
            "targets must lie in [0, vocab_size={self.config.vocab_size}) (or be -100 to skip a position)"
        ),
    },
)
