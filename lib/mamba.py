"""Mamba's layer: the selective SSM inside a gated mixer, and the state it carries while decoding.

Follows Mamba (Gu & Dao 2023, arXiv 2312.00752): §3.2 and Algorithm 2 for the selective SSM (S6),
§3.4 / Fig. 3 for the block; parameter names and initialisation as in the official
`mamba_ssm/modules/mamba_simple.py` (and mamba-minimal's `model.py`). The recurrence it runs is
`lib.scan` (the definition and its fast forms); the mixer's short convolution is `lib.conv`.

    MambaConfig    sizes and choices (d_state N, d_conv K, expand, dt_rank R, which scan, which norm)
    SelectiveSSM   Δ, B, C from the input (or fixed: LTI), A = −exp(A_log), the skip D; runs a scan
    MambaMixer     in_proj to x and the gate z, causal conv + SiLU, SelectiveSSM, gate, out_proj
    MixerCache     one mixer's state while decoding: the conv's last K − 1 inputs and the SSM state,
                   one size at every position (compare `lib.kv_cache.KVCache`, which grows)

The language model stacked from these mixers (MambaBlock, MambaLM, trace_states, state_bytes) is
`lib.mamba_lm`.

`MambaMixer` also takes `lib.gpt.Block`'s call signature (with a `MixerCache` where attention keeps
its KV cache), so it can stand in for attention there (`lib.hybrid`). The official layout keeps
x_proj, dt_proj, A_log and D directly in the mixer; here they sit in its `ssm` (a `SelectiveSSM`),
so their names gain an `ssm.` step.

Glossary (the paper's letters): B batch, L (T) sequence length, C d_model, D (E) channels the scan
runs over (d_inner = expand · d_model), N state size per channel (d_state), R rank of Δ's
projection (dt_rank), K conv width (d_conv), V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import checking, require_int
from lib.conv import causal_conv1d
from lib.kv_cache import dtype_bytes
from lib.scan import SCANS

__all__ = ["MambaConfig", "MambaMixer", "MixerCache", "SelectiveSSM", "state_elements"]


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

    @property
    def n_layer(self) -> int:
        """n_layers under the decoders' name for it (GPTConfig, LlamaConfig): one door checks them all."""
        return self.n_layers

    @classmethod
    def tiny(cls, vocab_size: int = 64, **changes) -> "MambaConfig":
        """A Mamba as wide and deep as `GPTConfig.tiny()` (d_model 128, 4 layers): seconds to train."""
        base = dict(vocab_size=vocab_size, d_model=128, n_layers=4)
        base.update(changes)
        return cls(**base)


def state_elements(config: MambaConfig, batch: int) -> int:
    """Elements of one mixer's recurrent state for `batch` sequences: B · d_inner · ((K − 1) + N),
    the convolution's last K − 1 inputs and the SSM's state (a MixerCache's conv and ssm)."""
    return batch * config.d_inner * (config.d_conv - 1 + config.d_state)


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
            nn.init.uniform_(self.dt_proj.weight, -(r**-0.5), r**-0.5)
            with torch.no_grad():
                self.dt_proj.bias.copy_(dt_bias)
            self.dt_proj.bias._no_reinit = True  # MambaLM's init leaves it alone (as the official code)
        else:
            self.dt_bias = nn.Parameter(dt_bias)
            self.B = nn.Parameter(torch.ones(n))
            self.C = nn.Parameter(torch.randn(n) * n**-0.5)

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

    def forward(
        self, x: torch.Tensor, h0: torch.Tensor | None = None, z: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, L, D), h0 (B, D, N) or None, z (B, L, D) or None -> y (B, L, D), gated by silu(z)
        when z is given, and h_L (B, D, N).

        The selective SSM hands the scan Δ before its bias and softplus, and the mixer's gate z, as
        the official mixer calls selective_scan_fn: a fused scan takes them into its loops (the C
        loop does), the others apply them around the scan."""
        kw = {"chunk_size": self.chunk_size} if self.scan in ("auto", "chunked") else {}  # with it, "auto" is chunked
        if self.selective:
            dt, B, C = self.x_proj(x).split(
                [self.dt_rank, self.d_state, self.d_state], dim=-1
            )  # (B, L, R), 2 x (B, L, N)
            dt = F.linear(dt, self.dt_proj.weight)  # (B, L, R) -> (B, L, D): Δ before its bias and softplus
            return SCANS[self.scan](
                x, dt, self._A(), B, C, self.D, h0, True, z=z, delta_bias=self.dt_proj.bias, delta_softplus=True, **kw
            )
        delta, A, B, C = self.ssm_params(x)
        return SCANS[self.scan](x, delta, A, B, C, self.D, h0, True, z=z, **kw)

    def step(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position: x (B, D), h (B, D, N) -> y (B, D), the next h (B, D, N)."""
        delta, A, B, C = self.ssm_params(x.unsqueeze(1))  # (B, 1, D), (D, N), (B, 1, N), (B, 1, N)
        delta, B, C = delta[:, 0], B[:, 0], C[:, 0]  # (B, D), (B, N), (B, N)
        h = torch.exp(delta.unsqueeze(-1) * A) * h + (delta * x).unsqueeze(-1) * B.unsqueeze(1)  # (B, D, N)
        y = (h * C.unsqueeze(1)).sum(-1) + self.D * x  # (B, D, N) · (B, 1, N) -> (B, D)
        return y, h


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
        self.config = config

    def new_cache(self, batch_size: int, max_len: int | None = None, *, dtype: torch.dtype, device) -> "MixerCache":
        """An empty (zero) state for this mixer. `max_len` is accepted for the decoder protocol and
        ignored: the state does not grow."""
        c = self.config
        return MixerCache(batch_size, c.d_inner, c.d_conv, c.d_state, dtype=dtype, device=device)

    def cache_bytes(self, batch: int, seq_len: int, dtype: torch.dtype | str) -> int:
        """Bytes of this mixer's state, the same after any number of tokens: B · E · (K − 1 + N) · bytes."""
        require_int("batch", batch, minimum=1)
        return math.ceil(state_elements(self.config, batch) * dtype_bytes(torch.float32 if dtype is None else dtype))

    def forward(self, x: torch.Tensor, *, cache=None, start: int = 0, rope=None, mask=None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C): from a zero state, or, with `cache` a `MixerCache` (as
        `lib.hybrid.HybridGPT.new_caches` makes), from the state it holds, which is then advanced."""
        if mask is not None:
            raise ValueError(
                "a Mamba mixer takes no padding mask (mask must be None): a padding token would enter "
                "its state; run unpadded sequences"
            )
        if cache is None:
            return self.forward_with_state(x)[0]
        if not isinstance(cache, MixerCache):
            raise ValueError(
                f"a Mamba mixer carries a recurrent state, not a KV cache: cache must be a "
                f"lib.mamba.MixerCache or None, got {type(cache).__name__}"
            )
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
        xc = causal_conv1d(xs, self.conv1d.weight, self.conv1d.bias, conv_state, "silu")  # (B, T, E)
        y, h = self.ssm(xc, None if state is None else state[1], z=z)  # (B, T, E), (B, E, N)
        if T >= K - 1:  # the conv's next state: the last K − 1 inputs
            last = xs[:, T - (K - 1) :].transpose(1, 2)  # (B, E, K − 1)
        else:
            last = torch.cat(
                [xs.new_zeros(B, E, K - 1) if conv_state is None else conv_state, xs.transpose(1, 2)], dim=-1
            )[..., T:]
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

    def __init__(
        self,
        batch_size: int,
        d_inner: int,
        d_conv: int,
        d_state: int,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
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
        if checking():
            require_int("start", start, minimum=0)
            if start != self.length:
                raise ValueError(
                    f"start must equal the positions already read ({self.length}): a recurrent state "
                    f"cannot skip or rewind positions, got {start}"
                )
            if x.shape[0] != self.batch_size:
                raise ValueError(f"the cache was built for batch size {self.batch_size}, x has batch size {x.shape[0]}")
        if x.shape[1] == 1:  # one token (decoding): the recurrence, as mamba_ssm's `step`
            y, (conv, ssm) = mixer.step(x[:, 0], (self.conv, self.ssm))
            y = y.unsqueeze(1)  # (B, 1, C)
        else:  # a prompt: the scan, from the held state
            y, (conv, ssm) = mixer.forward_with_state(x, (self.conv, self.ssm))
        self.conv, self.ssm = conv.to(self.conv.dtype), ssm.to(self.ssm.dtype)
        self.length += x.shape[1]
        return y

    def __repr__(self) -> str:
        B, E, N = self.ssm.shape
        return f"MixerCache(B={B}, E={E}, K-1={self.conv.shape[-1]}, N={N}, length={self.length}, {self.nbytes} bytes)"
