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


def assert_refuses(fn, good: dict, argument: str, bad, error: type, message: str) -> None:
    names = [n.strip() for n in argument.split(",")]
    values = [v.make() if isinstance(v, built) else v for v in (bad if len(names) > 1 else (bad,))]
    with pytest.raises(error) as info:
        fn(**{**good, **dict(zip(names, values))})
    assert str(info.value) == message, str(info.value)
