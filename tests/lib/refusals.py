"""Refusal tables: for each public entry point, one row per bad argument, (argument, bad value,
error type, the whole message), checked against a call that is otherwise good. A row that changes
several arguments at once names them "k, v" and gives a tuple of values."""

import pytest


def rows(table):
    """The table as pytest parameters, each with an id naming the argument."""
    return [pytest.param(*row, id=f"{row[0]}-{i}") for i, row in enumerate(table)]


def assert_refuses(fn, good: dict, argument: str, bad, error: type, message: str) -> None:
    names = [n.strip() for n in argument.split(",")]
    values = bad if len(names) > 1 else (bad,)
    with pytest.raises(error) as info:
        fn(**{**good, **dict(zip(names, values))})
    assert str(info.value) == message, str(info.value)
