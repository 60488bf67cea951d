"""The Mamba language model around lib.mamba's mixer: residual blocks, the stacked model, and
what is measured on it.

Follows Mamba (Gu & Dao 2023, arXiv 2312.00752) §3.4 / Fig. 3 for the block; the model and its
initialisation as the official `MambaLMHeadModel` (`mamba_ssm/models/mixer_seq_simple.py`).

    MambaBlock      x + mixer(norm(x))
    MambaLM         embedding -> n_layers × MambaBlock -> norm -> tied head, with `forward(idx,
                    targets)` like `lib.gpt.GPT` (so `lib.train.train_lm` trains it); a
                    `lib.decode.Decoder`: `new_caches` gives each layer a `MixerCache` (the conv's
                    last K − 1 inputs and the SSM state, one size at every position), `forward`
                    takes them, and `lib.decode.generate` samples from it
    refuse_padding  the door of a model with Mamba layers (this one, `lib.hybrid`): no padding mask
    trace_states    every state h_t of one layer, for drawing; `state_bytes` the state's size (compare
                    `lib.kv_cache.kv_cache_bytes`, which grows with the context)

The config, the selective SSM, the mixer and its `MixerCache` are lib.mamba.

Glossary (lib.mamba's, the paper's letters): B batch, L (T) sequence length, C d_model, D (E)
channels the scan runs over (d_inner = expand · d_model), N state size per channel (d_state),
K conv width (d_conv), V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import require_int
from lib._door import DECODER_FORWARD
from lib.kv_cache import dtype_bytes
from lib.mamba import MambaConfig, MambaMixer, MixerCache, state_elements
from lib.norms import RMSNorm
from lib.scan import recurrence

__all__ = ["MambaBlock", "MambaLM", "refuse_padding", "state_bytes", "trace_states"]


_NO_PADDING = (
    "a model with Mamba layers takes no padding: attention_mask must be None or all ones "
    "(a padding token would enter the recurrent state); run rows separately"
)


def _make_norm(config: MambaConfig) -> nn.Module:
    if config.norm == "rms":
        return RMSNorm(config.d_model, eps=config.norm_eps)  # nn.RMSNorm, by a fused loop on a CPU
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


class MambaBlock(nn.Module):
    """A pre-norm residual block, as Mamba's `Block`: x + mixer(norm(x)). (B, T, C) -> (B, T, C);
    with `cache` (a MixerCache) the mixer continues from the state it holds and advances it."""

    def __init__(self, config: MambaConfig):
        super().__init__()
        self.norm = _make_norm(config)
        self.mixer = MambaMixer(config)

    def forward(self, x: torch.Tensor, *, cache: MixerCache | None = None, start: int = 0) -> torch.Tensor:
        return x + self.mixer(self.norm(x), cache=cache, start=start)


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

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def block_size(self) -> None:
        """No context limit: the state has one size at every position."""
        return None

    def new_caches(self, batch_size: int, max_len: int | None = None) -> list[MixerCache]:
        """One empty MixerCache per layer (zeros: the state before any token), on the model's device
        and dtype. `max_len` is accepted for the decoder protocol and ignored: the state does not grow."""
        require_int("batch_size", batch_size, minimum=1)
        if max_len is not None:
            require_int("max_len", max_len, minimum=1)
        w = self.embedding.weight
        return [layer.mixer.new_cache(batch_size, dtype=w.dtype, device=w.device) for layer in self.layers]

    def cache_bytes(self, batch: int, seq_len: int, dtype: torch.dtype | str | None = None) -> int:
        """Bytes of the layers' states, the same after any number of tokens (`state_bytes`)."""
        return state_bytes(self, batch, dtype)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (V, C), which the head shares (Hugging Face's name for it)."""
        return self.embedding

    @DECODER_FORWARD.plus(where={"attention_mask is None or bool((attention_mask == 1).all())": _NO_PADDING})
    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        caches: list[MixerCache] | None = None,
        start: int = 0,
    ):
        """idx (B, T) token ids -> logits (B, T, V), or (logits, loss) with targets (B, T).

        With `caches` (from `new_caches`), the tokens continue from the state the caches hold
        (positions start..start+T−1) and the caches are advanced: a prompt goes through the scan,
        a single token through one step of the recurrence. `attention_mask` may only be all ones:
        a padding token would enter the state.
        """
        B, T = idx.shape
        x = self.embedding(idx)  # (B, T, C)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache=None if caches is None else caches[i], start=start)
        logits = self.lm_head(self.norm_f(x))  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
        return logits, loss


def refuse_padding(attention_mask) -> None:
    """A model with Mamba layers takes no padding: `attention_mask` must be None or all ones."""
    if attention_mask is None:
        return
    if not (isinstance(attention_mask, torch.Tensor) and bool((attention_mask == 1).all())):
        raise ValueError(_NO_PADDING)


@torch.no_grad()
def trace_states(model: MambaLM, idx: torch.Tensor, layer: int = 0) -> dict[str, torch.Tensor]:
    """What layer `layer`'s SSM does on idx (B, T): its step sizes Δ (B, T, D) and every state h_t
    (B, T, D, N), D = d_inner, recomputed step by step from the SSM's own inputs (for drawing:
    widgets.SSMStateView), and those inputs: x (B, T, D), A (D, N), B and C (B, T, N) (for
    lib.ssd). The layer's output is checked against the recomputed states."""
    if not isinstance(model, MambaLM):
        raise TypeError(f"model must be a MambaLM, got {type(model).__name__}")
    require_int("layer", layer, minimum=0)
    if layer >= len(model.layers):
        raise ValueError(f"layer must be < n_layers = {len(model.layers)}, got {layer}")
    ssm = model.layers[layer].mixer.ssm
    seen = {}
    hook = ssm.register_forward_hook(
        lambda mod, args, kwargs, out: seen.update(x=args[0], z=kwargs.get("z"), y=out[0]), with_kwargs=True
    )
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
    states = torch.stack(list(recurrence(A_bar, Bx, torch.zeros_like(A_bar[:, 0]))), dim=1)  # (B, T, D, N)
    y = (states * C.unsqueeze(2)).sum(-1) + ssm.D * x  # (B, T, D)
    if seen["z"] is not None:
        y = y * F.silu(seen["z"].to(work))  # the mixer's gate, which the layer's scan applied
    # fp32: the layer's scan (chunked or not) and this step-by-step loop differ by rounding only
    if not torch.allclose(y, seen["y"].to(work), rtol=1e-4, atol=1e-5):
        raise RuntimeError("the recomputed states do not reproduce the layer's output")
    return {"delta": delta, "h": states, "x": x, "A": A, "B": B, "C": C}


def state_bytes(model_or_config: MambaLM | MambaConfig, batch: int, dtype: torch.dtype | str | None = None) -> int:
    """Bytes of a MambaLM's recurrent state for `batch` sequences, at any position:
    n_layers × B × d_inner × ((K − 1) + N) × bytes per element.

    `dtype` a torch.dtype or a name of lib.kv_cache.DTYPE_BYTES ("fp16"); by default the model's
    parameter dtype (what `new_caches` allocates), float32 for a config. For mamba-130m's shape
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
    return math.ceil(config.n_layers * state_elements(config, batch) * bpe)
