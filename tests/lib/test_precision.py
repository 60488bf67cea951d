"""lib.course.precision: results printed at the precision they have."""

import math

import pytest
from refusals import refusal_test

from lib.course.precision import below, mean_spread, significant


@pytest.mark.parametrize(
    "value, bound, text",
    [
        (0.0, 1e-5, "below 1e-5"),
        (2.4e-6, 1e-5, "below 1e-5"),
        (2.9e-6, 1e-5, "below 1e-5"),
        (1e-9, 2.5e-7, "below 2.5e-7"),
        (0.01, 0.05, "below 5e-2"),
    ],
)
def test_below_prints_the_bound_not_the_digits(value, bound, text):
    assert below(value, bound) == text


def test_below_is_the_same_string_for_errors_that_differ_in_their_last_digits():
    # the two rounding errors one cell printed on an AMD and an Intel CPU
    assert below(2.4e-6, 1e-5) == below(2.9e-6, 1e-5)


_NOT_BELOW = (
    "below(): {} is not below 1e-5 with a margin of 3x (it must be at most 3.33e-06); a "
    "bound this close could read differently on another CPU: loosen it, or find why the error "
    "is this large"
)
BELOW_REFUSALS = [
    # not comfortably inside the bound (a margin of 3x by default)
    ("value", 1e-5, ValueError, _NOT_BELOW.format("1.00e-05")),
    ("value", 4e-6, ValueError, _NOT_BELOW.format("4.00e-06")),
    ("value", 1.0, ValueError, _NOT_BELOW.format("1.00e+00")),
    ("value", -1e-7, ValueError, "below(): value is an error or a gap and must be >= 0, got -1e-07"),
    ("value", float("nan"), TypeError, "below(): value must be a real number, got nan"),
    ("value, bound", (0.0, 0.0), ValueError, "below(): bound must be > 0 and margin >= 1, got bound=0.0, margin=3.0"),
    ("margin", 0.5, ValueError, "below(): bound must be > 0 and margin >= 1, got bound=1e-05, margin=0.5"),
    ("margin", True, TypeError, "below(): margin must be a real number, got True"),
]
test_below_refusals = refusal_test(below, dict(value=1e-6, bound=1e-5), BELOW_REFUSALS)


def test_below_takes_a_smaller_margin():
    assert below(9e-6, 1e-5, margin=1) == "below 1e-5"


@pytest.mark.parametrize(
    "x, digits, expected",
    [
        (0.123456, 2, 0.12),
        (123456.0, 3, 123000.0),
        (-0.00098765, 2, -0.00099),
        (0.0, 3, 0.0),
        (1.0, 1, 1.0),
        (9.96, 2, 10.0),
    ],
)
def test_significant_rounds_to_significant_digits(x, digits, expected):
    assert significant(x, digits) == pytest.approx(expected, rel=0, abs=1e-15)


def test_significant_passes_inf_and_nan_through_and_refuses_bad_digits():
    assert significant(math.inf) == math.inf and math.isnan(significant(math.nan))
    with pytest.raises(ValueError, match="digits must be an int >= 1"):
        significant(1.0, 0)


def test_mean_spread_is_mean_and_sample_standard_deviation():
    assert mean_spread([0.5, 0.7, 0.6]) == "60% ± 10%"
    assert mean_spread([0.25]) == "25% ± 0%"
    assert mean_spread([1.0, 2.0, 3.0], percent=False, digits=1) == "2.0 ± 1.0"
    with pytest.raises(ValueError, match="non-empty"):
        mean_spread([])


def test_default_dtype_sets_and_restores_the_default_even_on_error():
    import torch

    from lib.course.precision import default_dtype

    assert torch.get_default_dtype() == torch.float32
    with default_dtype(torch.float64):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(RuntimeError), default_dtype(torch.float64):
        raise RuntimeError("inside")
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(TypeError, match="float32 or torch.float64"):
        with default_dtype(torch.float16):
            pass


def test_float64_initialisation_is_the_same_on_every_cpu_kernel(tmp_path):
    """float32 normal_ takes a vectorised path that ATEN_CPU_CAPABILITY changes (AVX2 here, scalar
    there); float64 takes the scalar one everywhere. This is why the lessons train in float64."""
    import os
    import subprocess
    import sys

    import torch

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("needs a CPU with AVX2 to compare against the scalar kernels")
    code = (
        "import sys, torch; torch.manual_seed(0); dt = getattr(torch, sys.argv[1]); "
        "w = torch.empty(4096, dtype=dt).normal_(0, 0.02); print(w.double().sum().item().hex())"
    )

    def run(dtype, capability):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
        return subprocess.run(
            [sys.executable, "-c", code, dtype], env=env, capture_output=True, text=True, check=True
        ).stdout

    assert run("float64", "default") == run("float64", "avx2")
    assert run("float32", "default") != run("float32", "avx2")  # the perturbation the suite uses is real
