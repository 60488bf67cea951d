"""A hybrid decoder: mostly Mamba layers, with attention where in-context retrieval needs it.

    HybridGPT(config, pattern="MMA", mamba=None)   a lib.gpt.GPT whose layer i is an attention
                                                    block ("A") or a Mamba-mixer block ("M"), each
                                                    with its MLP (Jamba's layout, Lieber et al. 2024)

Each layer makes its own cache (`new_caches`): a KVCache for an "A" layer, a MixerCache for an
"M" layer, and counts its own bytes (`cache_bytes`), so lib.decode.generate and
lib.decode.decode_state_bytes work unchanged.

The attention layers keep keys and values for every position read (they grow with the context);
the Mamba layers keep a fixed-size state. A hybrid pays the KV cost only for its few "A" layers.
"""

from __future__ import annotations

import torch

from lib.gpt import GPT, Block, GPTConfig
from lib.mamba import MambaConfig, MambaMixer
from lib.mamba_lm import refuse_padding

__all__ = ["HybridGPT"]

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
        mamba = _check_plan(config, pattern, mamba)  # None -> Mamba's defaults at the config's width
        self.pattern, self.mamba_config = pattern, mamba

        def make_block(cfg: GPTConfig, i: int) -> Block:  # layer i of the plan, pre-LN, with its MLP
            return Block(cfg, attn=MambaMixer(mamba)) if pattern[i] == "M" else Block(cfg)

        super().__init__(config, make_block=make_block)  # the mixers keep Mamba's own init (Δ bias, A_log)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        caches=None,
        start: int = 0,
    ):
        """As `lib.gpt.GPT.forward`; `attention_mask` may only be all ones (no padding)."""
        refuse_padding(attention_mask)
        return super().forward(idx, targets, caches=caches, start=start)

    def extra_repr(self) -> str:
        return f"pattern={self.pattern!r} ({', '.join(LAYER_KINDS[k] for k in self.pattern)})"


def _check_plan(config, pattern, mamba) -> MambaConfig:
    """HybridGPT's arguments checked; returns the mixers' MambaConfig (Mamba's defaults if None)."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a lib.gpt.GPTConfig, got {type(config).__name__}")
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(LAYER_KINDS):
        raise ValueError(
            f"pattern must be a non-empty string of {sorted(LAYER_KINDS)} (one letter per layer: "
            f"A = attention, M = Mamba mixer), got {pattern!r}"
        )
    if len(pattern) != config.n_layer:
        raise ValueError(f"pattern has {len(pattern)} layers but config.n_layer = {config.n_layer}; they must agree")
    if mamba is None:
        mamba = MambaConfig(vocab_size=config.vocab_size, d_model=config.n_embd, n_layers=pattern.count("M") or 1)
    if not isinstance(mamba, MambaConfig):
        raise TypeError(f"mamba must be a lib.mamba.MambaConfig or None, got {type(mamba).__name__}")
    if mamba.d_model != config.n_embd:
        raise ValueError(f"mamba.d_model ({mamba.d_model}) must equal config.n_embd ({config.n_embd})")
    return mamba
