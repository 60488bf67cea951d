"""Printing a result at the precision it has.

Two CPUs (an AVX2 and an AVX-512 one, say) run the same float32 program with different vector
widths and summation orders, so the last bits of a sum, a rounding error or a trained weight
differ between them. A lesson that prints those bits teaches nothing and reads differently on the
next machine. These helpers say what a number is worth:

    below(gap, 1e-5)          -> "below 1e-5"      a rounding error, as the bound it is tested against
    significant(0.123456, 2)  -> 0.12              figure data and printed values, to the digits they have
    mean_spread([.5, .7, .6]) -> "60% ± 10%"       a small training run: the mean and the seed-to-seed spread

A bound is only honest if the error sits well inside it: `below` refuses a value within a factor
`margin` (default 3) of its bound, so a printed bound cannot flip on another CPU's rounding.

Training is the other place where the last bits grow. A few hundred float32 steps turn a
difference in the 8th digit (a weight initialised by a vectorised random-number kernel, a sum
taken in another order) into a different trained model: one small run scored 18% on one CPU and
10% on another. The lessons that train build and train their models in float64
(`torch.set_default_dtype(torch.float64)`, or `default_dtype(torch.float64)` around a block):
float64 random initialisation takes the same scalar path on every CPU, and a difference in the
16th digit stays far below the digits a lesson prints. At these sizes (about 100k parameters) it
costs little on a CPU; a GPU trains in bf16 or fp16, and there the outcome of one short run is
a sample, not a constant.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from numbers import Real
from typing import Iterable, Iterator

import torch

__all__ = ["below", "default_dtype", "mean_spread", "significant"]


def _sci(x: float) -> str:
    """1e-05 -> "1e-5", 2.5e-07 -> "2.5e-7": the short form a reader expects."""
    mantissa, exponent = f"{x:.1e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def below(value: float, bound: float, *, margin: float = 3.0) -> str:
    """ "below {bound}" for a non-negative error `value` that is at most bound / margin.

    Raises ValueError when the value is not comfortably inside its bound: either the computation
    is wrong (the error is too large) or the bound is too tight to print on every machine.
    """
    for name, x in (("value", value), ("bound", bound), ("margin", margin)):
        if isinstance(x, bool) or not isinstance(x, Real) or math.isnan(x):
            raise TypeError(f"below(): {name} must be a real number, got {x!r}")
    if not bound > 0 or not margin >= 1:
        raise ValueError(f"below(): bound must be > 0 and margin >= 1, got bound={bound!r}, margin={margin!r}")
    if value < 0:
        raise ValueError(f"below(): value is an error or a gap and must be >= 0, got {value!r}")
    if not value * margin <= bound:
        raise ValueError(
            f"below(): {value:.2e} is not below {_sci(bound)} with a margin of {margin:g}x "
            f"(it must be at most {bound / margin:.2e}); a bound this close could read differently "
            "on another CPU: loosen it, or find why the error is this large"
        )
    return f"below {_sci(bound)}"


def significant(x: float, digits: int = 3) -> float:
    """`x` rounded to `digits` significant digits (0 stays 0; inf and nan pass through)."""
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
        raise ValueError(f"significant(): digits must be an int >= 1, got {digits!r}")
    if isinstance(x, bool) or not isinstance(x, Real):
        raise TypeError(f"significant(): x must be a real number, got {x!r}")
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def mean_spread(values: Iterable[float], *, percent: bool = True, digits: int = 0) -> str:
    """ "mean ± spread" of a few runs (spread: the sample standard deviation, 0 for one run).

    With percent=True the values are fractions shown as percentages ("62% ± 9%"). Print the mean
    to no more digits than the spread supports: with a spread of several points, whole percents.
    """
    xs = [float(v) for v in values]
    if not xs or not all(math.isfinite(v) for v in xs):
        raise ValueError(f"mean_spread(): values must be a non-empty list of finite numbers, got {xs!r}")
    mean = sum(xs) / len(xs)
    sd = math.sqrt(sum((v - mean) ** 2 for v in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    scale, unit = (100.0, "%") if percent else (1.0, "")
    return f"{mean * scale:.{digits}f}{unit} ± {sd * scale:.{digits}f}{unit}"


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Inside the block, new floating tensors and parameters are `dtype` (torch.set_default_dtype);
    the previous default comes back afterwards, also on an exception."""
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.float32, torch.float64):
        raise TypeError(f"default_dtype(): dtype must be torch.float32 or torch.float64, got {dtype!r}")
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
