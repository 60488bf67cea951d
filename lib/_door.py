"""Declared contracts: a public door says what each argument must be, one line per argument, and
one helper (`door.check`) checks them all, where `lib._checks.checking()` says (not inside lib's own
loops, always in debug mode). `print(fn.contract)` shows a door's contract as a table.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from lib._checks import checking, require_int, require_left_padded, require_real, scan_values

__all__ = ["DECODER_FORWARD", "door"]


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
# and -inf: no NaN, no +inf), logits (floating, no NaN, no +inf), padding (a (B, S) mask of 1 =
# token, 0 = padding, left-padded), ids (int64 or int32; with `< bound` its values in [0, bound),
# the bound an int argument or an attribute path such as self.config.vocab_size). Layouts: named
# sizes (each >= 1, the same wherever the name recurs), digits, attribute paths (self.d_model: that
# value), `_` (any size), `X?` (X or 1), a leading `...` (any leading dims, the same in every
# tensor). `|` separates alternatives; `| None` allows None. Scalars: "int >= 1", "real > 0",
# "real >= 0", "bool", "str", "instance torch.Generator" (a class the declaring module can name),
# "one of SCANS" (an item, or a dict's key, of a collection the declaring module can name). Every
# tensor must be on the first tensor's device.
# `where` rules are Python expressions over the sizes, the arguments (sizes win a clash of names)
# and the declaring module's globals, checked in order after the arguments; a rule naming a tensor
# reads its data (a value scan). A failed rule's message is followed by the values it names
# ("..., got H=4, H_kv=3"), or is an f-string over the same names. A callable stands for a check
# written out: it is called as check(name, value). Arguments are checked in declared order.
_KINDS = {"float", "int", "bool", "tensor", "additive", "logits", "ids", "padding"}
_SCALARS = {"int", "real", "bool", "str", "instance", "one"}


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
        """A tensor's layouts as a message says them: 'have shape (T, S) or broadcast to (B, H, T, S)'."""
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
        self.args = {name: _Arg(name, text) for name, text in args.items()}
        self.same_dtype = same_dtype.split()
        self.rules = [(compile(expr, expr, "eval"), says) for expr, says in (where or {}).items()]
        self.scope = sys._getframe(1).f_globals  # rules may name the declaring module's globals
        self.parents: tuple = ()  # the contracts this one extends (`plus`), and what it adds to them
        self.added = set(self.args)

    def plus(self, where: dict | None = None, **args) -> door:
        """This contract with more arguments (and rules) declared."""
        more = door(where, **args)
        new = self._made(self.args | more.args, self.same_dtype, self.rules + more.rules)
        new.parents, new.added = (self, *self.parents), set(more.args)
        return new

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
        new.parents, new.added = (), set(args)
        return new

    def __call__(self, fn):
        """Decorate `fn`: the arguments it lacks are dropped from its door, with the rules naming them
        (one contract serves a family: attention_scores has no v, no mask)."""
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
                self._scalar(arg, value, self.scope)
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
    def _scalar(arg: _Arg, value, scope: dict) -> None:
        name, kind = arg.name, arg.kind
        if kind == "instance":  # "instance torch.Generator": an object of that class
            cls = _attr(arg.cmp[0], scope)
            if not isinstance(value, cls):
                maybe = " or None" if arg.optional else ""
                raise TypeError(f"{name} must be a {arg.cmp[0]}{maybe}, got {type(value).__name__}")
        if kind == "one":  # "one of SCANS": one of a collection's items (a dict's keys)
            choices = tuple(_attr(arg.cmp[1], scope))
            if not any(type(value) is type(c) and value == c for c in choices):
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
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
        if kind in ("float", "additive", "logits") and not value.is_floating_point():
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
            raise ValueError(f"{name} must {arg.describe()} ({dims} dim{'' if dims == '1' else 's'}), got {shape}")
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
            elif "." in dim:  # an attribute path: (B, T, self.d_model)
                expected = _attr(dim, values)
                ok, want = size == expected, f"{dim} = {expected}"
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
            later.append(lambda: require_left_padded(name, value))
        if arg.bound is not None and scan_values():
            later.append(lambda: door._in_range(name, value, arg.bound, values))
        if kind in ("additive", "logits") and scan_values():
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


# The door of every decoder's forward in lib (GPT and the models built on it, Llama, MambaLM): token
# ids that fit the vocabulary and the context from `start` (a `block_size` of None: no limit), on
# the model's device, and caches that fit them.
DECODER_FORWARD = door(
    start="int >= 0",
    idx="ids (B, T) < self.config.vocab_size",
    targets="int (B, T) | None",
    attention_mask="padding (B, S) | None",
    where={
        "self.block_size is None or start + T <= self.block_size": "idx has T={T} tokens from position {start}, "
        "past the context block_size={self.block_size}",
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
