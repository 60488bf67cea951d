"""lib.norms: the fused RMSNorm loop equals torch's RMSNorm (values and both gradients, fp64 and fp32,
rows not a multiple of the backward's unit, one feature, any leading shape), gives the same bits on
any number of threads, loads a torch.nn.RMSNorm's state dict, falls back where the loop cannot run,
and refuses bad input clearly."""

import pytest
import torch
from refusals import assert_refuses, not_float, rows

import lib.kernels.cpu_layers as cpu_layers
import lib.kernels.scan_cpu as scan_cpu
from lib.kernels.scan_cpu import cpu_kernel_available, cpu_kernel_status
from lib.norms import RMSNorm, rms_norm, rms_norm_ref

needs_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason=f"the CPU loops are {cpu_kernel_status()}")


def _run(fn, x, w, eps=1e-5, **kw):
    """y and the gradients of x and w, for a loss that weighs every output differently."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w, eps, **kw)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y.dtype)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (17, 5), (2, 25, 64), (33, 130), (2, 3, 4, 9)])
def test_the_loop_is_torchs_rms_norm_with_its_gradients(shape):
    """fp64 to 1e-12: one row, one feature, rows that fill no whole backward unit (16), leading dims."""
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    w = torch.randn(shape[-1], generator=g, dtype=torch.float64)
    for name, got, want in zip(("y", "x", "weight"), _run(rms_norm, x, w), _run(rms_norm_ref, x, w)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


@needs_kernel
def test_fp32_threads_and_the_module():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(300, 48, generator=g), torch.randn(48, generator=g)
    got, want = _run(rms_norm, x, w), _run(rms_norm_ref, x.double(), w.double())
    for name, a, b in zip(("y", "x", "weight"), got, want):
        # fp32: the row's sum of squares and the weight's sum over 300 rows round differently;
        # 1e-5 of the largest value (~100 ε32) fails on any algebra slip, which is O(1)
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=name)
    # every unit of 16 rows writes its own partial sum of the weight's gradient: any split, same bits
    one = _run(lambda *a: cpu_layers.rms_norm(*a, threads=1), x, w)
    for threads in (2, 3, 7):
        assert all(
            torch.equal(a, b) for a, b in zip(_run(lambda *a: cpu_layers.rms_norm(*a, threads=threads), x, w), one)
        )
    # the module: torch.nn.RMSNorm's parameter and state dict, computed by the loop
    ref = torch.nn.RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(w)
    mine = RMSNorm(48, eps=1e-6)
    mine.load_state_dict(ref.state_dict())
    assert isinstance(mine, torch.nn.RMSNorm) and list(mine.state_dict()) == ["weight"]
    torch.testing.assert_close(mine(x), ref(x), rtol=1e-5, atol=1e-5)
    no_eps = RMSNorm(48)  # eps None: torch's default, the dtype's machine epsilon
    torch.testing.assert_close(no_eps(x * 1e-4), torch.nn.RMSNorm(48)(x * 1e-4), rtol=1e-5, atol=1e-6)


def test_without_the_loop_the_reference_runs(monkeypatch):
    monkeypatch.setattr(scan_cpu, "_library", None)
    monkeypatch.setattr(scan_cpu, "_status", "unavailable: no C compiler found (a test says so)")
    x, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    assert torch.equal(rms_norm(x, w), rms_norm_ref(x, w))
    assert torch.equal(rms_norm(x.half(), w.half()), rms_norm_ref(x.half(), w.half()))  # half: never the loop


_X, _W = torch.ones(4, 8), torch.ones(8)
# fmt: off
RMS_NORM_REFUSALS = [
    ("weight", _W[:7], ValueError, "weight must have shape (C,) with C = x.shape[-1], got weight (7,) and x (4, 8)"),
    ("weight", torch.ones(2, 8), ValueError,
     "weight must have shape (C,) with C = x.shape[-1], got weight (2, 8) and x (4, 8)"),
    ("x", _X.long(), TypeError, not_float("x")),
    ("weight", [1.0] * 8, TypeError, "weight must be a torch.Tensor, got list"),
    ("eps", 0.0, ValueError, "eps must be a finite number > 0 (it keeps the root mean square away from 0), got 0.0"),
    ("eps", -1e-5, ValueError,
     "eps must be a finite number > 0 (it keeps the root mean square away from 0), got -1e-05"),
    ("eps", float("nan"), ValueError,
     "eps must be a finite number > 0 (it keeps the root mean square away from 0), got nan"),
    ("eps", "small", TypeError, "eps must be a real number (it keeps the root mean square away from 0), got str"),
    (  # a bool is not a number here
        "eps",
        True,
        TypeError,
        "eps must be a real number (it keeps the root mean square away from 0), got bool",
    ),
    ("weight", torch.empty(8, device="meta"), ValueError,
     "x and weight must share one device, got x: cpu, weight: meta"),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message", rows(RMS_NORM_REFUSALS))
@pytest.mark.parametrize("fn", [rms_norm, rms_norm_ref])
def test_rms_norm_refusals(argument, bad, error, message, fn):
    assert_refuses(fn, dict(x=_X, weight=_W, eps=1e-5), argument, bad, error, message)
