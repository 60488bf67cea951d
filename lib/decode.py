"""Decoding: one protocol every course decoder follows, one `generate` that drives them all.

A decoder (lib.gpt.GPT, lib.llama.Llama, lib.moe_lm.moe_gpt's GPT, lib.mamba_lm.MambaLM,
lib.hybrid.HybridGPT) is an nn.Module with

    vocab_size, block_size                  the vocabulary; the context limit (None: no limit, a
                                            recurrent model)
    new_caches(batch_size, max_len=None)    one empty cache per layer, on the model's device and
                                            dtype: a lib.kv_cache.KVCache for attention (it grows
                                            to max_len positions), a lib.mamba.MixerCache for a
                                            Mamba mixer (a fixed-size state). Each has `nbytes`.
    cache_bytes(batch, seq_len, dtype=None) the bytes those caches hold after seq_len tokens
    forward(idx, caches=None, start=0, attention_mask=None)
                                            idx (B, T) at positions start..start+T−1 -> logits
                                            (B, T, V); with caches, earlier positions come from
                                            them and these are added

as Hugging Face's models take `past_key_values` and mamba_ssm's take `inference_params`. The
loop below knows nothing else about the model: prefill the prompt into fresh caches, then feed
each new token alone.

    generate(model, idx, max_new_tokens, ...)      greedy, temperature, top-k, top-p; with or without
                                                   the caches; left-padded batches
    decode_state_bytes(model, batch, seq_len)      what a decoder carries between tokens
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch
import torch.nn as nn

from lib._checks import caller_code, inputs_checked
from lib._door import door
from lib.sampling import SAMPLING_KNOBS, sample_next_token

__all__ = ["Decoder", "decode_state_bytes", "generate"]


@runtime_checkable
class Decoder(Protocol):
    """What `generate` and `decode_state_bytes` need from a model (see the module docstring)."""

    vocab_size: int
    block_size: int | None

    def new_caches(self, batch_size: int, max_len: int | None = None) -> list: ...

    def cache_bytes(self, batch: int, seq_len: int, dtype: torch.dtype | str | None = None) -> int: ...


def _require_decoder(name: str, model) -> None:
    if not (isinstance(model, nn.Module) and isinstance(model, Decoder)):
        raise TypeError(
            f"{name} must be a decoder (an nn.Module with vocab_size, block_size, new_caches and "
            "cache_bytes, whose forward takes caches and start): lib.gpt.GPT, lib.llama.Llama, lib.moe_lm.moe_gpt, "
            f"lib.mamba_lm.MambaLM or lib.hybrid.HybridGPT; got {type(model).__name__}"
        )


def _require_callback(name: str, fn) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be callable (step, tokens) -> None, got {type(fn).__name__}")


# generate's door: the sampling knobs, a decoder, prompts that fit its vocabulary and its context.
_GENERATE = SAMPLING_KNOBS.plus(
    model=_require_decoder,
    idx="ids (B, T) < model.vocab_size",
    max_new_tokens="int >= 0",
    use_cache="bool",
    attention_mask="padding (B, T) | None",
    on_token=_require_callback,
    where={
        "model.block_size is None or T + max_new_tokens <= model.block_size": "idx has T={T} tokens; with "
        "max_new_tokens={max_new_tokens} that passes the context block_size={model.block_size}",
        "generator is None or generator.device.type == idx.device.type": "generator must be on idx's device "
        "({idx.device}), got a {generator.device} generator",
    },
)


@torch.no_grad()
@_GENERATE
def generate(
    model: Decoder,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    on_token: Callable[[int, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Extend idx (B, T) by `max_new_tokens` sampled tokens -> (B, T + max_new_tokens).

    temperature 0 is greedy (argmax). With `use_cache`, the prompt is run once (prefill) and each
    new token alone (decode) against the model's per-layer caches, built fresh for this call;
    without it, the whole sequence is run again for every token. Both compute the same logits;
    the cache does less work. Sampling draws from `generator` only, so a seeded generator
    reproduces the tokens. Prompts of different lengths go in one batch left-padded, with
    `attention_mask` (B, T) of 1/0: each row then continues exactly as its prompt would alone.
    `on_token(step, tokens)` is called as each new (B,) column of tokens is chosen (a progress
    bar, a timer).
    """
    B, T = idx.shape
    mask = None if attention_mask is None else attention_mask.long()  # (B, T) of 1 = token, 0 = padding
    was_training = model.training
    model.eval()
    out = [idx]
    caches = model.new_caches(B, T + max_new_tokens) if use_cache else None
    logits = model(idx, caches=caches, attention_mask=mask)[:, -1]  # (B, V): prefill; the last position predicts
    with inputs_checked():  # checked at the door: no value scans (no GPU host syncs) per token
        for step in range(max_new_tokens):
            nxt = sample_next_token(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
            )  # (B,)
            out.append(nxt[:, None].to(idx.dtype))
            if on_token is not None:
                with caller_code():  # the callback is the caller's code: what it passes to lib is checked
                    on_token(step, nxt)
            if step == max_new_tokens - 1:
                break
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (B, S + 1): the new token is real
            if use_cache:
                logits = model(out[-1], caches=caches, start=T + step, attention_mask=mask)[:, -1]  # decode: 1 token
            else:
                logits = model(torch.cat(out, dim=1), attention_mask=mask)[:, -1]  # recompute the whole prefix
    model.train(was_training)
    return torch.cat(out, dim=1)


@door(model=_require_decoder, batch="int >= 1", seq_len="int >= 1")
def decode_state_bytes(model: Decoder, batch: int, seq_len: int, dtype: torch.dtype | str | None = None) -> int:
    """Bytes a decoder carries between tokens after reading seq_len tokens, for batch sequences:

    - attention layers (GPT, MoE GPT, a hybrid's "A"): the KV cache, 2 · B · S · H · D · bytes
      each (lib.kv_cache.kv_cache_bytes), growing with S;
    - Mamba layers (MambaLM, a hybrid's "M"): the recurrent state, B · E · (K − 1 + N) · bytes
      each (lib.mamba_lm.state_bytes), the same at every S.

    Exactly the bytes of the tensors `model.new_caches(batch, seq_len)` allocates (the tests
    check it); `dtype` (a torch.dtype or a name of lib.kv_cache.DTYPE_BYTES, "fp16") defaults to
    the model's parameter dtype, what they allocate. seq_len may pass the model's block_size:
    the answer is then what the same layers would carry with a longer context.
    """
    return model.cache_bytes(batch, seq_len, dtype)
