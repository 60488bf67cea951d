"""lib.kernels.scan: the fused Triton selective scan equals the reference (values, carried state,
the skip), its gradients are the chunked scan's, it stays finite for large Δ, a Mamba model can use
it, and bad input gets a clear error.

Runs everywhere: without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which is slow per position, so lengths stay short here (up to 130: longer
than two of the kernel's channel blocks and no multiple of anything). On a GPU the same tests run
compiled on CUDA tensors, plus one long sequence.
"""

from functools import partial

import pytest
import torch
from scan_builders import scan_inputs

import lib.kernels.runtime as runtime
from lib.kernels import kernel_mode
from lib.mamba import MambaConfig
from lib.mamba_lm import MambaLM
from lib.scan import selective_scan, selective_scan_ref, selective_scan_triton

ON_GPU = torch.cuda.is_available() and kernel_mode() == "compiled"
DEVICE = "cuda" if ON_GPU else "cpu"
needs_kernels = pytest.mark.skipif(kernel_mode() == "unavailable", reason="no GPU and TRITON_INTERPRET is not set")

# The kernel and the reference add the same terms in the same order, step by step, in fp32; they
# differ only where exp and the N-term dot product C·h round differently (the kernel sums the N
# products in a tree, the reference with torch.sum). Measured: about 1e-7 relative to the output's
# largest value. 1e-5 (~100 ε32) is the bound the other scans are held to in tests/lib/test_scan.py.
RTOL32 = 1e-5


def on_device(tensors):
    return [t.to(DEVICE) for t in tensors]


def assert_close32(actual, expected):
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=RTOL32, atol=RTOL32 * expected.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("b, L, d, n", [(1, 1, 4, 3), (2, 7, 5, 16), (1, 130, 70, 5), (3, 33, 16, 1)])
@pytest.mark.parametrize("with_skip_and_state", [True, False])
def test_kernel_equals_the_reference(b, L, d, n, with_skip_and_state):
    x, dl, A, B, C, D, h0 = on_device(scan_inputs(b, L, d, n, seed=L + d, x_sign="mixed"))
    extra = dict(h0=h0) if with_skip_and_state else {}
    skip = D if with_skip_and_state else None
    y, h = selective_scan_triton(x, dl, A, B, C, skip, return_state=True, **extra)
    y_ref, h_ref = selective_scan_ref(x, dl, A, B, C, skip, return_state=True, **extra)
    assert y.shape == (b, L, d) and y.dtype == x.dtype and h.shape == (b, d, n)
    assert_close32(y, y_ref)
    assert_close32(h, h_ref)


@needs_kernels
def test_carried_state_splits_a_sequence():
    x, dl, A, B, C, D, _ = on_device(scan_inputs(2, 40, 6, 4, seed=3))
    whole = selective_scan_triton(x, dl, A, B, C, D)
    first, h = selective_scan_triton(x[:, :17], dl[:, :17], A, B[:, :17], C[:, :17], D, return_state=True)
    second = selective_scan_triton(x[:, 17:], dl[:, 17:], A, B[:, 17:], C[:, 17:], D, h0=h)
    assert_close32(torch.cat([first, second], dim=1), whole)


@needs_kernels
@pytest.mark.parametrize("delta", [50.0, 1e4])
def test_large_delta_stays_finite_and_forgets(delta):
    # Ā = exp(Δ·A) underflows to 0: the state is replaced at every step by B̄_t x_t, never overflows
    x, dl, A, B, C, D, h0 = on_device(scan_inputs(1, 20, 4, 3, seed=5, delta=delta))
    y = selective_scan_triton(x, dl, A, B, C, D, h0=h0)
    assert torch.isfinite(y).all()
    assert_close32(y, selective_scan_ref(x, dl, A, B, C, D, h0=h0))


@needs_kernels
def test_gradients_are_the_chunked_scans():
    # The backward recomputes with the chunked scan (lib.scan.selective_scan, impl="chunked"); with
    # the same upstream gradient the gradients are bit-for-bit the chunked scan's own.
    inputs = on_device(scan_inputs(2, 19, 5, 3, seed=7))
    upstream_y = torch.randn(2, 19, 5, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    upstream_h = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def grads(scan):
        leaves = [t.clone().requires_grad_() for t in inputs]
        x, dl, A, B, C, D, h0 = leaves
        y, h = scan(x, dl, A, B, C, D, h0=h0, return_state=True)
        torch.autograd.backward([y, h], [upstream_y, upstream_h])
        return [leaf.grad for leaf in leaves]

    for got, want in zip(grads(selective_scan_triton), grads(partial(selective_scan, impl="chunked"))):
        assert torch.equal(got, want)


@needs_kernels
def test_gradient_flows_only_to_inputs_that_want_it():
    x, dl, A, B, C, D, _ = on_device(scan_inputs(1, 9, 4, 2, seed=11))
    x.requires_grad_()
    selective_scan_triton(x, dl, A, B, C, D).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and dl.grad is None and A.grad is None


@needs_kernels
def test_half_precision_input_is_computed_in_fp32():
    x, dl, A, B, C, D, h0 = on_device(scan_inputs(1, 12, 4, 3, seed=13))
    y16 = selective_scan_triton(x.half(), dl.half(), A.half(), B.half(), C.half(), D.half())
    want = selective_scan_ref(*(t.half().float() for t in (x, dl, A, B, C, D)))
    assert y16.dtype == torch.float16
    # the only difference is the final rounding of y to fp16: half an ulp, 2^-11 relative
    torch.testing.assert_close(y16.float().cpu(), want.cpu(), rtol=2**-10, atol=2**-10 * want.abs().max().item())


@needs_kernels
def test_a_mamba_model_can_use_the_kernel_and_gets_the_same_logits():
    config = MambaConfig(vocab_size=32, d_model=16, n_layers=2, d_state=4)
    torch.manual_seed(0)
    model = MambaLM(config).to(DEVICE)
    idx = torch.randint(32, (2, 11), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    chunked, _ = model(idx)
    for layer in model.layers:
        layer.mixer.ssm.scan = "triton"
    fused, _ = model(idx)
    assert_close32(fused, chunked)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(A=lambda A: -A), ValueError, "A must be negative"),
        (dict(B=lambda B: B[:, :, :-1]), ValueError, r"B must have shape \(B, L, N\)"),
        (dict(x=lambda x: x.double()), TypeError, "refuses float64"),
        (dict(delta=lambda d: -d), ValueError, "delta must be >= 0"),
        (dict(x=lambda x: x.long()), TypeError, "floating"),
    ],
)
def test_bad_input_is_refused_clearly(change, error, words):
    x, dl, A, B, C, D, _ = on_device(scan_inputs(1, 5, 3, 2, seed=17))
    args = dict(x=x, delta=dl, A=A, B=B, C=C)
    for name, fn in change.items():
        args[name] = fn(args[name])
    if "float64" in words:  # every input float64: the dtype check, not the shape check, must speak
        args = {k: v.double() for k, v in args.items()}
    with pytest.raises(error, match=words):
        selective_scan_triton(**args)


@needs_kernels
def test_tensors_the_compiled_kernel_cannot_reach_are_refused(monkeypatch):
    # Compiled kernels read CUDA memory only: CPU tensors must be refused with the way out, not
    # handed to a launch. Here the compiled mode is simulated where the interpreter runs.
    monkeypatch.setattr(runtime, "kernel_mode", lambda: "compiled")
    x, dl, A, B, C, D, _ = scan_inputs(1, 5, 3, 2, seed=19)
    with pytest.raises(RuntimeError, match=r"compiled for CUDA only.*TRITON_INTERPRET=1.*lib\.scan\.selective_scan"):
        selective_scan_triton(x, dl, A, B, C, D)


def test_without_triton_the_error_names_the_package_and_the_fallback(monkeypatch):
    monkeypatch.setattr(runtime, "_loaded", (None, None, False))
    x, dl, A, B, C, D, _ = scan_inputs(1, 5, 3, 2, seed=19)
    with pytest.raises(RuntimeError, match=r"needs the `triton` package.*lib\.scan\.selective_scan"):
        selective_scan_triton(x, dl, A, B, C, D)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")
def test_gpu_long_sequence_at_mamba_width_equals_the_chunked_scan():
    x, dl, A, B, C, D, h0 = on_device(scan_inputs(2, 4096, 1536, 16, seed=23))
    y, h = selective_scan_triton(x, dl, A, B, C, D, h0=h0, return_state=True)
    y_ref, h_ref = selective_scan(x, dl, A, B, C, D, h0=h0, return_state=True)
    assert_close32(y, y_ref)
    assert_close32(h, h_ref)
