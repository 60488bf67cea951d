"""The selective scan as one fused Triton kernel (lesson 06): the state never leaves the chip.

`lib.scan.selective_scan_ref` is the definition: h_t = exp(Δ_t·A) ⊙ h_{t-1} + (Δ_t x_t) B_t,
y_t = C_t · h_t (+ D ⊙ x_t), per channel d and state entry n. In PyTorch each of those operations
reads and writes a (B, L, D, N) tensor in main memory. The official Mamba kernel (Gu & Dao 2023,
§3.3.2, "hardware-aware algorithm") instead loads Δ, A, B, C, x once, keeps the (D, N) state in
fast on-chip memory, discretises and scans there, and writes only y (B, L, D): N times fewer bytes
than the state sequence.

This kernel does the same in its simplest form: one program per (sequence, block of BLOCK_D
channels) holds its (BLOCK_D, N) slice of the state in registers and walks the L positions in order.
The work is sequential in time and parallel over batch and channels: B · D / BLOCK_D programs.
(The official kernel also splits L into chunks scanned in parallel within a thread block; this one
does not, which is enough to remove the memory traffic but leaves short-and-narrow inputs with few
programs.) Everything is computed in fp32.

    launch   the raw launcher: checked fp32 inputs in, y and the final state out. The front door,
             with the checks, the extras of a Mamba mixer (delta_bias and softplus before, the gate z
             after, in PyTorch) and the gradients, is `lib.scan.selective_scan_triton`

The backward is not a kernel: `lib.scan` recomputes the forward with the chunked PyTorch scan
under autograd and returns its gradients, so gradients equal the chunked scan's (tested); the
speed of the fused kernel is the forward's. (The CPU loop in lib/kernels/scan_cpu.py has a fused
backward of its own.)

Like the attention kernels, it runs compiled on a CUDA GPU and in Triton's interpreter on CPU
tensors when TRITON_INTERPRET=1 (`lib.kernels.runtime` sets it on machines without a GPU); the interpreter
checks correctness, not speed.
"""

from __future__ import annotations

import torch

from lib.kernels import runtime

triton, tl = runtime.load_triton()  # (None, None) without triton: importing works, launching refuses

__all__ = ["launch"]


if triton is not None:

    @triton.jit
    def _selective_scan_fwd_kernel(
        X,
        DT,
        A,
        Bm,
        Cm,
        Dskip,
        H0,
        Y,
        HL,
        L,
        n_ch,
        n_st,
        HAS_D: tl.constexpr,
        HAS_H0: tl.constexpr,
        STORE_STATE: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """y (and the final state) for one sequence and BLOCK_D channels. Inputs contiguous fp32:
        X, DT, Y (B, L, D); A (D, N); Bm, Cm (B, L, N); Dskip (D,); H0, HL (B, D, N)."""
        pid_b = tl.program_id(0)
        pid_d = tl.program_id(1)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,) channels
        offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,) state entries
        mask_d = offs_d < n_ch
        mask_n = offs_n < n_st
        mask_dn = mask_d[:, None] & mask_n[None, :]
        # Padding entries get A = 0 and B = 0: Ā = 1 and no input, so their state stays 0 and
        # contributes nothing to y.
        a = tl.load(A + offs_d[:, None] * n_st + offs_n[None, :], mask=mask_dn, other=0.0)  # (BLOCK_D, BLOCK_N)
        state_ptrs = pid_b * n_ch * n_st + offs_d[:, None] * n_st + offs_n[None, :]
        if HAS_H0:
            h = tl.load(H0 + state_ptrs, mask=mask_dn, other=0.0)
        else:
            h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
        if HAS_D:
            skip = tl.load(Dskip + offs_d, mask=mask_d, other=0.0)  # (BLOCK_D,)
        x_row = X + pid_b * L * n_ch + offs_d  # position 0's channels; one row is n_ch further on
        dt_row = DT + pid_b * L * n_ch + offs_d
        y_row = Y + pid_b * L * n_ch + offs_d
        b_row = Bm + pid_b * L * n_st + offs_n
        c_row = Cm + pid_b * L * n_st + offs_n
        for t in range(0, L):
            x = tl.load(x_row + t * n_ch, mask=mask_d, other=0.0)  # (BLOCK_D,)
            dt = tl.load(dt_row + t * n_ch, mask=mask_d, other=0.0)  # (BLOCK_D,)
            b = tl.load(b_row + t * n_st, mask=mask_n, other=0.0)  # (BLOCK_N,)
            c = tl.load(c_row + t * n_st, mask=mask_n, other=0.0)  # (BLOCK_N,)
            a_bar = tl.exp(dt[:, None] * a)  # (BLOCK_D, BLOCK_N): Ā_t = exp(Δ_t A) <= 1
            h = a_bar * h + (dt * x)[:, None] * b[None, :]  # Ā_t ⊙ h + B̄_t x_t
            y = tl.sum(h * c[None, :], axis=1)  # (BLOCK_D,): C_t · h_t
            if HAS_D:
                y = y + skip * x
            tl.store(y_row + t * n_ch, y, mask=mask_d)
        if STORE_STATE:
            tl.store(HL + state_ptrs, h, mask=mask_dn)


def _block_sizes(n_ch: int, n_st: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N): all N state entries in one block (N is small: 16 in Mamba); BLOCK_D
    keeps a program's state tile at about 2048 fp32 values (registers on a GPU), capped at 64."""
    block_n = max(2, triton.next_power_of_2(n_st))
    block_d = max(2, min(64, triton.next_power_of_2(n_ch), 2048 // block_n))
    return block_d, block_n


def launch(x, delta, A, B, C, D, h0, return_state: bool):
    """Run the kernel on fp32 contiguous copies of checked inputs (x, delta (B, L, D), A (D, N),
    B, C (B, L, N), D (D,) or None, h0 (B, D, N) or None): y (B, L, D) in fp32 with the skip added,
    and the final state (B, D, N), or None without return_state. No checks, no autograd: the front
    door is `lib.scan.selective_scan_triton`, which also gives it gradients."""
    b, l, d = x.shape
    n = A.shape[1]
    f32 = [None if t is None else t.to(torch.float32).contiguous() for t in (x, delta, A, B, C, D, h0)]
    x32, dt32, a32, b32, c32, d32, h032 = f32
    y = torch.empty_like(x32)
    # without return_state the kernel never writes HL (STORE_STATE is off): y stands in for the pointer
    hl = torch.empty(b, d, n, device=x.device, dtype=torch.float32) if return_state else y
    block_d, block_n = _block_sizes(d, n)
    grid = (b, triton.cdiv(d, block_d))
    _selective_scan_fwd_kernel[grid](
        x32,
        dt32,
        a32,
        b32,
        c32,
        d32 if d32 is not None else x32,
        h032 if h032 is not None else x32,
        y,
        hl,
        l,
        d,
        n,
        HAS_D=D is not None,
        HAS_H0=h0 is not None,
        STORE_STATE=return_state,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
    )
    return y, (hl if return_state else None)
