"""lib.scan and lib.scan_parallel: the selective scans agree (values, gradients, carried state),
stay finite for large steps and long sequences, are the recurrence in fp64; the pieces
(discretisation, the combine, the LTI convolution) follow their definitions; bad inputs are
refused clearly."""

import math
from functools import partial

import pytest
import torch
from refusals import assert_refuses, rows
from scan_builders import TOL64, assert_close32, bad_scan_cases, one_thread, scan_inputs  # noqa: F401  (one_thread: autouse)

from lib.lti import lti_kernel, ssm_convolution
from lib.scan import discretize, parallel_scan_ref, selective_scan, selective_scan_ref
from lib.scan_parallel import default_chunk_size, scan_combine


@pytest.mark.parametrize("L", [1, 7, 64, 1000, 4096])
@pytest.mark.parametrize("x_sign", ["mixed", "negative"])
def test_chunked_scan_matches_reference_in_fp32(L, x_sign):
    x, delta, A, B, C, D, _ = scan_inputs(2, L, 4 if L < 4096 else 8, 4, seed=L, x_sign=x_sign)
    y_ref = selective_scan_ref(x, delta, A, B, C, D)
    y = selective_scan(x, delta, A, B, C, D, impl="chunked")  # the fused CPU loop: tests/test_scan_cpu.py
    assert y.shape == (2, L, x.shape[2]) and y.dtype == torch.float32
    assert_close32(y, y_ref)


@pytest.mark.parametrize("L,chunk", [(1, None), (7, 3), (50, 1), (50, 8), (64, 16), (65, 16), (37, 37), (37, 100)])
def test_chunked_scan_is_the_reference_algebra_in_fp64(L, chunk):
    """Any chunk size, L a multiple of it or not, with a start state: the same y and final state."""
    x, delta, A, B, C, D, h0 = scan_inputs(2, L, 3, 5, seed=1, dtype=torch.float64)
    y_ref, h_ref = selective_scan_ref(x, delta, A, B, C, D, h0=h0, return_state=True)
    y, h = selective_scan(x, delta, A, B, C, D, h0=h0, return_state=True, chunk_size=chunk, impl="chunked")
    torch.testing.assert_close(y, y_ref, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(h, h_ref, rtol=TOL64, atol=TOL64)


@pytest.mark.parametrize("L", [1, 5, 64, 100])
def test_parallel_scan_matches_reference(L):
    x, delta, A, B, C, D, h0 = scan_inputs(2, L, 3, 4, seed=2, dtype=torch.float64)
    y_ref, h_ref = selective_scan_ref(x, delta, A, B, C, D, h0=h0, return_state=True)
    y, h = parallel_scan_ref(x, delta, A, B, C, D, h0=h0, return_state=True)
    torch.testing.assert_close(y, y_ref, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(h, h_ref, rtol=TOL64, atol=TOL64)
    x, delta, A, B, C, D, _ = scan_inputs(2, L, 3, 4, seed=2)
    assert_close32(parallel_scan_ref(x, delta, A, B, C, D), selective_scan_ref(x, delta, A, B, C, D))


def test_scan_without_skip_and_default_chunk_size():
    x, delta, A, B, C, _, _ = scan_inputs(1, 300, 2, 2, seed=3, dtype=torch.float64)
    for impl in ("chunked", "auto"):
        torch.testing.assert_close(
            selective_scan(x, delta, A, B, C, impl=impl), selective_scan_ref(x, delta, A, B, C), rtol=TOL64, atol=TOL64
        )
    assert default_chunk_size(2048) == 32 and default_chunk_size(1) == 1 and default_chunk_size(10) == 4


@pytest.mark.parametrize("scan", [selective_scan, parallel_scan_ref])
def test_scan_gradients_match_reference(scan):
    """Gradients of every input, including the start state, equal the per-step loop's."""
    inputs = scan_inputs(2, 21, 3, 4, seed=4, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    w_y = torch.randn(2, 21, 3, generator=g, dtype=torch.float64)  # weights of a scalar loss on y and h_L
    w_h = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)

    def grads(fn, **kw):
        leaves = [t.detach().requires_grad_() for t in inputs]
        x, delta, A, B, C, D, h0 = leaves
        y, h = fn(x, delta, A, B, C, D, h0=h0, return_state=True, **kw)
        ((y * w_y).sum() + (h * w_h).sum()).backward()
        return [t.grad for t in leaves]

    expected = grads(selective_scan_ref)
    kw = {"chunk_size": 8} if scan is selective_scan else {}  # 21 = 2 chunks of 8 + a padded one
    for name, got, want in zip(["x", "delta", "A", "B", "C", "D", "h0"], grads(scan, **kw), expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize(
    "scan",
    [partial(selective_scan, impl="chunked"), selective_scan, parallel_scan_ref],
    ids=["chunked", "auto", "parallel"],
)
def test_state_carry_splits_a_sequence(scan):
    """Scanning two halves, the second from the first's final state, equals one scan."""
    x, delta, A, B, C, D, h0 = scan_inputs(2, 40, 3, 4, seed=6, dtype=torch.float64)
    y, h = scan(x, delta, A, B, C, D, h0=h0, return_state=True)
    y1, h1 = scan(x[:, :17], delta[:, :17], A, B[:, :17], C[:, :17], D, h0=h0, return_state=True)
    y2, h2 = scan(x[:, 17:], delta[:, 17:], A, B[:, 17:], C[:, 17:], D, h0=h1, return_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(h2, h, rtol=TOL64, atol=TOL64)


@pytest.mark.parametrize("delta", [50.0, "mixed"])
def test_scan_is_finite_and_exact_for_large_delta_and_long_sequences(delta):
    """Δ = 50 with A down to -16 gives Δ·A = -800: exp of it underflows to 0 (forget everything),
    never overflows. A scan that formed exp(+cumsum) would meet exp(3e6) here and return inf/nan."""
    L = 4096
    x, dl, A, B, C, D, _ = scan_inputs(2, L, 4, 16, seed=7, delta=None if delta == "mixed" else delta)
    if delta == "mixed":  # long calm stretches broken by resets
        dl = torch.where(
            torch.rand(dl.shape, generator=torch.Generator().manual_seed(8)) < 0.05, torch.full_like(dl, 50.0), dl
        )
    y_ref = selective_scan_ref(x, dl, A, B, C, D)
    y = selective_scan(x, dl, A, B, C, D, chunk_size=64)
    assert torch.isfinite(y).all()
    assert_close32(y, y_ref)
    leaves = [t.detach()[:, :300].requires_grad_() for t in (x, dl, B, C)]
    selective_scan(leaves[0], leaves[1], A, leaves[2], leaves[3], D).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_discretize_is_zoh_for_A_and_euler_for_B():
    _, delta, A, B, _, _, _ = scan_inputs(2, 5, 3, 4, seed=9, dtype=torch.float64)
    A_bar, B_bar = discretize(delta, A, B)
    assert A_bar.shape == B_bar.shape == (2, 5, 3, 4)
    b, l, d, n = 1, 3, 2, 1
    assert A_bar[b, l, d, n] == math.exp(delta[b, l, d].item() * A[d, n].item())
    assert B_bar[b, l, d, n] == delta[b, l, d] * B[b, l, n]
    assert (A_bar > 0).all() and (A_bar < 1).all()  # Δ > 0, A < 0: the state decays
    A_bar, B_bar = discretize(delta[0, 0], A, B[0, 0])  # the LTI case: (D,), (N,) -> (D, N)
    assert A_bar.shape == (3, 4)


def test_scan_combine_is_associative_and_its_fold_is_the_recurrence():
    g = torch.Generator().manual_seed(10)
    pairs = [
        (torch.rand(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64))
        for _ in range(6)
    ]
    p, q, r = pairs[:3]
    left, right = scan_combine(scan_combine(p, q), r), scan_combine(p, scan_combine(q, r))
    for u, v in zip(left, right):
        torch.testing.assert_close(u, v, rtol=TOL64, atol=TOL64)
    h = torch.zeros(3, 4, dtype=torch.float64)
    folded = pairs[0]
    h = pairs[0][0] * h + pairs[0][1]
    for a, b in pairs[1:]:
        h = a * h + b  # the recurrence, one step at a time
        folded = scan_combine(folded, (a, b))
    torch.testing.assert_close(folded[1], h, rtol=TOL64, atol=TOL64)  # applied to h_0 = 0
    torch.testing.assert_close(folded[0], torch.stack([a for a, _ in pairs]).prod(0), rtol=TOL64, atol=TOL64)


def test_lti_recurrence_equals_convolution():
    """Fixed Δ, B, C: the recurrence and y = K * x with K_k = C·(Ā^k ⊙ B̄) agree."""
    b, l, d, n = 2, 50, 3, 4
    x, _, A, _, _, D, _ = scan_inputs(b, l, d, n, seed=11, dtype=torch.float64)
    g = torch.Generator().manual_seed(12)
    delta_d = torch.rand(d, generator=g, dtype=torch.float64) * 0.5  # one Δ per channel, all positions
    B_n, C_n = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    y_rec = selective_scan_ref(x, delta_d.expand(b, l, d), A, B_n.expand(b, l, n), C_n.expand(b, l, n), D)
    A_bar, B_bar = discretize(delta_d, A, B_n)  # (D, N) each
    K = lti_kernel(A_bar, B_bar, C_n, l)  # (D, L)
    assert K.shape == (d, l)
    torch.testing.assert_close(K[:, 0], (C_n * B_bar).sum(-1), rtol=TOL64, atol=TOL64)  # K_0 = C·B̄
    torch.testing.assert_close(ssm_convolution(x, K, D), y_rec, rtol=1e-10, atol=1e-10)  # FFT rounding ~1e-15


@pytest.mark.parametrize("scan", [selective_scan, selective_scan_ref, parallel_scan_ref])
@pytest.mark.parametrize("case", bad_scan_cases(), ids=lambda c: c[0])
def test_scans_refuse_bad_inputs_with_a_clear_error(scan, case):
    _, kwargs, error, message = case
    with pytest.raises(error) as info:
        scan(**kwargs)
    assert str(info.value) == message


_IMPLS = "('auto', 'chunked', 'cpu', 'ref', 'parallel', 'triton')"
FRONT_DOOR_REFUSALS = [  # selective_scan's own knobs (its tensors: bad_scan_cases above)
    ("impl", "fast", ValueError, f"impl must be one of {_IMPLS}, got 'fast'"),
    ("impl", None, ValueError, f"impl must be one of {_IMPLS}, got None"),
    ("chunk_size", 0, ValueError, "chunk_size must be >= 1, got 0"),
    ("chunk_size", 2.0, TypeError, "chunk_size must be an int, got float"),
    ("impl, chunk_size", ("ref", 4), ValueError, "chunk_size is for impl='chunked', got impl='ref'"),
    ("impl, threads", ("chunked", 2), ValueError, "threads is for impl='cpu' (the fused C loop), got impl='chunked'"),
    ("threads", 0, ValueError, "threads must be >= 1, got 0"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(FRONT_DOOR_REFUSALS))
def test_selective_scan_front_door_refusals(argument, bad, error, message):
    x, delta, A, B, C, _, _ = scan_inputs(2, 6, 3, 4)
    good = dict(x=x, delta=delta, A=A, B=B, C=C, impl="cpu" if argument == "threads" else "auto")
    assert_refuses(selective_scan, good, argument, bad, error, message)


def test_the_other_scan_functions_refuse_bad_inputs():
    x, delta, A, B, C, D, _ = scan_inputs(2, 6, 3, 4)
    with pytest.raises(ValueError, match=r"delta must have shape \(\.\.\., D\)"):
        discretize(delta[..., :2], A, B)
    with pytest.raises(ValueError, match=r"B_bar must have shape \(D, N\)"):
        lti_kernel(A, A[:, :2], C[0, 0], 8)
    with pytest.raises(ValueError, match=r"K must have shape \(D, L_K\) with D = 3 and L_K >= L = 6"):
        ssm_convolution(x, torch.ones(3, 5))
