"""lib.kernels.scan_cpu: the fused C loop equals the reference (fp32 and fp64, any N, channel blocks
split across sequences, a carried state, the skip, half inputs, non-contiguous views, large Δ),
its result does not depend on the number of threads or on how they are made, its gradients are the
chunked scan's, selective_scan's "auto" takes it exactly when no gradient is needed, and a machine
without a working compiler falls back cleanly with a reason.

Needs a C compiler (CI's machine has gcc); where none works, the kernel tests skip and say why, and
the fallback tests still run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lib.kernels.scan_cpu as scan_cpu
from lib.kernels.scan_cpu import cpu_kernel_available, cpu_kernel_status, selective_scan_cpu
from lib.ssm import MambaConfig, MambaLM, selective_scan, selective_scan_ref
from tests.test_ssm import TOL64, _bad_scan_cases, scan_inputs

ROOT = Path(__file__).resolve().parent.parent
needs_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason=f"the CPU scan kernel is {cpu_kernel_status()}")

# The loop adds the same terms as the reference in the same order along the sequence; they differ
# where exp rounds differently (glibc's vector expf is within 4 ulp, torch's within 1) and in the
# order of the N-term sum C·h (the loop sums in vector lanes). Measured: below 1e-6 of the output's
# largest value. 1e-5 (~100 ε32) is what every other scan is held to (tests/test_ssm.py).
RTOL32 = 1e-5


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
    flags = tuple(f for f in scan_cpu._built_flags if f != "-fopenmp")
    library = scan_cpu._load(scan_cpu._compile(scan_cpu._compiler(), scan_cpu._compiler_version(scan_cpu._compiler()),
                                               flags))
    assert not hasattr(library, "onemask_scan_f32_omp")
    for t in (1, 2, 5):
        y, _ = scan_cpu._run(library, x, dl, A, B, C, None, False, t)
        assert torch.equal(y + x * D, ys[0])


@needs_kernel
def test_half_inputs_non_contiguous_views_and_large_delta():
    x, dl, A, B, C, D, _ = scan_inputs(2, 300, 6, 4, seed=12)
    y = selective_scan_cpu(x.half(), dl.half(), A, B.half(), C.half(), D)  # read as fp32, returned as fp16
    assert y.dtype == torch.float16
    assert_close32(y.float(), selective_scan_ref(x.half(), dl.half(), A, B.half(), C.half(), D).float())
    # transposed storage: the kernel makes contiguous copies
    xt, dlt = x.transpose(1, 2).contiguous().transpose(1, 2), dl.transpose(1, 2).contiguous().transpose(1, 2)
    assert not xt.is_contiguous()
    torch.testing.assert_close(selective_scan_cpu(xt, dlt, A, B, C, D), selective_scan_cpu(x, dl, A, B, C, D),
                               rtol=0, atol=0)
    big = torch.where(torch.rand(dl.shape, generator=torch.Generator().manual_seed(13)) < 0.05,
                      torch.full_like(dl, 50.0), dl)  # Δ·A down to -800: exp underflows to 0, never overflows
    y = selective_scan_cpu(x, big, A, B, C, D)
    assert torch.isfinite(y).all()
    assert_close32(y, selective_scan_ref(x, big, A, B, C, D))


# --------------------------------------------------------------------------- gradients and dispatch
@needs_kernel
def test_gradients_are_the_chunked_scans_and_the_references():
    inputs = scan_inputs(2, 21, 3, 4, seed=4, dtype=torch.float64)
    w = torch.randn(2, 21, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def grads(fn):
        leaves = [t.detach().requires_grad_() for t in inputs]
        x, delta, A, B, C, D, h0 = leaves
        y, h = fn(x, delta, A, B, C, D, h0=h0, return_state=True)
        ((y * w).sum() + h.sum()).backward()
        return [t.grad for t in leaves]

    for name, got, want in zip(["x", "delta", "A", "B", "C", "D", "h0"], grads(selective_scan_cpu),
                               grads(selective_scan_ref)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


@needs_kernel
def test_auto_takes_the_loop_exactly_when_no_gradient_is_needed():
    x, dl, A, B, C, D, _ = scan_inputs(2, 40, 5, 3, seed=14)
    fused, chunked = selective_scan(x, dl, A, B, C, D, impl="cpu"), selective_scan(x, dl, A, B, C, D, impl="chunked")
    assert not torch.equal(fused, chunked)  # they round differently, so the bits tell which one ran
    assert torch.equal(selective_scan(x, dl, A, B, C, D), fused)  # no input requires grad
    xg = x.clone().requires_grad_()
    assert torch.equal(selective_scan(xg, dl, A, B, C, D), chunked)  # a gradient is needed
    with torch.no_grad():
        assert torch.equal(selective_scan(xg, dl, A, B, C, D), fused)
    assert torch.equal(selective_scan(x, dl, A, B, C, D, chunk_size=8), selective_scan(x, dl, A, B, C, D, chunk_size=8,
                                                                                       impl="chunked"))
    # a model in eval under no_grad decodes with the loop; its logits match the chunked model's
    torch.manual_seed(0)
    model = MambaLM(MambaConfig.tiny(d_model=32, n_layers=2)).eval()
    chunked_model = MambaLM(MambaConfig.tiny(d_model=32, n_layers=2, scan="chunked")).eval()
    chunked_model.load_state_dict(model.state_dict())
    idx = torch.randint(64, (2, 25), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), chunked_model(idx), rtol=1e-5, atol=1e-5)


def test_without_the_kernel_auto_falls_back_and_the_kernel_says_why(monkeypatch):
    monkeypatch.setattr(scan_cpu, "_library", None)
    monkeypatch.setattr(scan_cpu, "_status", "unavailable: no C compiler found (a test says so)")
    x, dl, A, B, C, D, _ = scan_inputs(2, 30, 4, 3, seed=16)
    with torch.no_grad():
        assert torch.equal(selective_scan(x, dl, A, B, C, D), selective_scan(x, dl, A, B, C, D, impl="chunked"))
    with pytest.raises(RuntimeError, match=r"selective_scan_cpu is unavailable: no C compiler found .*selective_scan"):
        selective_scan_cpu(x, dl, A, B, C, D)
    assert not cpu_kernel_available()


@pytest.mark.parametrize("env, expected", [({"ONEMASK_CPU_KERNEL": "0"}, "unavailable: switched off"),
                                           ({"CC": "/nonexistent/cc"}, "unavailable: CC='/nonexistent/cc' is not")])
def test_a_fresh_process_without_a_compiler_reports_it_and_still_scans(env, expected, tmp_path):
    code = ("import torch; from lib.kernels.scan_cpu import cpu_kernel_status; from lib.ssm import selective_scan;"
            "print(cpu_kernel_status());"
            "y = selective_scan(torch.randn(1, 9, 2), torch.rand(1, 9, 2), -torch.ones(2, 3), torch.randn(1, 9, 3),"
            " torch.randn(1, 9, 3)); print(tuple(y.shape))")
    env = {**os.environ, "ONEMASK_CACHE": str(tmp_path), **env}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    status, shape = out.stdout.strip().splitlines()[-2:]
    assert status.startswith(expected) and shape == "(1, 9, 2)"
    assert list(tmp_path.iterdir()) == []  # nothing was built


@needs_kernel
def test_the_build_is_cached_by_source_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEMASK_CACHE", str(tmp_path))
    cc = scan_cpu._compiler()
    version = scan_cpu._compiler_version(cc)
    first = scan_cpu._compile(cc, version, scan_cpu._built_flags)
    stamp = first.stat().st_mtime_ns
    assert scan_cpu._compile(cc, version, scan_cpu._built_flags) == first and first.stat().st_mtime_ns == stamp
    other = scan_cpu._compile(cc, version, tuple(f for f in scan_cpu._built_flags if f != "-O3") + ("-O2",))
    assert other != first and sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])
    assert scan_cpu._self_check(scan_cpu._load(other)) is None


# --------------------------------------------------------------------------- bad input
@needs_kernel
@pytest.mark.parametrize("case", _bad_scan_cases(), ids=lambda c: c[0])
def test_kernel_refuses_bad_inputs_like_the_other_scans(case):
    _, kwargs, error, message = case
    with pytest.raises(error, match=message):
        selective_scan_cpu(**kwargs)


@needs_kernel
def test_kernel_specific_bad_arguments():
    x, dl, A, B, C, D, _ = scan_inputs(2, 6, 3, 4)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        selective_scan_cpu(x, dl, A, B, C, threads=0)
    with pytest.raises(TypeError, match="return_state must be a bool"):
        selective_scan_cpu(x, dl, A, B, C, return_state="yes")
    with pytest.raises(ValueError, match="impl must be one of"):
        selective_scan(x, dl, A, B, C, impl="fast")
    with pytest.raises(ValueError, match="chunk_size is for impl='chunked'"):
        selective_scan(x, dl, A, B, C, chunk_size=4, impl="cpu")
    with pytest.raises(ValueError, match="selective_scan_cpu runs on CPU tensors, got device meta"):
        scan_cpu._require_cpu(torch.empty(1, device="meta").device)
