"""What the scan tests share (tests/lib/test_scan.py, test_mamba.py, test_scan_cpu.py,
test_scan_kernel.py): random inputs shaped like a Mamba layer's, the tolerances, the bad inputs
every scan must refuse, and one thread for tiny tensors."""

import pytest
import torch
import torch.nn.functional as F
from refusals import not_float


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds synchronisation, which on a busy
    2-core machine costs 10-30x the work itself. Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# fp32 comparisons of two scans. Both add the same terms; they group them differently across
# chunks (and the parallel scan in a tree). fp32's ε is 1.2e-7, and the state is a decaying sum
# (every Ā in [0, 1]), so rounding does not compound along the sequence: measured differences are
# below 1e-6 of the output's largest magnitude for L up to 4096. 1e-5 relative (~100 ε) leaves room
# for other CPUs' summation orders and still fails on any real algorithmic slip (those are O(1)).
RTOL32 = 1e-5


# fp64 comparisons: the same algebra in double precision (ε 2.2e-16) must agree to ~1e4 ε.
TOL64 = 1e-12


def scan_inputs(b=2, l=16, d=4, n=3, *, seed=0, dtype=torch.float32, delta=None, x_sign="mixed"):
    """Random scan inputs shaped like a Mamba layer's: Δ mostly 0.005-0.1 (softplus of N(-4, 1)),
    A = -(1..N) per channel scaled by a random factor, x, B, C standard normal; D and h0 too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, d, generator=g, dtype=dtype)
    if x_sign == "negative":
        x = -x.abs()
    dl = (
        F.softplus(torch.randn(b, l, d, generator=g, dtype=dtype) - 4.0)
        if delta is None
        else torch.full((b, l, d), float(delta), dtype=dtype)
    )
    A = -torch.arange(1, n + 1, dtype=dtype).repeat(d, 1) * torch.rand(d, 1, generator=g, dtype=dtype).add(0.5)
    B = torch.randn(b, l, n, generator=g, dtype=dtype)
    C = torch.randn(b, l, n, generator=g, dtype=dtype)
    D = torch.randn(d, generator=g, dtype=dtype)
    h0 = torch.randn(b, d, n, generator=g, dtype=dtype)
    return x, dl, A, B, C, D, h0


def assert_close32(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL32, atol=RTOL32 * expected.abs().max().item())


_NEGATIVE_A = (
    "A must be negative everywhere (A < 0): Ā = exp(Δ·A) must be < 1 for the state to decay; A >= 0 makes the "
    "state grow without bound (got max {}). Mamba stores A = -exp(A_log)."
)
_STEP = "must be >= 0: it is a step size Δ (Mamba makes it positive with softplus: pass delta_softplus=True), got min"


def bad_scan_cases():
    """The refusal table every scan shares: (case, arguments, error, the whole message)."""
    x, delta, A, B, C, D, h0 = scan_inputs(2, 6, 3, 4)
    ok = dict(x=x, delta=delta, A=A, B=B, C=C, D=D)
    return [
        ("x rank", dict(ok, x=x[0]), ValueError, "x must have shape (B, L, D) (3 dims), got (6, 3)"),
        (
            "delta shape",
            dict(ok, delta=delta[:, :5]),
            ValueError,
            "delta must have shape (B, L, D) with L = 6 as in x, got (2, 5, 3)",
        ),
        ("A shape", dict(ok, A=A[:2]), ValueError, "A must have shape (D, N) with D = 3 as in x, got (2, 4)"),
        ("A rank", dict(ok, A=A[0]), ValueError, "A must have shape (D, N) (2 dims), got (4,)"),
        (
            "B shape",
            dict(ok, B=B[:, :, :3]),
            ValueError,
            "B must have shape (B, L, N) with N = 4 as in A, got (2, 6, 3)",
        ),
        ("C shape", dict(ok, C=C[:1]), ValueError, "C must have shape (B, L, N) with B = 2 as in x, got (1, 6, 4)"),
        ("D shape", dict(ok, D=D[:2]), ValueError, "D must have shape (D,) with D = 3 as in x, got (2,)"),
        (
            "h0 shape",
            dict(ok, h0=h0[:, :, :2]),
            ValueError,
            "h0 must have shape (B, D, N) with N = 4 as in A, got (2, 3, 2)",
        ),
        ("A zero", dict(ok, A=A.clone().index_fill_(1, torch.tensor([0]), 0.0)), ValueError, _NEGATIVE_A.format(0)),
        ("A positive", dict(ok, A=-A), ValueError, _NEGATIVE_A.format(f"{(-A).max().item():.4g}")),
        ("delta negative", dict(ok, delta=-delta), ValueError, f"delta {_STEP} {(-delta).min().item():.4g}"),
        ("x integer", dict(ok, x=torch.ones(2, 6, 3, dtype=torch.int64)), TypeError, not_float("x")),
        ("B integer", dict(ok, B=B.long()), TypeError, not_float("B")),
        ("C not a tensor", dict(ok, C=C.tolist()), TypeError, "C must be a torch.Tensor, got list"),
        (
            "empty",
            dict(ok, x=x[:, :0], delta=delta[:, :0], B=B[:, :0], C=C[:, :0]),
            ValueError,
            "x must have shape (B, L, D) with every size >= 1, got (2, 0, 3)",
        ),
        ("z shape", dict(ok, z=x[:, :5]), ValueError, "z must have shape (B, L, D) with L = 6 as in x, got (2, 5, 3)"),
        ("z integer", dict(ok, z=x.long()), TypeError, not_float("z")),
        (
            "delta_bias shape",
            dict(ok, delta_bias=D[:2]),
            ValueError,
            "delta_bias must have shape (D,) with D = 3 as in x, got (2,)",
        ),
        ("delta_softplus not a bool", dict(ok, delta_softplus=1), TypeError, "delta_softplus must be a bool, got int"),
        (
            "delta NaN under softplus",
            dict(ok, delta=delta.clone().fill_(float("nan")), delta_softplus=True),
            ValueError,
            "delta must not be NaN, got delta_softplus=True",
        ),
        (
            "delta + bias negative",
            dict(ok, delta_bias=-torch.ones(3)),
            ValueError,
            f"delta + delta_bias {_STEP} {(delta - 1).min().item():.4g}",
        ),
    ]
