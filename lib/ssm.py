"""State-space models: the selective scan and a small Mamba language model.

Follows Mamba (Gu & Dao 2023, arXiv 2312.00752): §2 for the discretised SSM, §3.2 and Algorithm 2
for the selective SSM (S6), §3.4 / Fig. 3 for the block; parameter names and initialisation as in
the official `mamba_ssm/modules/mamba_simple.py` (and mamba-minimal's `model.py`).

    discretize     Ā = exp(Δ·A) (zero-order hold), B̄ = Δ·B (Euler, as the official code does)
    recurrence     h_t = Ā_t ⊙ h_{t-1} + B̄_t x_t            per channel d and state n
                   y_t = C_t · h_t  (+ D ⊙ x_t)               C_t contracts the N state entries
    selective      Δ, B, C computed from x_t (S6); non-selective (LTI, S4D-like): fixed parameters
    LTI            with fixed Ā, B̄, C the recurrence is a convolution, y = K * x with
                   K_k = C · (Ā^k ⊙ B̄)  (`lti_kernel`, `ssm_convolution`)

The scans, equal up to rounding (tests/test_ssm.py asserts it, values and gradients):

    selective_scan_ref   one Python step per position, fp32: the definition
    selective_scan       the front door. impl="chunked": a step per position *inside* a chunk, all
                         chunks at once, then a short loop carrying the state across chunks (see its
                         docstring); impl="cpu": the fused C loop below, forward and backward;
                         impl="auto" (default): the C loop for CPU inputs where it compiled here,
                         else chunked. Measured by tools/bench_ssm.py, benchmarks/ssm_cpu.json
    parallel_scan_ref    Hillis-Steele doubling with `scan_combine`, log2(L) steps (teaching)
    "cpu"                `lib.kernels.scan_cpu.selective_scan_cpu`: one fused loop in C, the state
                         kept in cache (compiled at first use; tests/test_scan_cpu.py)
    "triton"             `lib.kernels.scan.selective_scan_triton`: one fused kernel, the state kept
                         on chip (compiled on a GPU, Triton's interpreter on a CPU; tests/test_scan_kernel.py)

Every scan also takes the official `selective_scan_fn`'s extras, which the mixer passes: the raw
step with `delta_bias` and `delta_softplus` (Δ = softplus(delta + delta_bias)) and the gate `z`
(y ⊙ silu(z)); the C loop computes them inside its loops, the others around the scan.

Every exponential is of Δ·A ≤ 0 or of a sum of such terms, so nothing overflows however large Δ
or L: the decays lie in [0, 1] and the state can only forget.

The model: `MambaLM(MambaConfig)`, embedding → n_layers × `MambaBlock` (x + mixer(norm(x))) →
norm → tied head, with `forward(idx, targets)` like `lib.gpt.GPT` (so `lib.gpt.train_gpt` trains
it), `prefill` / `step` for recurrent decoding with a constant-size `MambaState`, `generate`, and
`state_bytes` (compare `lib.kv_cache.kv_cache_bytes`, which grows with the context).
`MambaMixer` also takes `lib.gpt.Block`'s call signature, so it can stand in for attention there.
The official layout keeps x_proj, dt_proj, A_log and D directly in the mixer; here they sit in its
`ssm` (a `SelectiveSSM`), so their names gain an `ssm.` step.

Glossary (the paper's letters): B batch, L sequence length (T in lib.gpt), D channels the scan runs
over (d_inner = expand · d_model in the model), N state size per channel (d_state), R rank of Δ's
projection (dt_rank), K conv width (d_conv), Lc chunk length, V vocabulary. As in the paper, B, C
and D also name the input matrix, the output matrix and the skip; in code the sizes are lower case
(b, l, d, n).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import require_int, require_rank, require_tensor, require_token_ids
from lib.gpt import _check_targets
from lib.kv_cache import dtype_bytes
from lib.norms import RMSNorm
from lib.sampling import _check_knobs, sample_next_token

__all__ = ["MambaBlock", "MambaConfig", "MambaLM", "MambaMixer", "MambaState", "MixerCache", "SCANS", "SelectiveSSM",
           "causal_conv1d", "causal_conv1d_ref", "default_chunk_size", "discretize", "generate", "lti_kernel",
           "parallel_scan_ref", "scan_combine", "selective_scan", "selective_scan_ref", "ssm_convolution", "state_bytes",
           "trace_states"]


# --------------------------------------------------------------------------- input checks
def _check_scan_inputs(x, delta, A, B, C, D, h0, *, z=None, delta_bias=None, delta_softplus=False) -> None:
    """Shapes x, delta, z (B, L, D); A (D, N) < 0; B, C (B, L, N); D, delta_bias (D,); h0 (B, D, N);
    delta (+ delta_bias) >= 0 unless delta_softplus."""
    for name, t in (("x", x), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        require_tensor(name, t, floating=True)
    require_rank("x", x, 3, "(B, L, D)")
    b, l, d = x.shape
    if b == 0 or l == 0 or d == 0:
        raise ValueError(f"x must have shape (B, L, D) with every size >= 1, got {tuple(x.shape)}")
    require_rank("A", A, 2, "(D, N)")
    n = A.shape[1]
    wanted = {"delta": (delta, "(B, L, D)", (b, l, d), "like x"), "A": (A, "(D, N)", (d, n), "with D = x.shape[-1]"),
              "B": (B, "(B, L, N)", (b, l, n), "with N = A.shape[1]"), "C": (C, "(B, L, N)", (b, l, n), "like B")}
    if D is not None:
        require_tensor("D", D, floating=True)
        wanted["D"] = (D, "(D,)", (d,), "(one skip weight per channel)")
    if h0 is not None:
        require_tensor("h0", h0, floating=True)
        wanted["h0"] = (h0, "(B, D, N)", (b, d, n), "(the state before position 0)")
    if z is not None:
        require_tensor("z", z, floating=True)
        wanted["z"] = (z, "(B, L, D)", (b, l, d), "like x (the gate: y ⊙ silu(z))")
    if delta_bias is not None:
        require_tensor("delta_bias", delta_bias, floating=True)
        wanted["delta_bias"] = (delta_bias, "(D,)", (d,), "(one bias per channel, added to delta)")
    if not isinstance(delta_softplus, bool):
        raise TypeError(f"delta_softplus must be a bool, got {type(delta_softplus).__name__}")
    for name, (t, layout, shape, note) in wanted.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {layout} = {shape} {note}, got {tuple(t.shape)}")
    devices = {name: t.device for name, (t, *_) in wanted.items()}
    if any(dev != x.device for dev in devices.values()):
        raise ValueError(f"x, delta, A, B, C (and D, h0) must share one device, got x: {x.device}, "
                         + ", ".join(f"{k}: {v}" for k, v in devices.items()))
    if n == 0:
        raise ValueError("A must have shape (D, N) with N >= 1 state entries per channel, got N = 0")
    if not bool((A < 0).all()):
        raise ValueError("A must be negative everywhere (A < 0): Ā = exp(Δ·A) must be < 1 for the state to decay; "
                         f"A >= 0 makes the state grow without bound (got max {A.max().item():.4g}). "
                         "Mamba stores A = -exp(A_log).")
    if delta_softplus:  # any real delta: softplus makes the step size positive; NaN still fails
        if torch.isnan(delta.min()):
            raise ValueError("delta must not be NaN")
        return
    step = delta if delta_bias is None else delta + delta_bias
    if not bool(step.min() >= 0):  # one reduction, no boolean copy; NaN fails too (min is NaN)
        raise ValueError(f"delta{' + delta_bias' if delta_bias is not None else ''} must be >= 0: it is a step "
                         f"size Δ (Mamba makes it positive with softplus: pass delta_softplus=True), "
                         f"got min {step.min().item():.4g}")


def _work_dtype(*tensors) -> torch.dtype:
    """fp32, or fp64 if any input is fp64: the scans never compute in half precision."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _step_sizes(delta: torch.Tensor, delta_bias, delta_softplus: bool) -> torch.Tensor:
    """Δ as the scan uses it: delta (+ delta_bias), through softplus if asked (in delta's dtype)."""
    if delta_bias is not None:
        delta = delta + delta_bias.to(delta.dtype)  # (B, L, D) + (D,)
    return F.softplus(delta) if delta_softplus else delta


def _finish(y: torch.Tensor, x: torch.Tensor, D, h: torch.Tensor, return_state: bool, dtype: torch.dtype, z=None):
    """Add the skip D ⊙ x and apply the gate silu(z) (all in the working dtype), return y in
    `dtype` (x's), h as computed."""
    if D is not None:
        y = y + x * D.to(y.dtype)  # (B, L, D) + (B, L, D) * (D,)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))  # (B, L, D)
    y = y.to(dtype)
    return (y, h) if return_state else y


# --------------------------------------------------------------------------- the pieces
def discretize(delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba's discretisation: Ā = exp(Δ·A) (zero-order hold), B̄ = Δ·B (Euler; Mamba §2 and the
    official `selective_scan_ref` simplify ZOH's B̄ = (ΔA)⁻¹(exp(ΔA) − I)·ΔB to this).

    delta (..., D), A (D, N), B (..., N) with the same leading dims -> Ā, B̄ (..., D, N). With
    delta (B, L, D) and B (B, L, N) that is per (b, l, d, n); with delta (D,), B (N,) the LTI case.
    """
    for name, t in (("delta", delta), ("A", A), ("B", B)):
        require_tensor(name, t, floating=True)
    require_rank("A", A, 2, "(D, N)")
    if delta.dim() == 0 or delta.shape[-1] != A.shape[0]:
        raise ValueError(f"delta must have shape (..., D) with D = A.shape[0] = {A.shape[0]}, got {tuple(delta.shape)}")
    if B.dim() == 0 or B.shape[-1] != A.shape[1] or B.shape[:-1] != delta.shape[:-1]:
        raise ValueError(f"B must have shape (..., N) = {(*delta.shape[:-1], A.shape[1])} (delta's leading dims, "
                         f"N = A.shape[1]), got {tuple(B.shape)}")
    A_bar = torch.exp(delta.unsqueeze(-1) * A)  # (..., D, 1) * (D, N) -> (..., D, N)
    B_bar = delta.unsqueeze(-1) * B.unsqueeze(-2)  # (..., D, 1) * (..., 1, N) -> (..., D, N)
    return A_bar, B_bar


def scan_combine(left: tuple[torch.Tensor, torch.Tensor],
                 right: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The associative operator of the linear recurrence.

    A pair (a, b) stands for the step h -> a ⊙ h + b. Doing `left` then `right` is again such a
    step: (a1, b1) ∘ (a2, b2) = (a1 ⊙ a2, a2 ⊙ b1 + b2). Associativity lets a parallel scan group the
    steps in any order (Blelloch 1990; Martin & Cundy 2018). Tensors broadcast.
    """
    (a1, b1), (a2, b2) = left, right
    for name, t in (("left[0]", a1), ("left[1]", b1), ("right[0]", a2), ("right[1]", b2)):
        require_tensor(name, t, floating=True)
    return a1 * a2, torch.addcmul(b2, a2, b1)


# --------------------------------------------------------------------------- the scans
def selective_scan_ref(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor | None = None, *, z: torch.Tensor | None = None,
                       delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
                       h0: torch.Tensor | None = None, return_state: bool = False):
    """The selective scan as its definition: one step per position, in fp32 (fp64 if given fp64).

    x, delta (B, L, D); A (D, N), negative; B, C (B, L, N); D (D,) or None; h0 (B, D, N) or None
    (zeros) -> y (B, L, D) in x's dtype, and with `return_state` also h_L (B, D, N), the state
    after the last position (what recurrent decoding and the next chunk start from).

    The official `selective_scan_fn`'s extras, which a Mamba mixer passes so that a fused kernel
    can take them in: delta_bias (D,) is added to delta and delta_softplus=True makes the step size
    Δ = softplus(delta + delta_bias); z (B, L, D) gates the output, y ⊙ silu(z), after the skip.

    Mirrors the official `selective_scan_ref`: Ā, B̄x precomputed, then h = Ā_t ⊙ h + B̄_t x_t,
    y_t = C_t · h. The loop takes slices with `unbind` and stacks the outputs once: writing into or
    indexing a growing tensor inside the loop would make autograd's backward quadratic in L.
    """
    _check_scan_inputs(x, delta, A, B, C, D, h0, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
    return _scan_ref(x, delta, A, B, C, D, h0, return_state, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)


def _scan_ref(x, delta, A, B, C, D, h0, return_state, *, z=None, delta_bias=None, delta_softplus=False):
    wt = _work_dtype(x, delta, A, B, C, D, h0, z, delta_bias)
    x_, delta, A, B, C = (t.to(wt) for t in (x, delta, A, B, C))
    delta = _step_sizes(delta, delta_bias, delta_softplus)  # (B, L, D)
    b, l, d = x_.shape
    A_bar = (delta.unsqueeze(-1) * A).exp_()  # (B, L, D, 1) * (D, N) -> (B, L, D, N); in place: no second buffer
    Bx = (delta * x_).unsqueeze(-1) * B.unsqueeze(2)  # (B, L, D, 1) * (B, L, 1, N) -> (B, L, D, N)
    h = x_.new_zeros(b, d, A.shape[1]) if h0 is None else h0.to(wt)  # (B, D, N)
    ys = []
    for a_t, bx_t, c_t in zip(A_bar.unbind(1), Bx.unbind(1), C.unbind(1)):  # (B, D, N), (B, D, N), (B, N)
        h = a_t * h + bx_t  # (B, D, N)
        ys.append((h * c_t.unsqueeze(1)).sum(-1))  # (B, D, N) · (B, 1, N) -> (B, D)
    y = torch.stack(ys, dim=1)  # L x (B, D) -> (B, L, D)
    return _finish(y, x_, D, h, return_state, x.dtype, z)


def default_chunk_size(L: int) -> int:
    """The chunk length `selective_scan` uses for a sequence of L positions when none is given.

    The chunked scan takes about 2·Lc + L/Lc Python steps (two passes over the positions of a
    chunk, one over the chunks); their sum is smallest near Lc = sqrt(L/2), rounded here to a
    power of two (32 at L = 2048). tools/bench_ssm.py sweeps Lc at L = 2048 and records it in
    benchmarks/ssm_cpu.json; on a 2-core CPU with one thread, Lc = 16, 32 and 64 measured within
    10% of each other, smaller and larger chunks slower.
    """
    require_int("L", L, minimum=1)
    return min(L, max(4, 2 ** math.floor(math.log2(math.sqrt(L / 2)) + 0.5)))  # the nearest power of two


def selective_scan(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None = None, *, z: torch.Tensor | None = None,
                   delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
                   h0: torch.Tensor | None = None, return_state: bool = False,
                   chunk_size: int | None = None, impl: str = "auto"):
    """The selective scan without a Python step per position: the same result as
    `selective_scan_ref` (same arguments, same returns, up to rounding). Differentiable.

    impl picks how:
      "chunked"  the algorithm below, in PyTorch: about 2·Lc + L/Lc Python steps instead of L,
                 any device, gradients by autograd;
      "cpu"      `lib.kernels.scan_cpu.selective_scan_cpu`, one fused loop in C that keeps the
                 state in cache, and a fused reverse-time loop for its gradients (CPU tensors);
                 delta_bias, delta_softplus and the gate z are taken into the loops there, while
                 the other scans apply them around the scan with PyTorch;
      "auto"     "cpu" when the tensors are on the CPU, no chunk_size is given and the C loop
                 compiled here with vector exponentials (`lib.kernels.scan_cpu.cpu_kernel_status()`
                 says how it was built, or why not); otherwise "chunked".

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
    extras = dict(z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
    _check_scan_inputs(x, delta, A, B, C, D, h0, **extras)
    if chunk_size is not None:
        require_int("chunk_size", chunk_size, minimum=1)
    if impl not in SCAN_IMPLS:
        raise ValueError(f"impl must be one of {SCAN_IMPLS}, got {impl!r}")
    if impl == "cpu":
        if chunk_size is not None:
            raise ValueError("chunk_size is for impl='chunked' (the fused CPU loop has no chunks); leave it None")
        return _selective_scan_cpu(x, delta, A, B, C, D, h0=h0, return_state=return_state, **extras)
    if impl == "auto":
        return _scan_auto(x, delta, A, B, C, D, h0, return_state, chunk_size, **extras)
    return _scan_chunked(x, delta, A, B, C, D, h0, return_state, chunk_size, **extras)


SCAN_IMPLS = ("auto", "chunked", "cpu")


def _uses_cpu_kernel(tensors, chunk_size) -> bool:
    """selective_scan's impl="auto" rule: the fused C loop (forward and backward) for CPU inputs."""
    x = tensors[0]
    if chunk_size is not None or x.device.type != "cpu" or _work_dtype(*tensors) not in (torch.float32, torch.float64):
        return False
    from lib.kernels.scan_cpu import cpu_kernel_available  # imported on first use (it builds the C library)
    return cpu_kernel_available(fast=True)


def _scan_auto(x, delta, A, B, C, D, h0, return_state, chunk_size=None, **extras):
    if _uses_cpu_kernel((x, delta, A, B, C, D, h0, extras.get("z"), extras.get("delta_bias")), chunk_size):
        return _scan_cpu(x, delta, A, B, C, D, h0, return_state, **extras)
    return _scan_chunked(x, delta, A, B, C, D, h0, return_state, chunk_size, **extras)


class _FusedScan(torch.autograd.Function):
    """A fused scan kernel's forward, with the chunked scan's gradients.

    apply(launch, x, delta, A, B, C, D, h0, return_state): `launch` (a kernel's launcher) returns
    y with the skip added and the final state (or None). The backward does not store or replay the
    kernel: it recomputes the forward with the chunked PyTorch scan under autograd and returns its
    gradients, as the official Mamba kernel recomputes instead of storing the states. Used by
    lib.kernels.scan (Triton); the C loop has its own fused backward (lib.kernels.scan_cpu).
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
            out = _scan_chunked(*leaves, ctx.return_state)
        outs = list(out) if ctx.return_state else [out]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        wanted = [leaf for leaf, w in zip(leaves, wants) if w]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                   if pairs and wanted else [])
        return (None, *[next(got) if w else None for w in wants], None)


def _scan_chunked(x, delta, A, B, C, D, h0, return_state, chunk_size=None, *, z=None, delta_bias=None,
                  delta_softplus=False):
    wt = _work_dtype(x, delta, A, B, C, D, h0, z, delta_bias)
    x_, delta, A, B, C = (t.to(wt) for t in (x, delta, A, B, C))
    delta = _step_sizes(delta, delta_bias, delta_softplus)  # (B, L, D)
    b, l, d = x_.shape
    n = A.shape[1]
    lc = min(chunk_size or default_chunk_size(l), l)
    nc = -(-l // lc)  # chunks, rounded up
    u = delta * x_  # (B, L, D): Δ_t x_t, the input before B spreads it over the state
    if nc * lc != l:  # pad the time axis; Δ = 0 keeps the state unchanged through the padding
        delta, u, B, C = (F.pad(t, (0, 0, 0, nc * lc - l)) for t in (delta, u, B, C))

    def by_position(t):  # (B, nc·Lc, k) -> (Lc, B, nc, k): one slice per position in a chunk
        return t.view(b, nc, lc, t.shape[-1]).permute(2, 0, 1, 3).contiguous()

    delta_p, u_p, B_p, C_p = map(by_position, (delta, u, B, C))
    # The state is held as (N, D), D innermost: reading y_t = C_t · h_t is then a (1, N) @ (N, D)
    # matmul, several times faster on a CPU than a product and a sum over a short innermost N.
    At = A.t()  # (N, D)
    # Ā_t = exp(Δ_t A), (B, nc, N, D) per position, made inside pass 1 where it is first used: a
    # slice that fits in the CPU's cache is written, exponentiated and read there, instead of one
    # (Lc, B, nc, N, D) tensor streamed through main memory twice first. Pass 3 reads the list.
    deltas = delta_p.unsqueeze(-2).unbind(0)  # Lc x (B, nc, 1, D)
    a = []
    # B̄_t x_t = B_t ⊗ (Δ_t x_t) is formed inside each step from its two small factors, not stored
    # for all positions: the loops are memory-bound, and reading one fewer (B, L, N, D) tensor twice
    # saves more than the step's extra multiply costs.
    Bs, us, c = B_p.unsqueeze(-1).unbind(0), u_p.unsqueeze(-2).unbind(0), C_p.unsqueeze(-2).unbind(0)
    # Lc x (B, nc, N, 1), (B, nc, 1, D), (B, nc, 1, N)

    h = Bs[0] * us[0]  # 1. every chunk's own final state, from zero: (B, nc, N, D)
    a.append((deltas[0] * At).exp_())  # (B, nc, 1, D) * (N, D) -> (B, nc, N, D)
    for t in range(1, lc):
        a.append((deltas[t] * At).exp_())
        h = torch.addcmul(a[t] * h, Bs[t], us[t])  # (B, nc, N, D): Ā_t ⊙ h + B_t ⊗ Δ_t x_t
    chunk_decay = torch.exp(delta_p.sum(0).unsqueeze(-2) * At)  # (B, nc, 1, D) * (N, D) -> (B, nc, N, D), <= 1

    carry = x_.new_zeros(b, n, d) if h0 is None else h0.to(wt).transpose(1, 2)  # 2. the carry: (B, N, D)
    starts = []
    for decay_c, own_c in zip(chunk_decay.unbind(1), h.unbind(1)):
        starts.append(carry)
        carry = torch.addcmul(own_c, decay_c, carry)  # the state leaving chunk c
    h = torch.stack(starts, dim=1)  # (B, nc, N, D): the state entering each chunk

    ys = []  # 3. every chunk from its true start
    for t in range(lc):
        h = torch.addcmul(a[t] * h, Bs[t], us[t])  # (B, nc, N, D)
        ys.append(torch.matmul(c[t], h))  # (B, nc, 1, N) @ (B, nc, N, D) -> (B, nc, 1, D)
    y = torch.cat(ys, dim=2).view(b, nc * lc, d)[:, :l]  # Lc x (B, nc, 1, D) -> (B, nc, Lc, D) -> (B, L, D)
    return _finish(y, x_, D, carry.transpose(1, 2).contiguous(), return_state, x.dtype, z)  # state (B, D, N)


def parallel_scan_ref(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor | None = None, *, z: torch.Tensor | None = None,
                      delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
                      h0: torch.Tensor | None = None, return_state: bool = False):
    """The selective scan by Hillis-Steele doubling (1986): log2(L) rounds of `scan_combine`, each
    over all positions at once. Same arguments and result as `selective_scan_ref`.

    After round r, position t holds the composition of steps t − 2^r + 1 .. t (identity steps
    (1, 0) stand in before position 0). It does L·log2(L) combines instead of L, and every round
    writes new (B, L, D, N) tensors (autograd keeps them all): a teaching implementation.
    """
    _check_scan_inputs(x, delta, A, B, C, D, h0, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
    return _scan_parallel(x, delta, A, B, C, D, h0, return_state, z=z, delta_bias=delta_bias,
                          delta_softplus=delta_softplus)


def _scan_parallel(x, delta, A, B, C, D, h0, return_state, *, z=None, delta_bias=None, delta_softplus=False):
    wt = _work_dtype(x, delta, A, B, C, D, h0, z, delta_bias)
    x_, delta, A, B, C = (t.to(wt) for t in (x, delta, A, B, C))
    delta = _step_sizes(delta, delta_bias, delta_softplus)  # (B, L, D)
    l = x_.shape[1]
    a = torch.exp(delta.unsqueeze(-1) * A)  # (B, L, D, N)
    h = (delta * x_).unsqueeze(-1) * B.unsqueeze(2)  # (B, L, D, N): becomes h_t once every step is folded in
    if h0 is not None:  # the state before position 0 enters through the first step's offset
        h = torch.cat([h[:, :1] + a[:, :1] * h0.to(wt).unsqueeze(1), h[:, 1:]], dim=1)
    k = 1
    while k < l:
        a_prev = torch.cat([torch.ones_like(a[:, :k]), a[:, :-k]], dim=1)  # (B, L, D, N): steps ending at t - k
        h_prev = torch.cat([torch.zeros_like(h[:, :k]), h[:, :-k]], dim=1)
        a, h = scan_combine((a_prev, h_prev), (a, h))
        k *= 2
    y = (h * C.unsqueeze(2)).sum(-1)  # (B, L, D, N) · (B, L, 1, N) -> (B, L, D)
    return _finish(y, x_, D, h[:, -1], return_state, x.dtype, z)


def _selective_scan_triton(*args, **kwargs):
    """lib.kernels.scan.selective_scan_triton, imported on first use (it imports triton)."""
    from lib.kernels.scan import selective_scan_triton
    return selective_scan_triton(*args, **kwargs)


def _scan_triton(x, delta, A, B, C, D, h0, return_state, **extras):
    return _selective_scan_triton(x, delta, A, B, C, D, h0=h0, return_state=return_state, **extras)


def _selective_scan_cpu(*args, **kwargs):
    """lib.kernels.scan_cpu.selective_scan_cpu, imported on first use (it builds the C library)."""
    from lib.kernels.scan_cpu import selective_scan_cpu
    return selective_scan_cpu(*args, **kwargs)


def _scan_cpu(x, delta, A, B, C, D, h0, return_state, **extras):
    from lib.kernels.scan_cpu import _scan  # the checked entry point's body, after this module's own checks
    return _scan(x, delta, A, B, C, D, h0, return_state, **extras)


def _chunked_scan(*args, **kwargs):
    """selective_scan with impl="chunked": the chunked PyTorch scan, whatever the inputs."""
    return selective_scan(*args, **kwargs, impl="chunked")


SCANS: dict[str, Callable] = {"auto": selective_scan, "chunked": _chunked_scan, "cpu": _selective_scan_cpu,
                              "ref": selective_scan_ref, "parallel": parallel_scan_ref, "triton": _selective_scan_triton}
_SCANS_UNCHECKED = {"auto": _scan_auto, "chunked": _scan_chunked, "cpu": _scan_cpu, "ref": _scan_ref,
                    "parallel": _scan_parallel, "triton": _scan_triton}


# --------------------------------------------------------------------------- LTI: a convolution
def lti_kernel(A_bar: torch.Tensor, B_bar: torch.Tensor, C: torch.Tensor, L: int) -> torch.Tensor:
    """The convolution kernel of a time-invariant diagonal SSM: K_k = Σ_n C_n Ā_n^k B̄_n, k < L.

    A_bar, B_bar (D, N) (fixed over time: one Δ per channel); C (N,) or (D, N) -> K (D, L). Then
    y = K * x (`ssm_convolution`) equals the recurrence h_t = Ā ⊙ h_{t-1} + B̄ x_t, y_t = C · h_t
    started from zero (S4, Gu et al. 2021, §3.2; the Vandermonde form of S4D).
    """
    for name, t in (("A_bar", A_bar), ("B_bar", B_bar), ("C", C)):
        require_tensor(name, t, floating=True)
    require_rank("A_bar", A_bar, 2, "(D, N)")
    require_int("L", L, minimum=1)
    if tuple(B_bar.shape) != tuple(A_bar.shape):
        raise ValueError(f"B_bar must have shape (D, N) = {tuple(A_bar.shape)} like A_bar, got {tuple(B_bar.shape)}")
    if tuple(C.shape) not in ((A_bar.shape[1],), tuple(A_bar.shape)):
        raise ValueError(f"C must have shape (N,) = ({A_bar.shape[1]},) or (D, N) = {tuple(A_bar.shape)}, "
                         f"got {tuple(C.shape)}")
    k = torch.arange(L, device=A_bar.device, dtype=A_bar.dtype)  # (L,)
    powers = A_bar.unsqueeze(-1) ** k  # (D, N, 1) ** (L,) -> (D, N, L): Ā^k, a Vandermonde matrix per channel
    return torch.einsum("dnl,dn->dl", powers, C * B_bar)  # (D, N, L) · (D, N) -> (D, L)


def ssm_convolution(x: torch.Tensor, K: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise convolution y_t = Σ_{k<=t} K_k ⊙ x_{t−k} (+ D ⊙ x_t), by FFT (as S4).

    x (B, L, D); K (D, L_K) with L_K >= L (`lti_kernel`); D (D,) or None -> y (B, L, D). Both
    signals are zero-padded to 2L so the FFT's circular convolution does not wrap around.
    """
    require_tensor("x", x, floating=True)
    require_tensor("K", K, floating=True)
    require_rank("x", x, 3, "(B, L, D)")
    require_rank("K", K, 2, "(D, L_K)")
    b, l, d = x.shape
    if K.shape[0] != d or K.shape[1] < l:
        raise ValueError(f"K must have shape (D, L_K) with D = {d} and L_K >= L = {l}, got {tuple(K.shape)}")
    if D is not None:
        require_tensor("D", D, floating=True)
        if tuple(D.shape) != (d,):
            raise ValueError(f"D must have shape (D,) = ({d},), got {tuple(D.shape)}")
    wt = _work_dtype(x, K)
    xf = torch.fft.rfft(x.to(wt).transpose(1, 2), n=2 * l)  # (B, D, L) -> (B, D, L + 1) complex
    kf = torch.fft.rfft(K[:, :l].to(wt), n=2 * l)  # (D, L) -> (D, L + 1)
    y = torch.fft.irfft(xf * kf, n=2 * l)[..., :l].transpose(1, 2)  # (B, D, 2L) -> (B, L, D)
    if D is not None:
        y = y + x.to(wt) * D.to(wt)
    return y.to(x.dtype)


# --------------------------------------------------------------------------- the mixer's convolution
CONV_ACTIVATIONS = (None, "silu")


def _check_conv_inputs(x, weight, bias, state, activation=None) -> None:
    """x (B, T, E); weight (E, 1, K) or (E, K); bias (E,) or None; state (B, E, K − 1) or None;
    activation None or "silu"."""
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    require_tensor("x", x, floating=True)
    require_rank("x", x, 3, "(B, T, E)")
    b, t, e = x.shape
    if b == 0 or t == 0 or e == 0:
        raise ValueError(f"x must have shape (B, T, E) with every size >= 1, got {tuple(x.shape)}")
    require_tensor("weight", weight, floating=True)
    if weight.dim() not in (2, 3) or weight.shape[0] != e or (weight.dim() == 3 and weight.shape[1] != 1) \
            or weight.shape[-1] == 0:
        raise ValueError(f"weight must have shape (E, 1, K) (a depthwise nn.Conv1d's) or (E, K) with E = {e} and "
                         f"K >= 1, got {tuple(weight.shape)}")
    k = weight.shape[-1]
    for name, t_, shape in (("bias", bias, (e,)), ("state", state, (b, e, k - 1))):
        if t_ is None:
            continue
        require_tensor(name, t_, floating=True)
        if tuple(t_.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t_.shape)}")
    others = {n: t_.device for n, t_ in (("weight", weight), ("bias", bias), ("state", state)) if t_ is not None}
    if any(dev != x.device for dev in others.values()):
        raise ValueError(f"x, weight (and bias, state) must share one device, got x: {x.device}, "
                         + ", ".join(f"{n}: {d}" for n, d in others.items()))


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      state: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """The Mamba mixer's causal depthwise convolution by PyTorch's grouped conv1d, as the official
    code runs it: x (B, T, E), weight (E, 1, K) or (E, K), bias (E,) or None, state (B, E, K − 1)
    (the inputs before x; None: zeros) -> y (B, T, E), position t seeing t − K + 1 .. t; with
    activation="silu" (the official causal_conv1d_fn's), SiLU(y), as the mixer uses it."""
    _check_conv_inputs(x, weight, bias, state, activation)
    return _conv_ref(x, weight, bias, state, activation)


def _conv_ref(x, weight, bias, state, activation=None):
    b, t, e = x.shape
    k = weight.shape[-1]
    xs = x.transpose(1, 2)  # (B, E, T)
    window = torch.cat([xs.new_zeros(b, e, k - 1) if state is None else state.to(xs.dtype), xs], dim=-1)
    y = F.conv1d(window, weight.reshape(e, 1, k).to(xs.dtype), None if bias is None else bias.to(xs.dtype), groups=e)
    y = y.transpose(1, 2)  # (B, E, T) -> (B, T, E)
    return F.silu(y) if activation == "silu" else y


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  state: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """`causal_conv1d_ref`'s result (up to rounding), by the C loop of `lib.kernels.scan_cpu` for
    CPU tensors in fp32 or fp64 where it compiled (PyTorch's grouped conv1d spends milliseconds
    on each of this course's small inputs, mostly in its backward), else by the reference."""
    _check_conv_inputs(x, weight, bias, state, activation)
    return _conv_auto(x, weight, bias, state, activation)


def _conv_auto(x, weight, bias, state, activation=None):
    tensors = (x, weight, bias, state)
    if x.device.type == "cpu" and _work_dtype(*tensors) in (torch.float32, torch.float64) \
            and all(t is None or t.dtype == x.dtype for t in tensors):
        from lib.kernels.scan_cpu import _conv, cpu_kernel_available
        if cpu_kernel_available():
            return _conv(x, weight, bias, state, activation)
    return _conv_ref(x, weight, bias, state, activation)


# --------------------------------------------------------------------------- the model
SCAN_NAMES = tuple(SCANS)
NORMS = ("rms", "layer")


@dataclass
class MambaConfig:
    vocab_size: int  # V
    d_model: int  # C, the residual stream's width
    n_layers: int
    d_state: int = 16  # N
    d_conv: int = 4  # K
    expand: int = 2  # d_inner = expand · d_model, the channels D the scan runs over
    dt_rank: int | str = "auto"  # R; "auto" = ceil(d_model / 16) as in Mamba (an int after __post_init__)
    selective: bool = True  # False: Δ, B, C fixed parameters (LTI, S4D-like) instead of functions of x
    scan: str = "auto"  # "auto", "chunked", "cpu", "ref", "parallel" or "triton" (SCANS; "auto" as selective_scan)
    chunk_size: int | None = None  # None: default_chunk_size(L)
    norm: str = "rms"  # "rms" (RMSNorm, as Mamba) or "layer" (LayerNorm)
    norm_eps: float = 1e-5
    dt_min: float = 1e-3  # the initial Δ is log-uniform in [dt_min, dt_max] (Mamba's dt bias init)
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    conv_bias: bool = True
    bias: bool = False  # in_proj and out_proj

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "d_state", "d_conv", "expand"):
            require_int(name, getattr(self, name), minimum=1)
        if self.dt_rank == "auto":
            self.dt_rank = math.ceil(self.d_model / 16)
        require_int("dt_rank", self.dt_rank, minimum=1)
        if self.scan not in SCANS:
            raise ValueError(f"scan must be one of {SCAN_NAMES}, got {self.scan!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.chunk_size is not None:
            require_int("chunk_size", self.chunk_size, minimum=1)
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={self.dt_min}, dt_max={self.dt_max}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @classmethod
    def tiny(cls, vocab_size: int = 64, **changes) -> "MambaConfig":
        """A Mamba as wide and deep as `GPTConfig.tiny()` (d_model 128, 4 layers): seconds to train."""
        base = dict(vocab_size=vocab_size, d_model=128, n_layers=4)
        base.update(changes)
        return cls(**base)


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))  # softplus(x) = y  <=>  x = y + log(1 - exp(-y))


class SelectiveSSM(nn.Module):
    """The SSM of a Mamba mixer (S6, Mamba Algorithm 2): x (B, L, D) -> y (B, L, D), D = d_inner.

    Selective: [Δ_low, B, C] = x_proj(x) (R + 2N outputs), Δ = softplus(dt_proj(Δ_low)) (B, L, D).
    Non-selective (config.selective=False, LTI): Δ = softplus(dt_bias) (D,), B and C (N,) are
    parameters, the same at every position. Both: A = −exp(A_log) (D, N), S4D-real init
    A[d, n] = −(n + 1); D (D,) init 1; Δ's bias so that softplus(bias) is log-uniform in
    [dt_min, dt_max] (the official dt_proj init).
    """

    def __init__(self, config: MambaConfig):
        super().__init__()
        d, n, r = config.d_inner, config.d_state, config.dt_rank
        self.selective, self.scan, self.chunk_size = config.selective, config.scan, config.chunk_size
        self.d_state, self.dt_rank = n, r
        # (D, N): row d is 1..N. Never in half precision (the official code keeps A_log in fp32 for a
        # half model), in float64 in a float64 model, whose every step then stays float64.
        A = torch.arange(1, n + 1, dtype=torch.promote_types(torch.get_default_dtype(), torch.float32)).repeat(d, 1)
        self.A_log = nn.Parameter(torch.log(A))  # stored as a log so A = −exp(A_log) stays negative
        self.D = nn.Parameter(torch.ones(d))
        dt = torch.exp(torch.rand(d) * (math.log(config.dt_max) - math.log(config.dt_min)) + math.log(config.dt_min))
        dt_bias = _inverse_softplus(dt.clamp(min=config.dt_init_floor))  # (D,)
        if self.selective:
            self.x_proj = nn.Linear(d, r + 2 * n, bias=False)
            self.dt_proj = nn.Linear(r, d, bias=True)
            nn.init.uniform_(self.dt_proj.weight, -r ** -0.5, r ** -0.5)
            with torch.no_grad():
                self.dt_proj.bias.copy_(dt_bias)
            self.dt_proj.bias._no_reinit = True  # MambaLM's init leaves it alone (as the official code)
        else:
            self.dt_bias = nn.Parameter(dt_bias)
            self.B = nn.Parameter(torch.ones(n))
            self.C = nn.Parameter(torch.randn(n) * n ** -0.5)

    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))  # (D, N), never half

    def ssm_params(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Δ (B, L, D), A (D, N), B (B, L, N), C (B, L, N) for inputs x (B, L, D)."""
        b, l, d = x.shape
        A = self._A()
        if not self.selective:
            delta = F.softplus(self.dt_bias).expand(b, l, d)  # (D,) -> (B, L, D), the same at every step
            return delta, A, self.B.expand(b, l, -1), self.C.expand(b, l, -1)  # (N,) -> (B, L, N)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)  # (B, L, R), 2 x (B, L, N)
        delta = F.softplus(self.dt_proj(dt))  # (B, L, R) -> (B, L, D), > 0
        return delta, A, B, C

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None,
                z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, L, D), h0 (B, D, N) or None, z (B, L, D) or None -> y (B, L, D), gated by silu(z)
        when z is given, and h_L (B, D, N).

        The selective SSM hands the scan Δ before its bias and softplus, and the mixer's gate z, as
        the official mixer calls selective_scan_fn: a fused scan takes them into its loops (the C
        loop does), the others apply them around the scan."""
        kw = {"chunk_size": self.chunk_size} if self.scan in ("auto", "chunked") else {}  # with it, "auto" is chunked
        if self.selective:
            dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)  # (B, L, R), 2 x (B, L, N)
            dt = F.linear(dt, self.dt_proj.weight)  # (B, L, R) -> (B, L, D): Δ before its bias and softplus
            return _SCANS_UNCHECKED[self.scan](x, dt, self._A(), B, C, self.D, h0, True, z=z,
                                               delta_bias=self.dt_proj.bias, delta_softplus=True, **kw)
        delta, A, B, C = self.ssm_params(x)
        return _SCANS_UNCHECKED[self.scan](x, delta, A, B, C, self.D, h0, True, z=z, **kw)

    def step(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position: x (B, D), h (B, D, N) -> y (B, D), the next h (B, D, N)."""
        delta, A, B, C = self.ssm_params(x.unsqueeze(1))  # (B, 1, D), (D, N), (B, 1, N), (B, 1, N)
        delta, B, C = delta[:, 0], B[:, 0], C[:, 0]  # (B, D), (B, N), (B, N)
        h = torch.exp(delta.unsqueeze(-1) * A) * h + (delta * x).unsqueeze(-1) * B.unsqueeze(1)  # (B, D, N)
        y = (h * C.unsqueeze(1)).sum(-1) + self.D * x  # (B, D, N) · (B, 1, N) -> (B, D)
        return y, h


@dataclass
class MambaState:
    """What a MambaLM carries from one position to the next, per layer: `conv[i]` the conv's last
    K − 1 inputs (B, d_inner, K − 1) and `ssm[i]` the SSM state (B, d_inner, N). Its size does not
    depend on how many positions have been read (a KV cache grows by one entry per position)."""

    conv: list[torch.Tensor] = field(default_factory=list)
    ssm: list[torch.Tensor] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return self.ssm[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.ssm))


def _make_norm(config: MambaConfig) -> nn.Module:
    if config.norm == "rms":
        return RMSNorm(config.d_model, eps=config.norm_eps)  # nn.RMSNorm, by a fused loop on a CPU
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


class MambaMixer(nn.Module):
    """Mamba's mixer (Fig. 3): in_proj to 2·d_inner (x and the gate z), a causal depthwise conv
    of width K on x, SiLU, the selective SSM, y ⊙ SiLU(z), out_proj. (B, T, C) -> (B, T, C).

    `forward` takes `lib.gpt.Block`'s keyword arguments, so `Block(gpt_config, attn=MambaMixer(...))`
    runs; a mixer keeps no KV cache and reads order from its recurrence, so `rope` is ignored and
    `cache` and `mask` must be None.
    """

    def __init__(self, config: MambaConfig):
        super().__init__()
        if not isinstance(config, MambaConfig):
            raise TypeError(f"config must be a MambaConfig, got {type(config).__name__}")
        C, E, K = config.d_model, config.d_inner, config.d_conv
        self.d_inner, self.d_conv = E, K
        self.in_proj = nn.Linear(C, 2 * E, bias=config.bias)
        # Declared as the official code declares it (padding K − 1, output trimmed to the first T);
        # `forward_with_state` pads the left itself, with zeros or the carried inputs: the same thing.
        self.conv1d = nn.Conv1d(E, E, kernel_size=K, groups=E, padding=K - 1, bias=config.conv_bias)
        self.ssm = SelectiveSSM(config)
        self.out_proj = nn.Linear(E, C, bias=config.bias)

    def forward(self, x: torch.Tensor, *, cache=None, start: int = 0, rope=None, mask=None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C): from a zero state, or, with `cache` a `MixerCache` (as
        `lib.hybrid.HybridGPT.new_caches` makes), from the state it holds, which is then advanced."""
        if mask is not None:
            raise ValueError("a Mamba mixer takes no padding mask (mask must be None): a padding token would enter "
                             "its state; run unpadded sequences")
        if cache is None:
            return self.forward_with_state(x)[0]
        if not isinstance(cache, MixerCache):
            raise ValueError(f"a Mamba mixer carries a recurrent state, not a KV cache: cache must be a "
                             f"lib.ssm.MixerCache or None, got {type(cache).__name__}")
        return cache.advance(self, x, start)

    def forward_with_state(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x (B, T, C), state (conv (B, E, K−1), ssm (B, E, N)) or None (zeros) -> y (B, T, C) and
        the state after the last position. E = d_inner."""
        B, T, _ = x.shape
        E, K = self.d_inner, self.d_conv
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # (B, T, 2E) -> 2 x (B, T, E)
        conv_state = None if state is None else state[0].to(xs.dtype)  # (B, E, K − 1): the inputs before x
        # the depthwise conv over (conv_state, xs): position t sees t−K+1..t (a C loop on a CPU: causal_conv1d)
        # then SiLU; the scan applies the gate y ⊙ silu(z) (both fused into C loops on a CPU)
        xc = _conv_auto(xs, self.conv1d.weight, self.conv1d.bias, conv_state, "silu")  # (B, T, E)
        y, h = self.ssm(xc, None if state is None else state[1], z=z)  # (B, T, E), (B, E, N)
        if T >= K - 1:  # the conv's next state: the last K − 1 inputs
            last = xs[:, T - (K - 1):].transpose(1, 2)  # (B, E, K − 1)
        else:
            last = torch.cat([xs.new_zeros(B, E, K - 1) if conv_state is None else conv_state,
                              xs.transpose(1, 2)], dim=-1)[..., T:]
        return self.out_proj(y), (last, h.to(x.dtype))

    def step(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
        """One position: x (B, C), state (conv (B, E, K−1), ssm (B, E, N)) -> y (B, C), the next state."""
        conv_state, h = state
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # (B, 2E) -> 2 x (B, E)
        window = torch.cat([conv_state, xs.unsqueeze(-1)], dim=-1)  # (B, E, K): the conv's whole receptive field
        xs = (window * self.conv1d.weight[:, 0]).sum(-1)  # (B, E, K) · (E, K) -> (B, E): one conv output
        if self.conv1d.bias is not None:
            xs = xs + self.conv1d.bias
        y, h = self.ssm.step(F.silu(xs), h)  # (B, E), (B, E, N)
        y = y * F.silu(z)
        return self.out_proj(y), (window[..., 1:], h)  # the window drops its oldest input


class MixerCache:
    """One Mamba mixer's recurrent state while decoding, in the slot where an attention layer keeps
    its `KVCache`: conv (B, E, K−1) and ssm (B, E, N), plus `length`, the positions read so far.
    Its size does not depend on `length` (a KV cache grows by one entry per position)."""

    def __init__(self, batch_size: int, d_inner: int, d_conv: int, d_state: int, *,
                 dtype: torch.dtype = torch.float32, device=None):
        for name, value in (("batch_size", batch_size), ("d_inner", d_inner), ("d_conv", d_conv), ("d_state", d_state)):
            require_int(name, value, minimum=1)
        self.conv = torch.zeros(batch_size, d_inner, d_conv - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(batch_size, d_inner, d_state, dtype=dtype, device=device)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.ssm.shape[0]

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()

    def advance(self, mixer: "MambaMixer", x: torch.Tensor, start: int) -> torch.Tensor:
        """Run `mixer` on x (B, T, C) at positions start..start+T−1 from the held state; keep the new state."""
        require_int("start", start, minimum=0)
        if start != self.length:
            raise ValueError(f"start must equal the positions already read ({self.length}): a recurrent state "
                             f"cannot skip or rewind positions, got {start}")
        if x.shape[0] != self.batch_size:
            raise ValueError(f"the cache was built for batch size {self.batch_size}, x has batch size {x.shape[0]}")
        y, (conv, ssm) = mixer.forward_with_state(x, (self.conv, self.ssm))
        self.conv, self.ssm = conv.to(self.conv.dtype), ssm.to(self.ssm.dtype)
        self.length += x.shape[1]
        return y

    def __repr__(self) -> str:
        B, E, N = self.ssm.shape
        return f"MixerCache(B={B}, E={E}, K-1={self.conv.shape[-1]}, N={N}, length={self.length}, {self.nbytes} bytes)"


class MambaBlock(nn.Module):
    """A pre-norm residual block, as Mamba's `Block`: x + mixer(norm(x)). (B, T, C) -> (B, T, C)."""

    def __init__(self, config: MambaConfig):
        super().__init__()
        self.norm = _make_norm(config)
        self.mixer = MambaMixer(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))

    def forward_with_state(self, x: torch.Tensor, state=None):
        y, state = self.mixer.forward_with_state(self.norm(x), state)
        return x + y, state

    def step(self, x: torch.Tensor, state):
        y, state = self.mixer.step(self.norm(x), state)
        return x + y, state


class MambaLM(nn.Module):
    """A Mamba language model: embedding -> n_layers × MambaBlock -> norm -> head tied to the
    embedding (the official MambaLMHeadModel). `forward(idx)` returns logits (B, T, V);
    `forward(idx, targets)` returns (logits, loss), targets[b, t] the token after idx[b, t]
    (−100 = ignore), as `lib.gpt.GPT`. No positional embedding and no context limit."""

    def __init__(self, config: MambaConfig):
        super().__init__()
        if not isinstance(config, MambaConfig):
            raise TypeError(f"config must be a MambaConfig, got {type(config).__name__}")
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList([MambaBlock(config) for _ in range(config.n_layers)])
        self.norm_f = _make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight  # tied
        # The official init: zero biases (but dt_proj's), embedding std 0.02, and each residual
        # branch's out_proj scaled by 1/sqrt(n_layers) so the stream's variance does not grow with depth.
        for module in self.modules():
            bias = getattr(module, "bias", None)
            if isinstance(module, nn.Linear) and bias is not None and not getattr(bias, "_no_reinit", False):
                nn.init.zeros_(bias)
        nn.init.normal_(self.embedding.weight, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight"):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                with torch.no_grad():
                    p /= math.sqrt(config.n_layers)

    def num_parameters(self) -> int:
        """Distinct parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def _check_idx(self, name: str, idx) -> None:
        require_token_ids(name, idx, vocab_size=self.config.vocab_size, max_len=sys.maxsize, context="(none)")
        if idx.device != self.embedding.weight.device:
            raise ValueError(f"{name} must be on the model's device {self.embedding.weight.device}, got {idx.device}")

    def _check_state(self, state, batch: int) -> None:
        if not isinstance(state, MambaState):
            raise TypeError(f"state must be a MambaState (from new_state, prefill or step), got {type(state).__name__}")
        L, E, K, N = self.config.n_layers, self.config.d_inner, self.config.d_conv, self.config.d_state
        if len(state.conv) != L or len(state.ssm) != L:
            raise ValueError(f"state must hold one conv and one ssm tensor per layer ({L}), "
                             f"got {len(state.conv)} and {len(state.ssm)}")
        for i in range(L):
            for name, t, shape in (("conv", state.conv[i], (batch, E, K - 1)), ("ssm", state.ssm[i], (batch, E, N))):
                if tuple(t.shape) != shape:
                    raise ValueError(f"state.{name}[{i}] must have shape {shape} for a batch of {batch}, "
                                     f"got {tuple(t.shape)}")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) token ids -> logits (B, T, V), or (logits, loss) with targets (B, T)."""
        self._check_idx("idx", idx)
        B, T = idx.shape
        x = self.embedding(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm_f(x))  # (B, T, V)
        if targets is None:
            return logits
        _check_targets("targets", targets, (B, T), self.config.vocab_size)
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
        return logits, loss

    def new_state(self, batch: int) -> MambaState:
        """The state before any token: zeros, on the model's device and dtype."""
        require_int("batch", batch, minimum=1)
        w = self.embedding.weight
        E, K, N = self.config.d_inner, self.config.d_conv, self.config.d_state
        return MambaState(conv=[w.new_zeros(batch, E, K - 1) for _ in self.layers],
                          ssm=[w.new_zeros(batch, E, N) for _ in self.layers])

    def prefill(self, idx: torch.Tensor, state: MambaState | None = None) -> tuple[torch.Tensor, MambaState]:
        """Read T tokens at once (the parallel scan), continuing from `state` (None: from zero).
        idx (B, T) -> logits (B, T, V) and the state after the last token."""
        self._check_idx("idx", idx)
        if state is not None:
            self._check_state(state, idx.shape[0])
        x = self.embedding(idx)  # (B, T, C)
        new = MambaState()
        for i, layer in enumerate(self.layers):
            x, (conv, ssm) = layer.forward_with_state(x, None if state is None else (state.conv[i], state.ssm[i]))
            new.conv.append(conv)
            new.ssm.append(ssm)
        return self.lm_head(self.norm_f(x)), new

    def step(self, idx_t: torch.Tensor, state: MambaState) -> tuple[torch.Tensor, MambaState]:
        """Read one token per sequence with the recurrence: idx_t (B,) -> next-token logits (B, V)
        and the next state (the same size as `state`; `state` itself is not modified)."""
        require_tensor("idx_t", idx_t)
        require_rank("idx_t", idx_t, 1, "(B,) one token id per sequence")
        self._check_idx("idx_t", idx_t.unsqueeze(1))
        self._check_state(state, idx_t.shape[0])
        x = self.embedding(idx_t)  # (B, C)
        new = MambaState()
        for i, layer in enumerate(self.layers):
            x, (conv, ssm) = layer.step(x, (state.conv[i], state.ssm[i]))
            new.conv.append(conv)
            new.ssm.append(ssm)
        return self.lm_head(self.norm_f(x)), new  # (B, V)


@torch.no_grad()
def trace_states(model: MambaLM, idx: torch.Tensor, layer: int = 0) -> dict[str, torch.Tensor]:
    """What layer `layer`'s SSM does on idx (B, T): its step sizes Δ (B, T, D) and every state h_t
    (B, T, D, N), D = d_inner, recomputed step by step from the SSM's own inputs (for drawing:
    widgets.SSMStateView). The layer's output is checked against the recomputed states."""
    if not isinstance(model, MambaLM):
        raise TypeError(f"model must be a MambaLM, got {type(model).__name__}")
    require_int("layer", layer, minimum=0)
    if layer >= len(model.layers):
        raise ValueError(f"layer must be < n_layers = {len(model.layers)}, got {layer}")
    ssm = model.layers[layer].mixer.ssm
    seen = {}
    hook = ssm.register_forward_hook(lambda mod, args, kwargs, out: seen.update(x=args[0], z=kwargs.get("z"), y=out[0]),
                                     with_kwargs=True)
    try:
        was_training = model.training
        model.eval()
        model(idx)
        model.train(was_training)
    finally:
        hook.remove()
    work = torch.promote_types(seen["x"].dtype, torch.float32)  # fp32 at least; a float64 model stays float64
    x = seen["x"].to(work)  # (B, T, D): the SSM's input (after the conv and SiLU)
    delta, A, B, C = ssm.ssm_params(x)
    A_bar, Bx = torch.exp(delta.unsqueeze(-1) * A), (delta * x).unsqueeze(-1) * B.unsqueeze(2)  # (B, T, D, N) each
    h, states = torch.zeros_like(A_bar[:, 0]), []
    for a_t, bx_t in zip(A_bar.unbind(1), Bx.unbind(1)):
        h = a_t * h + bx_t  # (B, D, N)
        states.append(h)
    states = torch.stack(states, dim=1)  # (B, T, D, N)
    y = (states * C.unsqueeze(2)).sum(-1) + ssm.D * x  # (B, T, D)
    if seen["z"] is not None:
        y = y * F.silu(seen["z"].to(work))  # the mixer's gate, which the layer's scan applied
    # fp32: the layer's scan (chunked or not) and this step-by-step loop differ by rounding only
    if not torch.allclose(y, seen["y"].to(work), rtol=1e-4, atol=1e-5):
        raise RuntimeError("the recomputed states do not reproduce the layer's output")
    return {"delta": delta, "h": states}


def state_bytes(model_or_config: MambaLM | MambaConfig, batch: int, dtype: torch.dtype | str | None = None) -> int:
    """Bytes of a MambaLM's recurrent state for `batch` sequences, at any position:
    n_layers × B × d_inner × ((K − 1) + N) × bytes per element.

    `dtype` a torch.dtype or a name of lib.kv_cache.DTYPE_BYTES ("fp16"); by default the model's
    parameter dtype (what `new_state` allocates), float32 for a config. For mamba-130m's shape
    (24 layers, d_inner 1536, N 16, K 4) in fp16 that is 1.4 MB per sequence, whatever the length;
    compare `lib.kv_cache.kv_cache_bytes`, which grows by a fixed amount per position.
    """
    if isinstance(model_or_config, MambaLM):
        config = model_or_config.config
    elif isinstance(model_or_config, MambaConfig):
        config = model_or_config
    else:
        raise TypeError(f"model_or_config must be a MambaLM or a MambaConfig, got {type(model_or_config).__name__}")
    require_int("batch", batch, minimum=1)
    if dtype is None:
        dtype = next(model_or_config.parameters()).dtype if isinstance(model_or_config, MambaLM) else torch.float32
    bpe = dtype_bytes(dtype)
    n_elems = config.n_layers * batch * config.d_inner * (config.d_conv - 1 + config.d_state)
    return math.ceil(n_elems * bpe)


@torch.no_grad()
def generate(model: MambaLM, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend idx (B, T) by `max_new_tokens` sampled tokens -> (B, T + max_new_tokens).

    The prompt is read in parallel (`prefill`), then each new token with one recurrent `step`:
    the state carried between steps has the same size at every position. temperature 0 is greedy;
    top_k / top_p and the seeded `generator` as in `lib.sampling.sample_next_token`.
    """
    if not isinstance(model, MambaLM):
        raise TypeError(f"model must be a lib.ssm.MambaLM, got {type(model).__name__}")
    require_int("max_new_tokens", max_new_tokens, minimum=0)
    _check_knobs(temperature, top_k, top_p)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    was_training = model.training
    model.eval()
    logits, state = model.prefill(idx)
    logits = logits[:, -1]  # (B, V): the last prompt position predicts the first new token
    out = [idx]
    for step in range(max_new_tokens):
        nxt = sample_next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)  # (B,)
        out.append(nxt[:, None].to(idx.dtype))
        if step < max_new_tokens - 1:
            logits, state = model.step(nxt, state)  # (B, V)
    model.train(was_training)
    return torch.cat(out, dim=1)
