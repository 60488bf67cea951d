"""The selective scan: the recurrence of a state-space model, its definition and its fast forms.

Follows Mamba (Gu & Dao 2023, arXiv 2312.00752): §2 for the discretised SSM, §3.2 and Algorithm 2
for the selective SSM (S6). The model built on it is `lib.mamba`.

    discretize     Ā = exp(Δ·A) (zero-order hold), B̄ = Δ·B (Euler, as the official code does)
    recurrence     h_t = Ā_t ⊙ h_{t-1} + B̄_t x_t            per channel d and state n
                   y_t = C_t · h_t  (+ D ⊙ x_t)               C_t contracts the N state entries
    selective      Δ, B, C computed from x_t (S6); non-selective (LTI, S4D-like): fixed parameters
    LTI            with fixed Ā, B̄, C the recurrence is a convolution, y = K * x with
                   K_k = C · (Ā^k ⊙ B̄)  (`lib.lti`)

The scans, equal up to rounding (tests/lib/test_scan.py asserts it, values and gradients). Each is one
entry of `SCANS` (name -> the scan's body, run after the checks); `selective_scan(..., impl=name)`
is the front door to all of them, and the named functions below check their arguments and run one:

    "ref"       selective_scan_ref: one Python step per position, fp32: the definition
    "parallel"  parallel_scan_ref: Hillis-Steele doubling with `scan_combine`, log2(L) steps (teaching)
    "chunked"   a step per position *inside* a chunk, all chunks at once, then a short loop carrying
                the state across chunks (see `selective_scan`). The bodies of these two, parallel
                over time in PyTorch, are `lib.scan_parallel`'s (with `scan_combine` and `default_chunk_size`)
    "cpu"       selective_scan_cpu: one fused loop in C, the state kept in cache, forward and
                backward (`lib.kernels.scan_cpu`, compiled at first use; tests/lib/test_scan_cpu.py)
    "triton"    selective_scan_triton: one fused kernel, the state kept on chip (`lib.kernels.scan`,
                compiled on a GPU, Triton's interpreter on a CPU; tests/lib/test_scan_kernel.py)
    "auto"      the default: "cpu" for CPU inputs where the C loop compiled here, else "chunked".
                Measured by `python -m lib.course.bench.ssm`, benchmarks/ssm_cpu.json

Adding a scan: write its body with the bodies' signature, add it to `SCANS`, test it against
`selective_scan_ref`. Kernels are launched from here (`lib.kernels` knows nothing of this module).

Every scan also takes the official `selective_scan_fn`'s extras, which the mixer passes: the raw
step with `delta_bias` and `delta_softplus` (Δ = softplus(delta + delta_bias)) and the gate `z`
(y ⊙ silu(z)); the C loop computes them inside its loops, the others around the scan.

Every exponential is of Δ·A ≤ 0 or of a sum of such terms, so nothing overflows however large Δ
or L: the decays lie in [0, 1] and the state can only forget.

Glossary (the paper's letters): B batch, L sequence length, D channels the scan runs over (d_inner
in the model), N state size per channel (d_state), Lc chunk length. As in the paper, B, C and D
also name the input matrix, the output matrix and the skip; in code the sizes are lower case
(b, l, d, n).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from lib._checks import inputs_checked
from lib._door import door
from lib.kernels.runtime import require_kernel_device, work_dtype
from lib.scan_parallel import chunked_scan, doubling_scan, step_sizes

__all__ = [
    "SCANS",
    "SCAN_CONTRACT",
    "discretize",
    "parallel_scan_ref",
    "recurrence",
    "selective_scan",
    "selective_scan_cpu",
    "selective_scan_ref",
    "selective_scan_triton",
]


# --------------------------------------------------------------------------- the contract
_NEGATIVE_A = (
    "A must be negative everywhere (A < 0): Ā = exp(Δ·A) must be < 1 for the state to decay; A >= 0 makes "
    "the state grow without bound (got max {A.max().item():.4g}). Mamba stores A = -exp(A_log)."
)
_STEP = "delta if delta_bias is None else delta + delta_bias"
_POSITIVE_STEP = (
    "delta{' + delta_bias' if delta_bias is not None else ''} must be >= 0: it is a step size Δ (Mamba makes "
    "it positive with softplus: pass delta_softplus=True), got min {(" + _STEP + ").min().item():.4g}"
)
# Every form of the scan (and lib.ssd) takes this door; in rules, B and D are sizes, not the tensors.
SCAN_CONTRACT = door(
    x="float (B, L, D)",
    delta="float (B, L, D)",
    A="float (D, N)",
    B="float (B, L, N)",
    C="float (B, L, N)",
    D="float (D,) | None",
    h0="float (B, D, N) | None",
    z="float (B, L, D) | None",
    delta_bias="float (D,) | None",
    delta_softplus="bool",
    return_state="bool",
    where={
        "bool((A < 0).all())": _NEGATIVE_A,
        "not delta_softplus or not torch.isnan(delta.min())": "delta must not be NaN",
        f"delta_softplus or bool(({_STEP}).min() >= 0)": _POSITIVE_STEP,
    },
)


# --------------------------------------------------------------------------- the pieces
@door(A="float (D, N)", delta="float (..., D)", B="float (..., N)")
def discretize(delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba's discretisation: Ā = exp(Δ·A) (zero-order hold), B̄ = Δ·B (Euler; Mamba §2 and the
    official `selective_scan_ref` simplify ZOH's B̄ = (ΔA)⁻¹(exp(ΔA) − I)·ΔB to this).

    delta (..., D), A (D, N), B (..., N) with the same leading dims -> Ā, B̄ (..., D, N). With
    delta (B, L, D) and B (B, L, N) that is per (b, l, d, n); with delta (D,), B (N,) the LTI case.
    """
    A_bar = torch.exp(delta.unsqueeze(-1) * A)  # (..., D, 1) * (D, N) -> (..., D, N)
    B_bar = delta.unsqueeze(-1) * B.unsqueeze(-2)  # (..., D, 1) * (..., 1, N) -> (..., D, N)
    return A_bar, B_bar


# --------------------------------------------------------------------------- the scans
@SCAN_CONTRACT
def selective_scan_ref(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    h0: torch.Tensor | None = None,
    return_state: bool = False,
):
    """The selective scan as its definition: one step per position, in fp32 (fp64 if given fp64).

    x, delta (B, L, D); A (D, N), negative; B, C (B, L, N); D (D,) or None; h0 (B, D, N) or None
    (zeros) -> y (B, L, D) in x's dtype, and with `return_state` also h_L (B, D, N), the state
    after the last position (what recurrent decoding and the next chunk start from).

    The official `selective_scan_fn`'s extras, which a Mamba mixer passes so that a fused kernel
    can take them in: delta_bias (D,) is added to delta and delta_softplus=True makes the step size
    Δ = softplus(delta + delta_bias); z (B, L, D) gates the output, y ⊙ silu(z), after the skip.

    Mirrors the official `selective_scan_ref`: Ā, B̄x precomputed, then h = Ā_t ⊙ h + B̄_t x_t,
    y_t = C_t · h, the outputs stacked once (unbound slices, nothing written in place: indexing a
    growing tensor inside the loop would make autograd's backward quadratic in L).
    """
    dtype, wt = x.dtype, work_dtype(x, delta, A, B, C, D, h0, z, delta_bias)
    x, delta, A, B, C = (t.to(wt) for t in (x, delta, A, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.to(wt)  # (B, L, D) + (D,)
    if delta_softplus:
        delta = F.softplus(delta)  # Δ > 0: a step size
    A_bar = (delta.unsqueeze(-1) * A).exp_()  # (B, L, D, 1) * (D, N) -> (B, L, D, N): how much of h a step keeps
    Bx = (delta * x).unsqueeze(-1) * B.unsqueeze(2)  # (B, L, D, 1) * (B, L, 1, N) -> (B, L, D, N): what it writes
    h = x.new_zeros(x.shape[0], x.shape[2], A.shape[1]) if h0 is None else h0.to(wt)  # (B, D, N)
    ys = []
    for a_t, bx_t, c_t in zip(A_bar.unbind(1), Bx.unbind(1), C.unbind(1)):  # one position at a time
        h = a_t * h + bx_t  # h_t = Ā_t ⊙ h_{t-1} + B̄_t x_t, (B, D, N)
        ys.append((h * c_t.unsqueeze(1)).sum(-1))  # y_t = C_t · h_t: (B, D, N) · (B, 1, N) -> (B, D)
    y = torch.stack(ys, dim=1)  # L x (B, D) -> (B, L, D)
    if D is not None:
        y = y + x * D.to(wt)  # the skip D ⊙ x
    if z is not None:
        y = y * F.silu(z.to(wt))  # the gate silu(z)
    return (y.to(dtype), h) if return_state else y.to(dtype)


def recurrence(A_bar: torch.Tensor, Bx: torch.Tensor, h: torch.Tensor):
    """The recurrence itself, one position at a time: yields h_t = Ā_t ⊙ h_{t-1} + B̄_t x_t for
    t = 0..L−1, from A_bar, Bx (B, L, D, N) and the state h (B, D, N) before position 0.

    Slices are taken with `unbind` and nothing is written in place: writing into or indexing a
    growing tensor inside the loop would make autograd's backward quadratic in L."""
    for a_t, bx_t in zip(A_bar.unbind(1), Bx.unbind(1)):  # (B, D, N), (B, D, N)
        h = a_t * h + bx_t  # (B, D, N)
        yield h


@SCAN_CONTRACT.plus(
    chunk_size="int >= 1 | None",
    impl="one of SCANS",
    threads="int >= 1 | None",
    where={
        "chunk_size is None or impl in ('auto', 'chunked')": "chunk_size is for impl='chunked', got impl={impl!r}",
        "threads is None or impl == 'cpu'": "threads is for impl='cpu' (the fused C loop), got impl={impl!r}",
    },
)
def selective_scan(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    h0: torch.Tensor | None = None,
    return_state: bool = False,
    chunk_size: int | None = None,
    impl: str = "auto",
    threads: int | None = None,
):
    """The selective scan without a Python step per position: the same result as
    `selective_scan_ref` (same arguments, same returns, up to rounding). Differentiable.

    impl picks how (any name of `SCANS`):
      "chunked"  the algorithm below, in PyTorch: about 2·Lc + L/Lc Python steps instead of L,
                 any device, gradients by autograd; `chunk_size` sets Lc;
      "cpu"      one fused loop in C that keeps the state in cache, and a fused reverse-time loop
                 for its gradients (CPU tensors); delta_bias, delta_softplus and the gate z are
                 taken into the loops there, while the other scans apply them around the scan;
                 `threads` sets how many threads share it (the result does not depend on it);
      "auto"     "cpu" when the tensors are on the CPU, no chunk_size is given and the C loop
                 compiled here with vector exponentials (`lib.kernels.scan_cpu.cpu_kernel_status()`
                 says how it was built, or why not); otherwise "chunked";
      "ref", "parallel", "triton"  as `selective_scan_ref`, `parallel_scan_ref`, `selective_scan_triton`.

    The chunked scan: the sequence is cut into L/Lc chunks of Lc positions (the last padded with Δ = 0: Ā = 1 and
    B̄x = 0, so the state passes through the padding unchanged). Then:

      1. each chunk's own final state, starting from zero: Lc steps, every chunk at once;
      2. the carry: the state entering chunk c is H_c = exp(A · ΣΔ over chunk c-1) ⊙ H_{c-1} +
         (chunk c-1's own state): a loop over chunks on one state per sequence. ΣΔ is the segment
         sum of Δ over the chunk (log space: the decay's logarithm); the decay is <= 1;
      3. each chunk again from its true start state H_c, reading y_t = C_t · h_t: Lc steps.

    Why not the quadratic "segment-sum" form of Mamba-2's SSD (decay exp(cumsum_t − cumsum_s) for
    s <= t as a masked (Lc, Lc) matrix, then a matmul)? In Mamba-2 A is a scalar per head, so the
    decay matrix is shared by all N state entries and N contracts in a matmul. Here Ā depends on
    the channel d and the state entry n, so that matrix is (B, L/Lc, Lc, Lc, D, N): Lc times the
    work and memory of the scan itself (2 GB at L = 4096, Lc = 64 for the benchmark's sizes), and it
    measured slower than the plain loop on a CPU. The form above does the linear amount of work.
    """
    opts = {k: v for k, v in (("chunk_size", chunk_size), ("threads", threads)) if v is not None}
    return SCANS[impl](
        x, delta, A, B, C, D, h0, return_state, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus, **opts
    )


def _uses_cpu_kernel(tensors, chunk_size) -> bool:
    """selective_scan's impl="auto" rule: the fused C loop (forward and backward) for CPU inputs."""
    x = tensors[0]
    if chunk_size is not None or x.device.type != "cpu" or work_dtype(*tensors) not in (torch.float32, torch.float64):
        return False
    from lib.kernels.scan_cpu import cpu_kernel_available  # imported on first use (it builds the C library)

    return cpu_kernel_available(fast=True)


def _scan_auto(x, delta, A, B, C, D, h0, return_state, chunk_size=None, **extras):
    if _uses_cpu_kernel((x, delta, A, B, C, D, h0, extras.get("z"), extras.get("delta_bias")), chunk_size):
        return _scan_cpu(x, delta, A, B, C, D, h0, return_state, **extras)
    return chunked_scan(x, delta, A, B, C, D, h0, return_state, chunk_size, **extras)


class _FusedScan(torch.autograd.Function):
    """A fused scan kernel's forward, with the chunked scan's gradients.

    apply(launch, x, delta, A, B, C, D, h0, return_state): `launch` (a kernel's launcher) returns
    y with the skip added and the final state (or None). The backward does not store or replay the
    kernel: it recomputes the forward with the chunked PyTorch scan under autograd and returns its
    gradients, as the official Mamba kernel recomputes instead of storing the states. Used for
    the Triton kernel (`_scan_triton`); the C loop has its own fused backward (lib.kernels.scan_cpu).
    """

    @staticmethod
    def forward(ctx, launch, x, delta, A, B, C, D, h0, return_state):
        y, hl = launch(x, delta, A, B, C, D, h0, return_state)
        ctx.save_for_backward(x, delta, A, B, C, D, h0)
        ctx.return_state = return_state
        y = y.to(x.dtype)
        return (y, hl) if return_state else y

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors  # x, delta, A, B, C, D, h0 (None where not given)
        wants = [t is not None and need for t, need in zip(inputs, ctx.needs_input_grad[1:8])]
        leaves = [None if t is None else t.detach().requires_grad_(w) for t, w in zip(inputs, wants)]
        with torch.enable_grad():
            out = chunked_scan(*leaves, ctx.return_state)
        outs = list(out) if ctx.return_state else [out]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        wanted = [leaf for leaf, w in zip(leaves, wants) if w]
        got = iter(
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
            if pairs and wanted
            else []
        )
        return (None, *[next(got) if w else None for w in wants], None)


@SCAN_CONTRACT
def parallel_scan_ref(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    h0: torch.Tensor | None = None,
    return_state: bool = False,
):
    """The selective scan by Hillis-Steele doubling (1986): log2(L) rounds of `scan_combine`, each
    over all positions at once. Same arguments and result as `selective_scan_ref`.

    After round r, position t holds the composition of steps t − 2^r + 1 .. t (identity steps
    (1, 0) stand in before position 0). It does L·log2(L) combines instead of L, and every round
    writes new (B, L, D, N) tensors (autograd keeps them all): a teaching implementation.
    """
    return doubling_scan(
        x, delta, A, B, C, D, h0, return_state, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus
    )


# --------------------------------------------------------------------------- the fused kernels
def selective_scan_cpu(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    h0: torch.Tensor | None = None,
    return_state: bool = False,
    threads: int | None = None,
):
    """The selective scan by one fused C loop (`lib.kernels.scan_cpu`): the same arguments and
    result as `selective_scan_ref` (up to rounding), differentiable, for CPU tensors.

    x, delta (B, L, D); A (D, N), negative; B, C (B, L, N); D (D,) or None; z (B, L, D) or None,
    the gate; delta_bias (D,) or None and delta_softplus: Δ = softplus(delta + delta_bias) (the
    official selective_scan_fn's arguments, taken into the loop); h0 (B, D, N) or None -> y (B, L, D)
    in x's dtype, and with `return_state` also the final state (B, D, N) in the working dtype (fp32,
    or fp64 if any input is fp64). `threads`: how many threads share the rows (default
    torch.get_num_threads()); the result does not depend on it. Raises RuntimeError, saying why,
    where the loop could not be built (then use `selective_scan`, which falls back by itself).
    """
    return selective_scan(
        x,
        delta,
        A,
        B,
        C,
        D,
        z=z,
        delta_bias=delta_bias,
        delta_softplus=delta_softplus,
        h0=h0,
        return_state=return_state,
        impl="cpu",
        threads=threads,
    )


def _scan_cpu(x, delta, A, B, C, D, h0, return_state, threads=None, **extras):
    from lib.kernels import scan_cpu  # imported on first use (it builds the C library)

    return scan_cpu.scan(x, delta, A, B, C, D, h0, return_state, threads, **extras)


def selective_scan_triton(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    h0: torch.Tensor | None = None,
    return_state: bool = False,
):
    """The selective scan by one fused Triton kernel (`lib.kernels.scan`): the same arguments and
    result as `selective_scan_ref` (up to fp32 rounding), differentiable (the backward recomputes
    with the chunked scan: `_FusedScan`).

    Returns y (B, L, D) in x's dtype, and with `return_state` also the final state (B, D, N) in
    fp32. Computes in fp32: float16/bfloat16 inputs are read as fp32; float64 inputs are refused
    (use `selective_scan`, which computes in fp64 when given fp64). On CUDA tensors the kernel is
    compiled; on CPU tensors it runs in Triton's interpreter (TRITON_INTERPRET=1). The mixer's
    extras are applied around the kernel in PyTorch: delta_bias and softplus before, the gate after.
    """
    return selective_scan(
        x,
        delta,
        A,
        B,
        C,
        D,
        z=z,
        delta_bias=delta_bias,
        delta_softplus=delta_softplus,
        h0=h0,
        return_state=return_state,
        impl="triton",
    )


def _scan_ref(x, delta, A, B, C, D, h0, return_state, **extras):
    with inputs_checked():  # checked by the caller: selective_scan's door, or lib.mamba's
        return selective_scan_ref(x, delta, A, B, C, D, h0=h0, return_state=return_state, **extras)


def _scan_triton(x, delta, A, B, C, D, h0, return_state, *, z=None, delta_bias=None, delta_softplus=False):
    named = dict(x=x, delta=delta, A=A, B=B, C=C, D=D, h0=h0, z=z, delta_bias=delta_bias)
    for name in (n for n, t in named.items() if t is not None and t.dtype == torch.float64):
        raise TypeError(
            f"selective_scan_triton computes in fp32 and refuses float64 input ({name} is float64); "
            "use lib.scan.selective_scan, which computes in fp64 when given fp64"
        )
    require_kernel_device(x.device, "selective_scan_triton", "lib.scan.selective_scan")
    from lib.kernels import scan as triton_scan  # imported on first use (it imports triton)

    if delta_bias is not None or delta_softplus:
        delta = step_sizes(delta.float(), delta_bias, delta_softplus)
    out = _FusedScan.apply(triton_scan.launch, x, delta, A, B, C, D, h0, return_state)
    if z is None:
        return out
    y, h = out if return_state else (out, None)
    y = (y.float() * F.silu(z.float())).to(x.dtype)  # the gate, in fp32 like the kernel
    return (y, h) if return_state else y


# The table of scans: name -> body(x, delta, A, B, C, D, h0, return_state, *, z, delta_bias,
# delta_softplus[, chunk_size or threads]), run after the checks. lib.mamba calls these directly.
SCANS: dict[str, Callable] = {
    "auto": _scan_auto,
    "chunked": chunked_scan,
    "cpu": _scan_cpu,
    "ref": _scan_ref,
    "parallel": doubling_scan,
    "triton": _scan_triton,
}
