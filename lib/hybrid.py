"""A hybrid decoder: mostly Mamba layers, with attention where in-context retrieval needs it.

    HybridGPT(config, pattern="MMA", mamba=None)   a lib.gpt.GPT whose layer i is an attention
                                                    block ("A") or a Mamba-mixer block ("M"), each
                                                    with its MLP (Jamba's layout, Lieber et al. 2024)
    HybridGPT.new_caches(B, max_len)                a KVCache for every "A" layer, a MixerCache for
                                                    every "M" layer: lib.gpt.generate works unchanged
    decode_state_bytes(model, batch, seq_len)       the bytes any course decoder (GPT, MoE GPT, Mamba,
                                                    hybrid) carries while decoding after seq_len tokens

The attention layers keep keys and values for every position read (they grow with the context);
the Mamba layers keep a fixed-size state. A hybrid pays the KV cost only for its few "A" layers.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lib._checks import require_int
from lib.gpt import GPT, Block, GPTConfig
from lib.kv_cache import KVCache, dtype_bytes, kv_cache_bytes
from lib.mamba import MambaConfig, MambaLM, MambaMixer, MixerCache, state_bytes

__all__ = ["HybridGPT", "decode_state_bytes"]

LAYER_KINDS = {"A": "attention", "M": "Mamba mixer"}


class HybridGPT(GPT):
    """A GPT whose blocks are attention ("A") or Mamba-mixer ("M") blocks, as `pattern` says.

    config: the GPTConfig (width, heads, positions, vocabulary; n_layer must equal len(pattern)).
    mamba: the mixers' MambaConfig (d_state, d_conv, expand, ...); None takes Mamba's defaults at
    the config's width. Its d_model must equal config.n_embd. Every block is pre-LN with its MLP.
    RoPE or learned positions reach only the attention layers; a mixer reads order from its
    recurrence. Padding masks are refused: a padding token would enter the Mamba state.
    """

    def __init__(self, config: GPTConfig, pattern: str = "MMA", mamba: MambaConfig | None = None):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a lib.gpt.GPTConfig, got {type(config).__name__}")
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(LAYER_KINDS):
            raise ValueError(f"pattern must be a non-empty string of {sorted(LAYER_KINDS)} (one letter per layer: "
                             f"A = attention, M = Mamba mixer), got {pattern!r}")
        if len(pattern) != config.n_layer:
            raise ValueError(f"pattern has {len(pattern)} layers but config.n_layer = {config.n_layer}; they must agree")
        if mamba is None:
            mamba = MambaConfig(vocab_size=config.vocab_size, d_model=config.n_embd, n_layers=pattern.count("M") or 1)
        if not isinstance(mamba, MambaConfig):
            raise TypeError(f"mamba must be a lib.mamba.MambaConfig or None, got {type(mamba).__name__}")
        if mamba.d_model != config.n_embd:
            raise ValueError(f"mamba.d_model ({mamba.d_model}) must equal config.n_embd ({config.n_embd})")
        self.pattern, self.mamba_config = pattern, mamba

        def make_block(cfg: GPTConfig, i: int) -> Block:
            return Block(cfg, attn=MambaMixer(mamba)) if pattern[i] == "M" else Block(cfg)

        super().__init__(config, make_block=make_block)
        # GPT's init (normal 0.02 weights, zero biases) just overwrote the mixers' own: Mamba's Δ
        # bias (dt_proj, softplus⁻¹ of a log-uniform step) and A_log. Fresh mixers get them back.
        for kind, block in zip(pattern, self.transformer.h):
            if kind == "M":
                block.attn = MambaMixer(mamba)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                attention_mask: torch.Tensor | None = None, caches=None, start: int = 0):
        """As `lib.gpt.GPT.forward`; `attention_mask` may only be all ones (no padding)."""
        if attention_mask is not None:
            if not (isinstance(attention_mask, torch.Tensor) and bool((attention_mask == 1).all())):
                raise ValueError("a hybrid with Mamba layers takes no padding: attention_mask must be None or all "
                                 "ones (a padding token would enter the recurrent state); run rows separately")
            attention_mask = None
        return super().forward(idx, targets, caches=caches, start=start)

    def new_caches(self, batch_size: int, max_len: int | None = None) -> list:
        """Per layer: a KVCache (B, H, max_len, D) for "A", a MixerCache (fixed size) for "M"."""
        max_len = self.config.block_size if max_len is None else max_len
        require_int("batch_size", batch_size, minimum=1)
        require_int("max_len", max_len, minimum=1)
        if max_len > self.config.block_size:
            raise ValueError(f"max_len must be <= block_size={self.config.block_size}, got {max_len}")
        w = self.transformer.wte.weight
        m = self.mamba_config
        return [KVCache(batch_size, self.config.n_head, max_len, self.config.head_dim, dtype=w.dtype, device=w.device)
                if kind == "A" else
                MixerCache(batch_size, m.d_inner, m.d_conv, m.d_state, dtype=w.dtype, device=w.device)
                for kind in self.pattern]

    def extra_repr(self) -> str:
        return f"pattern={self.pattern!r} ({', '.join(LAYER_KINDS[k] for k in self.pattern)})"


def decode_state_bytes(model, batch: int, seq_len: int, dtype: torch.dtype | str | None = None) -> int:
    """Bytes a decoder carries between tokens after reading seq_len tokens, for batch sequences:

    - GPT (dense or MoE): the KV cache, 2 · L · B · S · H · D · bytes (lib.kv_cache.kv_cache_bytes);
    - MambaLM: the recurrent state, L · B · E · (K − 1 + N) · bytes (lib.mamba.state_bytes), any S;
    - HybridGPT: the KV cache of its "A" layers plus the state of its "M" layers.

    Exactly the bytes of the tensors `new_caches(batch, seq_len)` / `new_state(batch)` allocate;
    `dtype` defaults to the model's parameter dtype (what they allocate).
    """
    require_int("batch", batch, minimum=1)
    require_int("seq_len", seq_len, minimum=1)
    if dtype is None and isinstance(model, torch.nn.Module):
        dtype = next(model.parameters()).dtype
    bpe = dtype_bytes(dtype if dtype is not None else torch.float32)
    if isinstance(model, MambaLM):
        return state_bytes(model, batch, dtype)
    if isinstance(model, HybridGPT):
        c, n_attn, n_mamba = model.config, model.pattern.count("A"), model.pattern.count("M")
        kv = kv_cache_bytes(n_attn, batch, seq_len, c.n_head, c.head_dim, bpe) if n_attn else 0
        # the state of its "M" layers: a Mamba of that many layers (state_bytes' formula, not a copy)
        return kv + (state_bytes(replace(model.mamba_config, n_layers=n_mamba), batch, dtype) if n_mamba else 0)
    if isinstance(model, GPT):
        c = model.config
        return kv_cache_bytes(c.n_layer, batch, seq_len, c.n_head, c.head_dim, bpe)
    raise TypeError(f"model must be a lib.gpt.GPT (or MoE GPT), a lib.hybrid.HybridGPT or a lib.mamba.MambaLM, "
                    f"got {type(model).__name__}")
