"""lib._checks.door: a declared contract checks what it declares, names the argument and what was
expected, binds sizes across arguments, drops what a function lacks, and steps aside inside lib's
own loops (but not in debug mode)."""

import importlib
import inspect
import pkgutil
import types

import pytest
import torch

import lib
from lib._checks import debug, inputs_checked
from lib._door import door

MODES = {"fast": 1, "slow": 2}  # "one of MODES": a dict's keys
PAIR = door(
    mode="one of MODES",
    x="float (B, T, D)",
    y="float (B, T?, D) | None",
    vocab="int >= 1",  # before ids, whose bound it is: arguments are checked in the order declared
    ids="ids (B, T) < vocab",
    scale="real > 0 | None",
    same_dtype="x y",
    where={"D % 2 == 0": "D must be even", "vocab > B": "vocab must exceed the batch"},
)


def good(**changes):
    args = dict(
        mode="fast", x=torch.zeros(2, 3, 4), y=None, ids=torch.zeros(2, 3, dtype=torch.long), vocab=5, scale=None
    )
    return {**args, **changes}


def test_a_good_call_passes_and_returns_the_sizes():
    assert PAIR.check(**good()) == {"B": 2, "T": 3, "D": 4}
    assert PAIR.check(**good(y=torch.zeros(2, 1, 4))) == {"B": 2, "T": 3, "D": 4}  # T? broadcasts


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"mode": "fastest"}, ValueError, "mode must be one of ('fast', 'slow'), got 'fastest'"),
        ({"mode": 1}, ValueError, "mode must be one of ('fast', 'slow'), got 1"),
        ({"mode": torch.zeros(2)}, ValueError, "mode must be one of ('fast', 'slow'), got tensor([0., 0.])"),
        ({"x": [1.0]}, TypeError, "x must be a torch.Tensor, got list"),
        ({"x": torch.zeros(2, 3)}, ValueError, "x must have shape (B, T, D) (3 dims), got (2, 3)"),
        ({"x": torch.zeros(2, 0, 4)}, ValueError, "x must have shape (B, T, D) with every size >= 1, got (2, 0, 4)"),
        (
            {"y": torch.zeros(2, 2, 4)},
            ValueError,
            "y must broadcast to (B, T, D) with T = 3 as in x (or 1), got (2, 2, 4)",
        ),
        (
            {"y": torch.zeros(2, 3, 4).double()},
            ValueError,
            "x, y must share one dtype, got x: torch.float32, y: torch.float64",
        ),
        ({"y": torch.zeros(2, 3, 4, device="meta")}, ValueError, "y must be on x's device cpu, got meta"),
        ({"ids": torch.zeros(2, 3)}, TypeError, "ids must be an int64 (or int32) tensor, got torch.float32"),
        ({"ids": torch.full((2, 3), 5)}, ValueError, "ids must lie in [0, vocab=5), got min 5, max 5"),
        ({"ids": torch.full((2, 3), -1)}, ValueError, "ids must lie in [0, vocab=5), got min -1, max -1"),
        ({"vocab": True}, TypeError, "vocab must be an int, got bool"),
        ({"vocab": 0}, ValueError, "vocab must be >= 1, got 0"),
        ({"scale": 0.0}, ValueError, "scale must be a finite number > 0 or None, got 0.0"),
        (
            {"x": torch.zeros(2, 3, 5), "ids": torch.zeros(2, 3, dtype=torch.long)},
            ValueError,
            "D must be even, got D=5",
        ),
        ({"vocab": 2}, ValueError, "vocab must exceed the batch, got vocab=2, B=2"),
    ],
)
def test_each_broken_promise_is_named(changes, error, message):
    with pytest.raises(error) as info:
        PAIR.check(**good(**changes))
    assert str(info.value) == message


def test_leading_dims_and_custom_checks():
    def positive(name, value):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")

    c = door(a="float (..., R, 1)", b="float (..., R, K)", n=positive)
    assert c.check(a=torch.zeros(2, 3, 1), b=torch.zeros(2, 3, 7), n=1) == {"R": 3, "K": 7}
    with pytest.raises(ValueError, match=r"b must have shape \(\.\.\., R, K\) with \.\.\. = \(2,\) as in a"):
        c.check(a=torch.zeros(2, 3, 1), b=torch.zeros(4, 3, 7), n=1)
    with pytest.raises(ValueError, match="n must be positive, got 0"):
        c.check(a=torch.zeros(2, 3, 1), b=torch.zeros(2, 3, 7), n=0)


def test_a_size_may_be_an_attribute_of_an_argument():
    c = door(x="float (B, cfg.width)")
    cfg = types.SimpleNamespace(width=3)
    assert c.check(x=torch.zeros(2, 3), cfg=cfg) == {"B": 2}
    with pytest.raises(ValueError) as info:
        c.check(x=torch.zeros(2, 4), cfg=cfg)
    assert str(info.value) == "x must have shape (B, cfg.width) with cfg.width = 3, got (2, 4)"


def test_a_decorated_family_drops_what_a_function_lacks_and_rules_see_module_globals():
    limit = door(x="float (N,)", y="float (N,)", where={"N <= LIMIT": "N must be at most LIMIT", "y is not None": "y"})

    @limit
    def first(x):
        return x.sum()

    assert set(first.contract.args) == {"x"} and first.declared is limit  # and the rule naming y is gone
    try:
        globals()["LIMIT"] = 5
        assert first(torch.zeros(3)) == 0
        globals()["LIMIT"] = 2
        with pytest.raises(ValueError, match="N must be at most LIMIT, got N=3"):
            first(torch.zeros(3))
    finally:
        del globals()["LIMIT"]


def test_the_door_steps_aside_in_lib_loops_but_not_in_debug_mode():
    calls = []

    @door(x="float (N,)")
    def f(x):
        calls.append(x)
        return x

    with pytest.raises(TypeError):
        f(torch.zeros(3, dtype=torch.long))
    with inputs_checked():
        f(torch.zeros(3, dtype=torch.long))  # trusted: no check
        before = debug()
        debug(True)
        try:
            with pytest.raises(TypeError):
                f(torch.zeros(3, dtype=torch.long))
        finally:
            debug(before)
    assert len(calls) == 1


def test_declarations_that_cannot_be_read_fail_at_import():
    for bad in ["float B T", "number > 0", "ids (B, T) <= vocab", "float (B, T) < vocab"]:
        with pytest.raises(ValueError, match="x: "):
            door(x=bad)


def test_the_contract_prints_as_a_table():
    text = str(PAIR)
    assert text.splitlines()[1].split() == ["x", "float", "(B,", "T,", "D)"]
    assert text.splitlines()[4].split() == ["ids", "ids", "(B,", "T)", "<", "vocab"]
    assert "where       D % 2 == 0  (D must be even)" in text


def decorated():
    """Every function (and method) of lib behind a declared door."""
    found = []
    for info in pkgutil.walk_packages(lib.__path__, "lib."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module):
            members = inspect.getmembers(obj) if inspect.isclass(obj) else [(None, obj)]
            found += [m for _, m in members if callable(m) and hasattr(m, "declared")]
    return found


def test_every_declared_argument_is_a_parameter_somewhere():
    # a door drops the arguments its function lacks (a family shares one contract): a misspelt
    # argument would be dropped everywhere, checked nowhere
    used: dict[int, tuple] = {}
    for fn in decorated():
        for declared in (fn.declared, *fn.declared.parents):  # a contract extended by plus serves its base too
            used.setdefault(id(declared), (declared, set()))[1].update(inspect.signature(fn).parameters)
    assert len(used) >= 3
    for declared, names in used.values():
        assert declared.added <= names, (str(declared), declared.added - names)
