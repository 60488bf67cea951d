"""lib.kernels: the Triton flash attention equals the reference, forward and backward; the causal
schedule skips the tiles it says it skips; bad input gets a clear error, never a crash.

Runs everywhere: without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports them). A segfault would kill this whole process, so
every test passing is itself the check that no launch reads or writes out of bounds.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import lib.kernels.flash as flash
import lib.kernels.runtime as runtime
from lib.attention import BACKENDS, attention, attention_ref
from lib.kernels import (
    SUPPORTED_HEAD_DIMS,
    default_block_sizes,
    flash_attention,
    kernel_mode,
    key_block_bounds,
    visited_blocks,
)

EPS32 = torch.finfo(torch.float32).eps
ON_GPU = torch.cuda.is_available() and kernel_mode() == "compiled"
needs_kernels = pytest.mark.skipif(kernel_mode() == "unavailable", reason="no GPU and TRITON_INTERPRET is not set")
# Where the kernels are compiled (a CUDA GPU) the same tests run on CUDA tensors; elsewhere on the
# CPU under the interpreter. Tests about CPU behaviour name device="cpu" themselves.
DEVICE = "cuda" if ON_GPU else "cpu"


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def err(x, truth):
    return (x.double() - truth.double()).abs().max().item()


def outputs_and_grads(fn, q, k, v, d_out):
    """[O, dQ, dK, dV] of fn(q, k, v), pulled back through a fixed random upstream gradient."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(d_out.to(out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


# B, H, T, D, causal, input scale, (block_m, block_n) or None for the defaults. T=1; T no multiple
# of a block (37, 70); T a multiple (64, 128); unequal blocks so the causal diagonal cuts tiles
# unevenly; scores far from 1 in both signs (scale 6 gives |S| ~ 150).
CASES = {
    "T=1 causal": (1, 1, 1, 16, True, 1.0, None),
    "T=37 D=16 causal B*H=4": (2, 2, 37, 16, True, 1.0, None),
    "T=70 D=32 non-causal": (1, 3, 70, 32, False, 1.0, None),
    "T=70 D=32 causal blocks 32x16": (1, 2, 70, 32, True, 1.0, (32, 16)),
    "T=70 D=16 causal blocks 16x32": (1, 2, 70, 16, True, 1.0, (16, 32)),
    "T=64 D=64 causal (a multiple)": (2, 1, 64, 64, True, 1.0, None),
    "T=128 D=32 non-causal blocks 32x32": (1, 2, 128, 32, False, 1.0, (32, 32)),
    "large scores": (1, 2, 29, 32, False, 6.0, None),
    "large negative scores causal": (1, 2, 45, 32, True, -4.0, None),
    "D=128 causal": (1, 1, 40, 128, True, 1.0, None),
}


@needs_kernels
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_the_reference_in_fp32(case):
    B, H, T, D, causal, scale, blocks = CASES[case]
    block_m, block_n = blocks or (None, None)
    q, k = rand(B, H, T, D, seed=1, scale=scale), rand(B, H, T, D, seed=2, scale=scale)
    v, d_out = rand(B, H, T, D, seed=3), rand(B, H, T, D, seed=4)

    truth = outputs_and_grads(
        lambda q, k, v: attention_ref(q, k, v, causal=causal), q.double(), k.double(), v.double(), d_out.double()
    )
    ref = outputs_and_grads(lambda q, k, v: attention_ref(q, k, v, causal=causal), q, k, v, d_out)
    got = outputs_and_grads(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n), q, k, v, d_out
    )
    s_max = (q.double() @ k.double().transpose(-2, -1)).abs().max().item() / D**0.5
    for name, g, r, t in zip(("O", "dQ", "dK", "dV"), got, ref, truth):
        assert g.shape == t.shape and g.dtype == torch.float32 and torch.isfinite(g).all(), name
        # fp32 vs fp32 with another summation order: twice the reference's own error against the
        # float64 truth, plus a few roundings of the scores: the kernel exponentiates S - m (and
        # recomputes P = exp(S - L) in the backward), so an absolute rounding of S, eps32 * |S|,
        # is a relative error of P and of everything P multiplies. Observed: within this at 2-4x.
        budget = 2 * err(r, t) + 4 * EPS32 * max(1.0, s_max) * max(1.0, t.abs().max().item())
        assert err(g, t) <= budget, f"{name}: error {err(g, t):.2e} > budget {budget:.2e}"


@needs_kernels
@pytest.mark.parametrize("causal", [True, False])
def test_fp16_forward_error_is_no_worse_than_pytorchs_own(causal):
    q, k, v = (rand(2, 2, 45, 32, seed=s, dtype=torch.float16) for s in (1, 2, 3))
    truth = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    torch_err = err(F.scaled_dot_product_attention(q, k, v, is_causal=causal), truth)
    out = flash_attention(q, k, v, causal=causal)
    assert out.dtype == torch.float16
    # the flash-attention rule: at most twice PyTorch's own error in the same dtype
    assert err(out, truth) <= 2 * torch_err + 1e-5


@needs_kernels
def test_non_contiguous_inputs_give_the_same_result_and_gradients():
    B, T, H, D = 2, 37, 2, 32
    q_bthd, k_bthd, v_bthd = (rand(B, T, H, D, seed=s) for s in (1, 2, 3))
    q, k, v = (x.transpose(1, 2) for x in (q_bthd, k_bthd, v_bthd))  # (B, T, H, D) -> (B, H, T, D) views
    assert not q.is_contiguous()
    d_out = rand(B, H, T, D, seed=4).transpose(2, 3).contiguous().transpose(2, 3)  # a non-contiguous dO too
    got = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, d_out)
    want = outputs_and_grads(
        lambda q, k, v: flash_attention(q, k, v, causal=True),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        d_out.contiguous(),
    )
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@needs_kernels
def test_default_scale_is_inverse_sqrt_d_and_a_given_scale_is_used():
    q, k, v = (rand(1, 2, 20, 16, seed=s) for s in (1, 2, 3))
    assert torch.allclose(flash_attention(q, k, v), attention_ref(q, k, v, causal=True), atol=1e-6, rtol=0)
    assert torch.allclose(
        flash_attention(q, k, v, causal=False, sm_scale=0.5), attention_ref(q, k, v, scale=0.5), atol=1e-6, rtol=0
    )


# --------------------------------------------------------------------------- the door
@needs_kernels
@pytest.mark.parametrize("causal", [True, False])
def test_triton_backend_through_attention_equals_the_reference(causal):
    q, k, v = (rand(2, 2, 33, 16, seed=s) for s in (1, 2, 3))
    truth = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    budget = 2 * err(attention_ref(q, k, v, causal=causal), truth) + 1e-6
    out = attention(q, k, v, causal=causal, backend="triton")
    assert err(out, truth) <= budget


@pytest.mark.parametrize(
    "shapes, mask, words",
    [
        (((1, 2, 8, 16), (1, 2, 8, 16)), torch.zeros(8, 8, device=DEVICE), "not a mask (sdpa takes any)"),
        (((1, 2, 4, 16), (1, 2, 8, 16)), None, "T != S (attention's backend='sdpa' takes any)"),
        (((1, 4, 8, 16), (1, 2, 8, 16)), None, "no grouped-query heads (H_kv != H)"),
    ],
)
def test_triton_backend_refuses_what_the_kernel_does_not_support(shapes, mask, words):
    (q_shape, kv_shape) = shapes
    q, k, v = rand(*q_shape, seed=1), rand(*kv_shape, seed=2), rand(*kv_shape, seed=3)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        attention(q, k, v, mask=mask, backend="triton")


def test_auto_still_picks_sdpa_on_cpu(monkeypatch):
    q, k, v = (rand(1, 2, 8, 16, seed=s, device="cpu") for s in (1, 2, 3))

    def must_not_run(*args, **kwargs):
        raise AssertionError("auto chose the Triton backend for CPU tensors")

    monkeypatch.setitem(BACKENDS, "triton", must_not_run)
    assert torch.equal(attention(q, k, v, causal=True), attention(q, k, v, causal=True, backend="sdpa"))


# --------------------------------------------------------------------------- the tile schedule
@pytest.mark.parametrize("T, block_m, block_n", [(1, 64, 64), (37, 16, 16), (70, 32, 16), (70, 16, 32), (130, 64, 32)])
def test_key_block_bounds_agree_with_a_brute_force_causal_mask(T, block_m, block_n):
    visible = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T): query i sees keys j <= i
    for i in range(-(-T // block_m)):
        rows = visible[i * block_m : (i + 1) * block_m]  # the block's real queries
        per_key_block = [rows[:, j : j + block_n] for j in range(0, T, block_n)]
        n_full, n_end = key_block_bounds(i, T, block_m, block_n, causal=True)
        assert n_end == 1 + max(j for j, blk in enumerate(per_key_block) if blk.any())  # last block with a visible key
        # the unmasked prefix is exactly the leading run of whole key blocks every query here sees
        leading = 0
        while (
            leading < len(per_key_block) and per_key_block[leading].shape[1] == block_n and per_key_block[leading].all()
        ):
            leading += 1
        assert n_full == leading


def test_causal_visits_about_half_the_tiles_for_long_sequences():
    for T, block in [(256, 64), (4096, 64), (8192, 128)]:
        full = visited_blocks(T, block, block, causal=False)
        causal = visited_blocks(T, block, block, causal=True)
        n = T // block
        assert full == n * n and causal == n * (n + 1) // 2  # the tiles on and below the diagonal
        assert causal < full
    assert abs(visited_blocks(8192, 64, 64, True) / visited_blocks(8192, 64, 64, False) - 0.5) < 0.01


@needs_kernels
@pytest.mark.parametrize("T, block_m, block_n", [(1, 16, 16), (70, 32, 16), (70, 16, 32), (130, 32, 32)])
@pytest.mark.parametrize("causal", [True, False])
def test_the_kernel_loop_visits_exactly_the_counted_tiles(T, block_m, block_n, causal):
    q, k, v = (rand(2, 1, T, 16, seed=s) for s in (1, 2, 3))
    counted = flash.count_visited_tiles(q, k, v, causal, block_m=block_m, block_n=block_n)
    assert counted == visited_blocks(T, block_m, block_n, causal)


def test_default_block_sizes_are_valid_tiles():
    for D in SUPPORTED_HEAD_DIMS:
        block_m, block_n = default_block_sizes(D)
        assert block_m in (16, 32, 64, 128) and block_n in (16, 32, 64, 128)


# --------------------------------------------------------------------------- bad input
q0, k0, v0 = (rand(1, 2, 8, 16, seed=s) for s in (1, 2, 3))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(q=rand(1, 2, 8, 24), k=rand(1, 2, 8, 24), v=rand(1, 2, 8, 24)), ValueError, r"D=24.*\(16, 32, 64, 128\)"),
        (dict(q=rand(1, 1, 4, 256), k=rand(1, 1, 4, 256), v=rand(1, 1, 4, 256)), ValueError, "D=256"),
        (dict(k=k0[:, :, :5], v=v0[:, :, :5]), ValueError, "one shape"),  # T != S
        (dict(k=k0[:, :1], v=v0[:, :1]), ValueError, "grouped-query"),  # H_kv != H
        (dict(v=v0[..., :8].contiguous()), ValueError, "one shape"),
        (dict(q=q0[0]), ValueError, r"\(B, H, T, D\)"),
        (dict(v=v0.half()), ValueError, "share one dtype"),
        (dict(q=q0.double(), k=k0.double(), v=v0.double()), TypeError, "float64"),
        (dict(q=torch.ones(1, 2, 8, 16, dtype=torch.int64)), TypeError, "floating dtype"),
        (
            dict(q=q0.bfloat16(), k=k0.bfloat16(), v=v0.bfloat16()),
            ValueError,
            "bfloat16 is refused under the Triton interpreter",
        ),
        (dict(q=q0.to("meta")), ValueError, "share one device"),
        (dict(q=q0.to("meta"), k=k0.to("meta"), v=v0.to("meta")), (ValueError, RuntimeError), "meta"),
        (dict(q=q0[:, :, :0], k=k0[:, :, :0], v=v0[:, :, :0]), ValueError, "empty"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(sm_scale=-1.0), ValueError, "sm_scale"),
        (dict(block_m=24), ValueError, "block_m"),
        (dict(block_n=8), ValueError, "block_n"),
        (dict(q="q"), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_bad_input_raises_a_clear_error_never_a_crash(kwargs, error, words):
    if "bfloat16 is refused" in words and kernel_mode() != "interpreter":
        pytest.skip("bf16 is refused only under the interpreter")
    if kernel_mode() == "unavailable" and error is ValueError and "meta" in words:
        pytest.skip("without kernels every launch is refused before the device check")
    args = dict(q=q0, k=k0, v=v0)
    args.update(kwargs)
    with pytest.raises(error, match=words):
        flash_attention(**args)


def test_cpu_tensors_without_the_interpreter_get_told_how_to_enable_it(monkeypatch):
    monkeypatch.setattr(runtime, "kernel_mode", lambda: "unavailable")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        flash_attention(q0.cpu(), k0.cpu(), v0.cpu())


def test_import_switches_the_interpreter_on_without_a_gpu_and_works_without_triton():
    # Fresh interpreters: TRITON_INTERPRET unset (a CPU-only machine then gets the interpreter by
    # itself), set to 0 (kernels off: every call says what is missing), and triton hidden altogether.
    script = (
        "import sys, torch\n"
        "if sys.argv[1] == 'no-triton': sys.modules['triton'] = None\n"
        "import lib.kernels as K\n"
        "gpu = torch.cuda.is_available()\n"
        "want = {'unset': 'compiled' if gpu else 'interpreter', 'off': 'compiled' if gpu else 'unavailable',\n"
        "        'no-triton': 'unavailable'}[sys.argv[1]]\n"
        "assert K.kernel_mode() == want, K.kernel_mode()\n"
        "x = torch.randn(1, 1, 4, 16)\n"
        "if want == 'unavailable':\n"
        "    try: K.flash_attention(x, x, x)\n"
        "    except RuntimeError as e: print('refused:', e)\n"
        "    else: raise SystemExit('no error')\n"
        "elif want == 'interpreter':\n"
        "    print('ran:', tuple(K.flash_attention(x, x, x).shape))\n"
    )
    base = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    for variant, env in (("unset", base), ("off", {**base, "TRITON_INTERPRET": "0"}), ("no-triton", base)):
        run = subprocess.run(
            [sys.executable, "-c", script, variant],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        assert run.returncode == 0, run.stderr
        if not torch.cuda.is_available():
            expected = {
                "unset": "ran: (1, 1, 4, 16)",
                "off": "TRITON_INTERPRET=1",
                "no-triton": "needs the `triton` package",
            }
            assert expected[variant] in run.stdout, run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's import order matters only without a GPU")
def test_import_order_the_doctor_first_works_and_triton_first_is_refused_clearly():
    # A lesson's first cell runs the doctor, which must not import triton (triton fixes the mode of
    # tl.max, tl.cdiv, ... at its first import). Importing triton before lib leaves those compiled-mode
    # and the interpreted kernel would fail deep inside; the launcher says what to do instead.
    script = (
        "import sys, torch\n"
        "if sys.argv[1] == 'triton-first': import triton\n"
        "from lib.course import doctor\n"
        "doctor.capabilities()\n"
        "assert sys.argv[1] == 'triton-first' or 'triton' not in sys.modules, 'the doctor imported triton'\n"
        "from lib.kernels import flash_attention\n"
        "x = torch.randn(1, 1, 4, 16)\n"
        "try: print('ran:', tuple(flash_attention(x, x, x).shape))\n"
        "except RuntimeError as e: print('refused:', e)\n"
    )
    base = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    for variant, expected in (("doctor-first", "ran: (1, 1, 4, 16)"), ("triton-first", "import lib")):
        run = subprocess.run(
            [sys.executable, "-c", script, variant],
            env=base,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        assert run.returncode == 0, run.stderr
        assert expected in run.stdout, (variant, run.stdout)


# --------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T, D", [(1, 64), (200, 64), (333, 128), (512, 32)])
def test_gpu_half_precision_error_is_no_worse_than_pytorchs_own(dtype, causal, T, D):
    dev = "cuda"
    q, k, v, d_out = (rand(2, 3, T, D, seed=s, dtype=dtype, device=dev) for s in (1, 2, 3, 4))
    truth = outputs_and_grads(
        lambda q, k, v: attention_ref(q, k, v, causal=causal), q.float(), k.float(), v.float(), d_out.float()
    )
    torch_same = outputs_and_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), q, k, v, d_out
    )
    got = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, d_out)
    for name, g, s, t in zip(("O", "dQ", "dK", "dV"), got, torch_same, truth):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        # the flash-attention rule, with its small floor for the gradients' accumulation order
        assert err(g, t) <= 2 * err(s, t) + (1e-5 if name == "O" else 1e-4), name


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_fp32_is_full_precision_not_tf32(causal):
    q, k, v, d_out = (rand(2, 2, 300, 64, seed=s, device="cuda") for s in (1, 2, 3, 4))
    truth = outputs_and_grads(
        lambda q, k, v: attention_ref(q, k, v, causal=causal), q.double(), k.double(), v.double(), d_out.double()
    )
    got = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, d_out)
    for name, g, t in zip(("O", "dQ", "dK", "dV"), got, truth):
        # tf32 would be off by ~1e-3; ieee fp32 stays near 1e-6
        assert err(g, t) <= 2e-5 * max(1.0, t.abs().max().item()), name


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compiled Triton kernels")
def test_gpu_auto_backend_picks_the_kernel_when_it_fits():
    q, k, v = (rand(1, 2, 64, 64, seed=s, dtype=torch.float16, device="cuda") for s in (1, 2, 3))
    assert torch.equal(attention(q, k, v, causal=True), attention(q, k, v, causal=True, backend="triton"))
    mask = torch.zeros(64, 64, device="cuda", dtype=torch.float16)
    assert torch.equal(attention(q, k, v, mask=mask), attention(q, k, v, mask=mask, backend="sdpa"))
