"""lib.kernels.scan_cpu: the fused C loop equals the reference (fp32 and fp64, any N, channel blocks
split across sequences, a carried state, the skip, half inputs, non-contiguous views, large Δ), and
so does its fused backward (every input's gradient, lengths that are no multiple of the checkpoint
interval, L = 1, channels across backward blocks, gradcheck in fp64), keeping no (B, L, D, N) tensor
for autograd; results and gradients do not depend on the number of threads or on how they are
made; selective_scan's "auto" takes it for CPU inputs; and a machine without a working compiler
falls back cleanly with a reason.

Needs a C compiler (CI's machine has gcc); where none works, the kernel tests skip and say why, and
the fallback tests still run.
"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scan_builders import TOL64, bad_scan_cases, scan_inputs

import lib.kernels.scan_cpu as scan_cpu
from lib.conv import causal_conv1d, causal_conv1d_cpu, causal_conv1d_ref
from lib.kernels import c_build
from lib.kernels.scan_cpu import cpu_kernel_available, cpu_kernel_status
from lib.mamba import MambaConfig
from lib.mamba_lm import MambaLM
from lib.scan import selective_scan, selective_scan_cpu, selective_scan_ref

ROOT = Path(__file__).resolve().parents[2]
needs_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason=f"the CPU scan kernel is {cpu_kernel_status()}")

# The loop adds the same terms as the reference in the same order along the sequence; they differ
# where exp rounds differently (glibc's vector expf is within 4 ulp, torch's within 1) and in the
# order of the N-term sum C·h (the loop sums in vector lanes). Measured: below 1e-6 of the output's
# largest value. 1e-5 (~100 ε32) is what every other scan is held to (tests/lib/test_scan.py).
RTOL32 = 1e-5


def _library_built_with(flags):
    """The kernels' library compiled with other flags than the one in use (cached like it)."""
    cc = c_build.compiler()
    return c_build.load(
        c_build.compile(scan_cpu.SOURCE, cc, c_build.compiler_version(cc), flags), scan_cpu.ENTRY_POINTS
    )


def assert_close32(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL32, atol=RTOL32 * expected.abs().max().item())


# --------------------------------------------------------------------------- values
@needs_kernel
@pytest.mark.parametrize("L", [1, 7, 64, 1000, 4096])
def test_kernel_equals_the_reference_in_fp32(L):
    x, dl, A, B, C, D, h0 = scan_inputs(2, L, 8, 16, seed=L)
    y, h = selective_scan_cpu(x, dl, A, B, C, D, h0=h0, return_state=True)
    y_ref, h_ref = selective_scan_ref(x, dl, A, B, C, D, h0=h0, return_state=True)
    assert y.shape == (2, L, 8) and y.dtype == torch.float32 and h.shape == (2, 8, 16)
    assert_close32(y, y_ref)
    assert_close32(h, h_ref)


@needs_kernel
@pytest.mark.parametrize("b, L, d, n", [(1, 1, 1, 1), (2, 9, 3, 5), (3, 33, 130, 7), (1, 20, 65, 33), (2, 5, 4, 64)])
def test_kernel_is_the_reference_algebra_in_fp64(b, L, d, n):
    """Any N (not a multiple of the vector width; 1; wider than a cache line), more channels than one
    block (64), row ranges that cross from one sequence to the next: the same y and state to 1e-12."""
    x, dl, A, B, C, D, h0 = scan_inputs(b, L, d, n, seed=b + L + d + n, dtype=torch.float64)
    for extra in ({}, {"h0": h0}):
        y, h = selective_scan_cpu(x, dl, A, B, C, D, return_state=True, threads=3, **extra)
        y_ref, h_ref = selective_scan_ref(x, dl, A, B, C, D, return_state=True, **extra)
        assert y.dtype == h.dtype == torch.float64
        torch.testing.assert_close(y, y_ref, rtol=TOL64, atol=TOL64)
        torch.testing.assert_close(h, h_ref, rtol=TOL64, atol=TOL64)


@needs_kernel
def test_result_does_not_depend_on_the_threads():
    """Each (sequence, channel) row is computed by one thread with the same code and the same
    alignment, so any split gives the same bits; also through Python threads (a build without OpenMP)."""
    x, dl, A, B, C, D, _ = scan_inputs(3, 50, 70, 5, seed=11)
    ys = [selective_scan_cpu(x, dl, A, B, C, D, threads=t) for t in (1, 2, 3, 7)]
    assert all(torch.equal(y, ys[0]) for y in ys[1:])
    # the Python-threads path: the same source built without -fopenmp
    library = _library_built_with(tuple(f for f in scan_cpu._built_flags if f != "-fopenmp"))
    assert not hasattr(library, "onemask_scan_f32_omp")
    for t in (1, 2, 5):
        y = scan_cpu._run(library, x, dl, A, B, C, D, torch.zeros_like(D), None, False, None, False, t)[0]
        assert torch.equal(y, ys[0])


@needs_kernel
def test_gradients_do_not_depend_on_the_threads(monkeypatch):
    """The backward's units (a sequence, a block of channels) each write their own partial sums, added
    in a fixed order: any split gives the same bits, OpenMP or Python threads (a build without it)."""
    inputs = scan_inputs(3, 50, 40, 5, seed=21)  # 40 channels: 3 backward blocks of 16, the last short

    def grads(threads):
        leaves = [t.detach().requires_grad_() for t in inputs]
        x, dl, A, B, C, D, h0 = leaves
        y, h = selective_scan_cpu(x, dl, A, B, C, D, h0=h0, return_state=True, threads=threads)
        (y.sin().sum() + h.sum()).backward()
        return [t.grad for t in leaves]

    want = grads(1)
    for threads in (2, 3, 7):
        assert all(torch.equal(g, w) for g, w in zip(grads(threads), want))
    monkeypatch.setattr(
        scan_cpu, "_library", _library_built_with(tuple(f for f in scan_cpu._built_flags if f != "-fopenmp"))
    )
    assert not hasattr(scan_cpu._library, "onemask_scan_bwd_f32_omp")
    for threads in (1, 3):
        assert all(torch.equal(g, w) for g, w in zip(grads(threads), want))


@needs_kernel
def test_half_inputs_non_contiguous_views_and_large_delta():
    x, dl, A, B, C, D, _ = scan_inputs(2, 300, 6, 4, seed=12)
    y = selective_scan_cpu(x.half(), dl.half(), A, B.half(), C.half(), D)  # read as fp32, returned as fp16
    assert y.dtype == torch.float16
    assert_close32(y.float(), selective_scan_ref(x.half(), dl.half(), A, B.half(), C.half(), D).float())
    # transposed storage: the kernel makes contiguous copies
    xt, dlt = x.transpose(1, 2).contiguous().transpose(1, 2), dl.transpose(1, 2).contiguous().transpose(1, 2)
    assert not xt.is_contiguous()
    torch.testing.assert_close(
        selective_scan_cpu(xt, dlt, A, B, C, D), selective_scan_cpu(x, dl, A, B, C, D), rtol=0, atol=0
    )
    # ... and its backward reads those copies too: the same gradients, bit for bit
    strided, dense = (_grads(selective_scan_cpu, (xx, dd, A, B, C, D, _)) for xx, dd in ((xt, dlt), (x, dl)))
    assert all(torch.equal(a, b) for a, b in zip(strided, dense))
    big = torch.where(
        torch.rand(dl.shape, generator=torch.Generator().manual_seed(13)) < 0.05, torch.full_like(dl, 50.0), dl
    )  # Δ·A down to -800: exp underflows to 0, never overflows
    y = selective_scan_cpu(x, big, A, B, C, D)
    assert torch.isfinite(y).all()
    assert_close32(y, selective_scan_ref(x, big, A, B, C, D))


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="flush-to-zero is set on x86 only")
def test_subnormals_are_flushed_inside_the_loops_and_only_there():
    """A trained Mamba decays states through subnormal numbers, which cost x86 cores ~100x per
    operation: the loops flush them to zero (an fp64 state of 1e-310 reads as 0) and restore the
    thread's floating-point mode afterwards (Python's own arithmetic still keeps subnormals)."""
    x, dl, A, B, C, D, _ = scan_inputs(1, 3, 2, 2, seed=40, dtype=torch.float64)
    tiny = torch.full((1, 2, 2), 1e-310, dtype=torch.float64)
    zero_x = torch.zeros_like(x)
    for threads in (1, 2):
        y = selective_scan_cpu(zero_x, dl, A, B, C, h0=tiny, threads=threads)
        assert selective_scan_ref(zero_x, dl, A, B, C, h0=tiny).abs().max() > 0  # the definition keeps them
        assert torch.equal(y, torch.zeros_like(y))
        leaves = [t.clone().requires_grad_() for t in (x, dl, A, B, C)]
        selective_scan_cpu(*leaves, threads=threads).sum().backward()
    small = 5e-324
    assert small * 1.0 == small and torch.tensor([small], dtype=torch.float64).mul(1.0).item() == small


# --------------------------------------------------------------------------- gradients and dispatch
NAMES = ("x", "delta", "A", "B", "C", "D", "h0")


def _grads(fn, inputs, dtype=None, *, loss="both"):
    """Every input's gradient of a loss that reads y (weighted: each position's gradient differs)
    and the final state (squared: its gradient depends on the state); loss="y" or "h" reads one."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
    x, delta, A, B, C, D, h0 = leaves
    y, h = fn(x, delta, A, B, C, D, h0=h0, return_state=True)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(y.dtype)
    total = {"both": (y * w).sum() + (h * h).sum(), "y": (y * w).sum(), "h": (h * h).sum()}[loss]
    total.backward()
    return [t.grad for t in leaves]


@needs_kernel
@pytest.mark.parametrize("every", [5, 64])
@pytest.mark.parametrize(
    "b, L, d, n", [(2, 1, 3, 4), (1, 5, 1, 1), (2, 12, 3, 4), (2, 21, 17, 5), (3, 64, 37, 16), (1, 130, 16, 33)]
)
def test_fused_backward_is_the_references_gradient_in_fp64(b, L, d, n, every, monkeypatch):
    """The same gradients as autograd through the per-step reference, to 1e-10, for every input: L = 1,
    lengths that are and are not multiples of the checkpoint interval K (5 here, and the default),
    one segment or many, channels in one backward block of 16 or across several (17, 37), a carried state."""
    monkeypatch.setattr(scan_cpu, "CHECKPOINT_EVERY", every)
    inputs = scan_inputs(b, L, d, n, seed=b + L + d + n, dtype=torch.float64)
    for name, got, want in zip(NAMES, _grads(selective_scan_cpu, inputs), _grads(selective_scan_ref, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


# fp32 gradients against the fp64 reference, relative to the largest gradient: every scan rounds
# differently (the loop's vector exp, the sums' orders), and the backward's sums over the sequence
# (A's over B·L terms) are the longest; the C loop adds them per segment, then the segments, so its
# error grows with K + L/K terms, not L. Measured here: at most 8e-7 (A's, L = 333, large Δ); the reference
# itself in fp32 reaches 4e-7. 1e-5, as the forward, fails on any algorithmic slip (those are O(1)).
GRAD_RTOL32 = 1e-5


@needs_kernel
@pytest.mark.parametrize(
    "b, L, d, n, big_delta", [(2, 1000, 20, 16, False), (2, 4096, 8, 16, False), (2, 333, 37, 16, True)]
)
def test_fused_backward_in_fp32_is_within_budget_of_the_fp64_reference(b, L, d, n, big_delta):
    inputs = list(scan_inputs(b, L, d, n, seed=L))
    if big_delta:  # Δ·A down to -800: the decays underflow to 0, gradients through them too, never NaN
        dl = inputs[1]
        inputs[1] = torch.where(
            torch.rand(dl.shape, generator=torch.Generator().manual_seed(13)) < 0.05, torch.full_like(dl, 50.0), dl
        )
    for name, got, want in zip(
        NAMES, _grads(selective_scan_cpu, inputs), _grads(selective_scan_ref, inputs, torch.float64)
    ):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        torch.testing.assert_close(
            got.double(),
            want,
            rtol=GRAD_RTOL32,
            atol=GRAD_RTOL32 * want.abs().max().item(),
            msg=lambda m: f"grad of {name}: {m}",
        )


@needs_kernel
def test_fused_backward_passes_gradcheck_and_reads_either_output(monkeypatch):
    """torch.autograd.gradcheck (finite differences, fp64) with and without the state and the skip;
    a loss of y alone or of the final state alone; gradients for only some inputs."""
    monkeypatch.setattr(scan_cpu, "CHECKPOINT_EVERY", 3)  # 7 positions: segments of 3, 3 and 1
    x, dl, A, B, C, D, h0 = (t.requires_grad_() for t in scan_inputs(2, 7, 18, 3, seed=22, dtype=torch.float64))
    assert torch.autograd.gradcheck(
        lambda *a: selective_scan_cpu(*a[:6], h0=a[6], return_state=True), (x, dl, A, B, C, D, h0)
    )
    assert torch.autograd.gradcheck(lambda *a: selective_scan_cpu(*a), (x, dl, A, B, C))
    inputs = [t.detach() for t in (x, dl, A, B, C, D, h0)]
    for loss in ("y", "h"):
        for name, got, want in zip(
            NAMES, _grads(selective_scan_cpu, inputs, loss=loss), _grads(selective_scan_ref, inputs, loss=loss)
        ):
            if want is None:  # C and D do not reach the final state: autograd leaves no gradient, the loop zeros
                assert name in ("C", "D") and loss == "h" and (got is None or not got.any())
                continue
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"{loss}: grad of {name}: {m}")
    only = [t.detach().requires_grad_(i in (1, 3)) for i, t in enumerate(inputs)]  # Δ and B only
    selective_scan_cpu(*only[:6], h0=only[6]).sum().backward()
    assert [t.grad is not None for t in only] == [False, True, False, True, False, False, False]


# --------------------------------------------------------------------------- the mixer's extras in the loops
EXTRA_NAMES = ("x", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")


def _extras_inputs(b, L, d, n, *, seed, softplus=True, dtype=torch.float64):
    """scan_inputs plus a gate z and a bias per channel; under softplus, delta is the raw Δ before
    it: both signs, and every 7th entry above softplus's threshold of 20 (where Δ is delta itself)."""
    x, dl, A, B, C, D, h0 = scan_inputs(b, L, d, n, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1000)
    if softplus:
        dl = torch.randn(b, L, d, generator=g, dtype=dtype) * 3 - 2
        dl.view(-1)[::7] = 21.0
    bias = torch.randn(d, generator=g, dtype=dtype) if softplus else torch.rand(d, generator=g, dtype=dtype) * 0.1
    z = torch.randn(b, L, d, generator=g, dtype=dtype) * 3
    return x, dl, A, B, C, D, z, bias, h0


def _extras_grads(fn, inputs, *, gate, bias, softplus, dtype=None, **kw):
    """y, the final state and every input's gradient (None where an input is not used)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
    x, dl, A, B, C, D, z, delta_bias, h0 = leaves
    y, h = fn(
        x,
        dl,
        A,
        B,
        C,
        D,
        z=z if gate else None,
        delta_bias=delta_bias if bias else None,
        delta_softplus=softplus,
        h0=h0,
        return_state=True,
        **kw,
    )
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(y.dtype)
    ((y * w).sum() + (h * h).sum()).backward()
    return [y.detach(), h.detach()] + [t.grad for t in leaves]


@needs_kernel
@pytest.mark.parametrize(
    "gate, bias, softplus",
    [(True, True, True), (True, False, False), (False, True, True), (False, True, False), (True, False, True)],
)
@pytest.mark.parametrize("b, L, d, n", [(2, 1, 3, 4), (2, 21, 17, 5), (3, 70, 37, 16), (1, 9, 70, 16)])
def test_the_loop_takes_in_the_softplus_the_skip_and_the_gate(b, L, d, n, gate, bias, softplus, monkeypatch):
    """The official selective_scan_fn's extras, fused: Δ = softplus(delta + delta_bias) (or without
    softplus), the skip, the gate y ⊙ silu(z). fp64, against the reference applying them with PyTorch
    around its per-step loop: the output, the final state and all nine gradients to 1e-10 (delta
    both below and above softplus's threshold; channels across forward blocks of 64 and backward
    blocks of 16; segments of 8); the same bits on 1 and 3 threads."""
    monkeypatch.setattr(scan_cpu, "CHECKPOINT_EVERY", 8)
    inputs = _extras_inputs(b, L, d, n, seed=b + L + d + n, softplus=softplus)
    flags = dict(gate=gate, bias=bias, softplus=softplus)
    got = _extras_grads(selective_scan_cpu, inputs, threads=1, **flags)
    want = _extras_grads(selective_scan_ref, inputs, **flags)
    for name, g, w in zip(("y", "state") + EXTRA_NAMES, got, want):
        if w is None:  # an extra left out: no gradient
            assert g is None and name in ("z", "delta_bias"), name
            continue
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    again = _extras_grads(selective_scan_cpu, inputs, threads=3, **flags)
    assert all((g is None and a is None) or torch.equal(g, a) for g, a in zip(got, again))


@needs_kernel
def test_the_fused_extras_pass_gradcheck_and_fp32_stays_within_budget():
    inputs = [t.requires_grad_() for t in _extras_inputs(2, 11, 18, 3, seed=50)]
    assert torch.autograd.gradcheck(
        lambda x, dl, A, B, C, D, z, bias, h0: selective_scan_cpu(
            x, dl, A, B, C, D, z=z, delta_bias=bias, delta_softplus=True, h0=h0, return_state=True
        ),
        inputs,
    )
    inputs = _extras_inputs(2, 500, 40, 16, seed=51, dtype=torch.float32)
    flags = dict(gate=True, bias=True, softplus=True)
    for name, g, w in zip(
        ("y", "state") + EXTRA_NAMES,
        _extras_grads(selective_scan_cpu, inputs, **flags),
        _extras_grads(selective_scan_ref, inputs, dtype=torch.float64, **flags),
    ):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        torch.testing.assert_close(
            g.double(), w, rtol=GRAD_RTOL32, atol=GRAD_RTOL32 * w.abs().max().item(), msg=lambda m: f"{name}: {m}"
        )


@needs_kernel
def test_a_tiny_step_keeps_its_relative_precision():
    """softplus of a very negative delta is tiny (about e^delta); the loop's log1p, made from a vector
    log, keeps its low bits (Goldberg's correction), so y, proportional to Δ here (no state, no skip),
    matches the reference's torch.softplus relatively, to 1e-12 (plain log(1 + w) is off by 1e-5)."""
    x, _, A, B, C, _, _ = scan_inputs(1, 6, 9, 4, seed=53, dtype=torch.float64)
    raw = torch.linspace(-30, -20, 54, dtype=torch.float64).view(1, 6, 9)
    torch.testing.assert_close(
        selective_scan_cpu(x, raw, A, B, C, delta_softplus=True),
        selective_scan_ref(x, raw, A, B, C, delta_softplus=True),
        rtol=1e-12,
        atol=0,
    )


@pytest.mark.parametrize("impl", ["chunked", "parallel", "auto"])
def test_every_scan_applies_the_extras_as_the_reference_does(impl):
    """The scans without them in their loops apply delta_bias, softplus and the gate around the scan:
    the same output and gradients as the reference."""
    from lib.scan import parallel_scan_ref

    fn = parallel_scan_ref if impl == "parallel" else lambda *a, **k: selective_scan(*a, impl=impl, **k)
    inputs = _extras_inputs(2, 13, 6, 4, seed=52)
    flags = dict(gate=True, bias=True, softplus=True)
    for name, g, w in zip(
        ("y", "state") + EXTRA_NAMES,
        _extras_grads(fn, inputs, **flags),
        _extras_grads(selective_scan_ref, inputs, **flags),
    ):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


@needs_kernel
def test_fused_backward_keeps_one_state_per_segment_not_every_state():
    """What autograd keeps for the backward: the inputs and a checkpoint every K positions; never a
    (B, L, D, N) tensor, which is what the chunked scan's autograd graph holds many of."""
    x, dl, A, B, C, D, h0 = (t.requires_grad_() for t in scan_inputs(2, 512, 32, 16, seed=23))
    for impl, most in (("cpu", 2 * 512 * 32 * 16 // scan_cpu.CHECKPOINT_EVERY), ("chunked", None)):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            selective_scan(x, dl, A, B, C, D, h0=h0, impl=impl)
        if most is not None:
            assert max(sizes) == 2 * 512 * 32 and sum(s for s in sizes if s > 2 * 512 * 32) == 0
            assert most in sizes  # the checkpoints: B·D·N·L/K numbers
        else:
            assert sum(sizes) > 2 * 512 * 32 * 16  # the chunked scan keeps more than one whole state sequence


@needs_kernel
def test_auto_takes_the_loop_for_cpu_inputs_with_or_without_gradients():
    x, dl, A, B, C, D, _ = scan_inputs(2, 40, 5, 3, seed=14)
    fused, chunked = selective_scan(x, dl, A, B, C, D, impl="cpu"), selective_scan(x, dl, A, B, C, D, impl="chunked")
    assert not torch.equal(fused, chunked)  # they round differently, so the bits tell which one ran
    assert torch.equal(selective_scan(x, dl, A, B, C, D), fused)  # no input requires grad
    xg = x.clone().requires_grad_()
    assert torch.equal(selective_scan(xg, dl, A, B, C, D), fused)  # a gradient is needed: the fused backward
    with torch.no_grad():
        assert torch.equal(selective_scan(xg, dl, A, B, C, D), fused)
    assert torch.equal(
        selective_scan(x, dl, A, B, C, D, chunk_size=8), selective_scan(x, dl, A, B, C, D, chunk_size=8, impl="chunked")
    )
    # a model reads and trains with the loop: its logits, loss and every parameter's gradient
    # match the chunked model's (fp32, rounding only)
    torch.manual_seed(0)
    model = MambaLM(MambaConfig.tiny(d_model=32, n_layers=2))
    chunked_model = MambaLM(MambaConfig.tiny(d_model=32, n_layers=2, scan="chunked"))
    chunked_model.load_state_dict(model.state_dict())
    idx = torch.randint(64, (2, 25), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), chunked_model(idx), rtol=1e-5, atol=1e-5)
    for m in (model, chunked_model):
        m(idx[:, :-1], idx[:, 1:])[1].backward()
    for (name, p), q in zip(model.named_parameters(), chunked_model.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4, atol=1e-4 * q.grad.abs().max().item(), msg=lambda m: f"grad of {name}: {m}"
        )


def test_without_the_kernel_auto_falls_back_and_the_kernel_says_why(monkeypatch):
    monkeypatch.setattr(scan_cpu, "_library", None)
    monkeypatch.setattr(scan_cpu, "_status", "unavailable: no C compiler found (a test says so)")
    x, dl, A, B, C, D, _ = scan_inputs(2, 30, 4, 3, seed=16)
    with torch.no_grad():
        assert torch.equal(selective_scan(x, dl, A, B, C, D), selective_scan(x, dl, A, B, C, D, impl="chunked"))
    with pytest.raises(RuntimeError, match=r"selective_scan_cpu is unavailable: no C compiler found .*selective_scan"):
        selective_scan_cpu(x, dl, A, B, C, D)
    assert not cpu_kernel_available()


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"ONEMASK_CPU_KERNEL": "0"}, "unavailable: switched off"),
        ({"CC": "/nonexistent/cc"}, "unavailable: CC='/nonexistent/cc' is not"),
    ],
)
def test_a_fresh_process_without_a_compiler_reports_it_and_still_scans(env, expected, tmp_path):
    code = (
        "import torch; from lib.kernels.scan_cpu import cpu_kernel_status; from lib.scan import selective_scan;"
        "print(cpu_kernel_status());"
        "y = selective_scan(torch.randn(1, 9, 2), torch.rand(1, 9, 2), -torch.ones(2, 3), torch.randn(1, 9, 3),"
        " torch.randn(1, 9, 3)); print(tuple(y.shape))"
    )
    env = {**os.environ, "ONEMASK_CACHE": str(tmp_path), **env}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    status, shape = out.stdout.strip().splitlines()[-2:]
    assert status.startswith(expected) and shape == "(1, 9, 2)"
    assert list(tmp_path.iterdir()) == []  # nothing was built


@needs_kernel
def test_the_build_is_cached_by_source_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEMASK_CACHE", str(tmp_path))
    cc = c_build.compiler()
    version = c_build.compiler_version(cc)
    first = c_build.compile(scan_cpu.SOURCE, cc, version, scan_cpu._built_flags)
    stamp = first.stat().st_mtime_ns
    assert c_build.compile(scan_cpu.SOURCE, cc, version, scan_cpu._built_flags) == first
    assert first.stat().st_mtime_ns == stamp  # not rebuilt
    other = c_build.compile(
        scan_cpu.SOURCE, cc, version, tuple(f for f in scan_cpu._built_flags if f != "-O3") + ("-O2",)
    )
    assert other != first and sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])
    assert scan_cpu._self_check(c_build.load(other, scan_cpu.ENTRY_POINTS)) is None


# --------------------------------------------------------------------------- bad input
@needs_kernel
@pytest.mark.parametrize("case", bad_scan_cases(), ids=lambda c: c[0])
def test_kernel_refuses_bad_inputs_like_the_other_scans(case):
    _, kwargs, error, message = case
    with pytest.raises(error) as info:
        selective_scan_cpu(**kwargs)
    assert str(info.value) == message


@needs_kernel
def test_kernel_specific_bad_arguments():
    x, dl, A, B, C, D, _ = scan_inputs(2, 6, 3, 4)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        selective_scan_cpu(x, dl, A, B, C, threads=0)
    with pytest.raises(TypeError, match="return_state must be a bool"):
        selective_scan_cpu(x, dl, A, B, C, return_state="yes")
    with pytest.raises(ValueError, match="selective_scan_cpu runs on CPU tensors, got device meta"):
        scan_cpu.require_cpu(torch.empty(1, device="meta").device)


# --------------------------------------------------------------------------- the mixer's convolution
def _conv_inputs(b, t, e, k, *, seed, dtype=torch.float64, bias=True, state=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, 2 * e, generator=g, dtype=dtype)[..., :e]  # a slice, as in_proj(x).chunk(2) gives
    w = torch.randn(e, 1, k, generator=g, dtype=dtype)
    return (
        x,
        w,
        torch.randn(e, generator=g, dtype=dtype) if bias else None,
        torch.randn(b, e, k - 1, generator=g, dtype=dtype) if state else None,
    )


@needs_kernel
@pytest.mark.parametrize("b, t, e, k", [(1, 1, 1, 1), (2, 1, 5, 4), (2, 2, 3, 4), (3, 25, 130, 4), (2, 9, 8, 7)])
@pytest.mark.parametrize("bias, state", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_loop_is_the_grouped_conv1d_with_its_gradients(b, t, e, k, bias, state, activation):
    """fp64: the loop's output and the gradients of x, weight, bias and the carried inputs equal
    PyTorch's grouped conv1d's (then its SiLU, with activation="silu") to 1e-12; T = 1, T shorter
    than the K − 1 carried inputs, K = 1."""
    inputs = _conv_inputs(b, t, e, k, seed=b + t + e + k, bias=bias, state=state)
    w_out = torch.randn(b, t, e, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def run(fn):
        leaves = [None if v is None else v.detach().requires_grad_() for v in inputs]
        y = fn(*leaves)
        (y * w_out).sum().backward()
        return [y] + [None if v is None else v.grad for v in leaves]

    got, want = (
        run(lambda *a: causal_conv1d_cpu(*a, activation=activation)),
        run(lambda *a: causal_conv1d_ref(*a, activation)),
    )
    for name, got_one, want_one in zip(("y", "x", "weight", "bias", "state"), got, want):
        if want_one is None:
            assert got_one is None
            continue
        torch.testing.assert_close(got_one, want_one, rtol=TOL64, atol=TOL64, msg=lambda m: f"{name}: {m}")


@needs_kernel
def test_conv_loop_in_fp32_threads_and_bad_inputs():
    x, w, bias, state = (v.float() for v in _conv_inputs(4, 30, 64, 4, seed=30))
    y = causal_conv1d_cpu(x, w, bias, state)
    assert y.dtype == torch.float32
    assert_close32(y, causal_conv1d_ref(x, w, bias, state))
    assert all(torch.equal(causal_conv1d_cpu(x, w, bias, state, threads=n), y) for n in (1, 3))
    assert torch.equal(causal_conv1d(x, w, bias, state), y)  # the front door takes the loop on a CPU
    with pytest.raises(ValueError, match=r"weight must have shape \(E, 1, K\)"):
        causal_conv1d_cpu(x, w[:5], bias, state)
    with pytest.raises(ValueError, match=r"state must have shape \(4, 64, 3\)"):
        causal_conv1d_cpu(x, w, bias, state[..., :2])
    with pytest.raises(ValueError, match=r"x must have rank 3|x must have shape"):
        causal_conv1d_cpu(x[0], w, bias)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        causal_conv1d_cpu(x.long(), w, bias)
    with pytest.raises(ValueError, match=r"activation must be one of \(None, 'silu'\), got 'relu'"):
        causal_conv1d(x, w, bias, activation="relu")
    y = causal_conv1d_cpu(x, w, bias, state, activation="silu")  # fp32, fused SiLU
    assert_close32(y, causal_conv1d_ref(x, w, bias, state, "silu"))


def test_where_a_c_compiler_works_the_kernel_builds_and_passes_its_self_check(tmp_path):
    """A bug in scan_cpu.c fails its self-check and the library switches the kernel off (the
    PyTorch scan takes over, the kernel's tests skip): on a machine whose compiler builds a shared
    library, that must fail the suite here instead of passing it quietly."""
    if os.environ.get("ONEMASK_CPU_KERNEL", "1") == "0":
        pytest.skip("the CPU kernel is switched off (ONEMASK_CPU_KERNEL=0)")
    cc = c_build.compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine: the PyTorch scan is the designed fallback")
    (tmp_path / "probe.c").write_text("int onemask_probe(int x) { return x + 1; }\n")
    probe = subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(tmp_path / "probe.so"), str(tmp_path / "probe.c")],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"{cc} does not build a shared library here: {probe.stderr.strip()[:200]}")
    assert cpu_kernel_available(), f"a working compiler, yet the kernel is {cpu_kernel_status()}"
