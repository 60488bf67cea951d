"""Refusal tables: for each public entry point, one row per bad argument, (argument, bad value,
error type, the whole message), checked against a call that is otherwise good. A row that changes
several arguments at once names them "k, v" and gives a tuple of values; a value that is a model or
draws random numbers is written `built(make)`, made when its row runs, not when the table is
imported (which would move the global random generator for every test collected after it)."""

import pytest


def rows(table):
    """The table as pytest parameters, each with an id naming the argument."""
    return [pytest.param(*row, id=f"{row[0]}-{i}") for i, row in enumerate(table)]


class built:
    """A bad value made when its row runs: built(lambda: LoRALinear(nn.Linear(8, 4)))."""

    def __init__(self, make):
        self.make = make

    def __repr__(self) -> str:
        return "built(...)"


def refusal_test(fn, good, table):
    """The test of one entry point's table: each row called on fn(**good), the row's argument
    replaced. fn or good may be built(...), made when a row runs:

        test_claim_refusals = refusal_test(claim, GOOD_CLAIM, CLAIM_REFUSALS)
    """

    @pytest.mark.parametrize("argument, bad, error, message", rows(table))
    def test(argument, bad, error, message):
        made = [x.make() if isinstance(x, built) else x for x in (fn, good)]
        assert_refuses(*made, argument, bad, error, message)

    return test


def assert_refuses(fn, good: dict, argument: str, bad, error: type, message: str) -> None:
    names = [n.strip() for n in argument.split(",")]
    values = [v.make() if isinstance(v, built) else v for v in (bad if len(names) > 1 else (bad,))]
    with pytest.raises(error) as info:
        fn(**{**good, **dict(zip(names, values))})
    assert str(info.value) == message, str(info.value)


def not_float(name: str, got: str = "torch.int64") -> str:
    """The message for a tensor argument that must be floating point, as every door words it."""
    return f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), got {got}"
