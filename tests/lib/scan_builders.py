"""What the scan tests share (tests/lib/test_scan.py, test_mamba.py, test_scan_cpu.py,
test_scan_kernel.py): random inputs shaped like a Mamba layer's, the tolerances, the bad inputs
every scan must refuse, and one thread for tiny tensors."""

import pytest
import torch
import torch.nn.functional as F


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


def bad_scan_cases():
    x, delta, A, B, C, D, h0 = scan_inputs(2, 6, 3, 4)
    ok = dict(x=x, delta=delta, A=A, B=B, C=C, D=D)
    return [
        ("x rank", dict(ok, x=x[0]), ValueError, r"x must have shape \(B, L, D\)"),
        (
            "delta shape",
            dict(ok, delta=delta[:, :5]),
            ValueError,
            r"delta must have shape \(B, L, D\) = \(2, 6, 3\) like x, got \(2, 5, 3\)",
        ),
        ("A shape", dict(ok, A=A[:2]), ValueError, r"A must have shape \(D, N\) = \(3, 4\) with D = x.shape\[-1\]"),
        ("A rank", dict(ok, A=A[0]), ValueError, r"A must have shape \(D, N\)"),
        ("B shape", dict(ok, B=B[:, :, :3]), ValueError, r"B must have shape \(B, L, N\)"),
        ("C shape", dict(ok, C=C[:1]), ValueError, r"C must have shape \(B, L, N\)"),
        ("D shape", dict(ok, D=D[:2]), ValueError, r"D must have shape \(D,\)"),
        ("h0 shape", dict(ok, h0=h0[:, :, :2]), ValueError, r"h0 must have shape \(B, D, N\)"),
        (
            "A zero",
            dict(ok, A=A.clone().index_fill_(1, torch.tensor([0]), 0.0)),
            ValueError,
            r"A must be negative.*grow without bound",
        ),
        ("A positive", dict(ok, A=-A), ValueError, r"exp\(Δ·A\) must be < 1"),
        ("delta negative", dict(ok, delta=-delta), ValueError, r"delta must be >= 0"),
        ("x integer", dict(ok, x=torch.ones(2, 6, 3, dtype=torch.int64)), TypeError, r"x must have a floating dtype"),
        ("B integer", dict(ok, B=B.long()), TypeError, r"B must have a floating dtype"),
        ("C not a tensor", dict(ok, C=C.tolist()), TypeError, r"C must be a torch.Tensor"),
        ("empty", dict(ok, x=x[:, :0], delta=delta[:, :0], B=B[:, :0], C=C[:, :0]), ValueError, r"every size >= 1"),
        ("z shape", dict(ok, z=x[:, :5]), ValueError, r"z must have shape \(B, L, D\) = \(2, 6, 3\) like x"),
        ("z integer", dict(ok, z=x.long()), TypeError, r"z must have a floating dtype"),
        ("delta_bias shape", dict(ok, delta_bias=D[:2]), ValueError, r"delta_bias must have shape \(D,\) = \(3,\)"),
        ("delta_softplus not a bool", dict(ok, delta_softplus=1), TypeError, r"delta_softplus must be a bool"),
        (
            "delta NaN under softplus",
            dict(ok, delta=delta.clone().fill_(float("nan")), delta_softplus=True),
            ValueError,
            r"delta must not be NaN",
        ),
        (
            "delta + bias negative",
            dict(ok, delta_bias=-torch.ones(3)),
            ValueError,
            r"delta \+ delta_bias must be >= 0.*delta_softplus=True",
        ),
    ]
