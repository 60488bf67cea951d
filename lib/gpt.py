"""GPT from scratch: the causal decoder, checkpoint-compatible with Hugging Face GPT-2.

Follows Radford et al. 2019 (GPT-2) and nanoGPT's `model.py`, parameter names as in
`transformers.GPT2LMHeadModel` (so a GPT-2 state dict loads by name):

    embeddings   x = wte(idx) + wpe(position)          learned absolute positions (GPT-2)
                 or x = wte(idx), with RoPE applied to q and k in every layer (lib.rope)
    each block   x = x + attn(ln_1(x))                  Pre-LN (GPT-2 normalises before)
                 x = x + mlp(ln_2(x))                   mlp = c_proj(GELU(c_fc(x)))
    attention    softmax(QKᵀ/√D + M)V with M causal: position t sees positions <= t only
    head         logits = ln_f(x) · wteᵀ                tied to the token embedding

Blocks take their attention and feed-forward as parts (`Block(config, attn=..., mlp=...)`, and
`GPT(config, make_block=...)`), so later lessons can put a Mixture-of-Experts feed-forward or a
state-space layer in the same skeleton.

Attention comes two ways, equal in output (lesson 03 asserts it):
    attention_backend="buffer"   the causal mask as a registered (T_max, T_max) lower-triangular
                                 buffer, applied with masked_fill (Hugging Face's GPT-2 port and
                                 nanoGPT do this; OpenAI's TensorFlow code built it on the fly)
    any lib.attention backend    ("auto" = SDPA with is_causal=True, "naive", "chunked", ...)

Also here: `forward_flops`; the next-token loss with its one-position shift is
`lib.train.clm_loss`, training `lib.train.train_lm`. A GPT is a `lib.decode.Decoder`: `new_caches` gives each layer
a KV cache (lib.kv_cache) and `forward` takes them, so `lib.decode.generate` samples from it
(greedy, temperature, top-k, top-p). Hugging Face stores GPT-2's projections as `Conv1D`, whose weight
is the transpose of `nn.Linear`'s; `load_checkpoint` transposes them.

Glossary: B batch, T tokens, C model width (n_embd), H heads, D = C / H head dim, L layers,
V vocabulary, T_max the context length (block_size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import require_int, require_state_dict_fits
from lib._door import DECODER_FORWARD
from lib.attention import BACKENDS, attention, safe_softmax
from lib.kv_cache import KVCache, dtype_bytes, kv_cache_bytes
from lib.masks import padding_mask
from lib.rope import apply_rope, rope_cos_sin

__all__ = ["Block", "CausalSelfAttention", "GPT", "GPTConfig", "MLP", "forward_flops"]

POSITIONS = ("learned", "rope")
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}  # HF name -> F.gelu approximate


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # V
    block_size: int = 1024  # T_max, the context (HF: n_positions)
    n_layer: int = 12  # L
    n_head: int = 12  # H
    n_embd: int = 768  # C
    dropout: float = 0.0  # on embeddings and residual branches (training only)
    bias: bool = True
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"  # GPT-2's tanh approximation of GELU
    positions: str = "learned"  # "learned" (GPT-2) or "rope" (rotary, lib.rope)
    rope_base: float = 10000.0
    attention_backend: str = "auto"  # "buffer", or a lib.attention backend
    causal: bool = True  # False removes the mask: only for lesson 03's leak demonstration

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            require_int(name, getattr(self, name), minimum=1)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.positions == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"RoPE rotates pairs of dimensions: the head dim n_embd / n_head = "
                f"{self.n_embd // self.n_head} must be even"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")
        if self.attention_backend not in ("buffer", "auto", *BACKENDS):
            raise ValueError(
                f"attention_backend must be 'buffer', 'auto' or one of {sorted(BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def tiny(cls, vocab_size: int = 64, **changes) -> "GPTConfig":
        """A GPT small enough to train in well under a minute on a laptop CPU."""
        base = dict(vocab_size=vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=128)
        base.update(changes)
        return cls(**base)

    @classmethod
    def decode_bench(cls, **changes) -> "GPTConfig":
        """The small decoder lesson 04 and `python -m lib.course.bench.kv_cache` time: 4 layers, width 256,
        a 512-position context (room for a prompt and 256 new tokens)."""
        base = dict(vocab_size=64, block_size=512, n_layer=4, n_head=4, n_embd=256)
        base.update(changes)
        return cls(**base)

    @classmethod
    def from_huggingface(cls, hf_config) -> "GPTConfig":
        """The fields of a `transformers.GPT2Config` (or its dict) that GPT-2 checkpoints use."""
        d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        act = d.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise ValueError(f"activation_function must be one of {sorted(ACTIVATIONS)}, got {act!r}")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if d.get(flag):
                raise ValueError(f"{flag}=True is not implemented here")
        if not d.get("scale_attn_weights", True):
            raise ValueError("scale_attn_weights=False (scores not divided by √D) is not implemented here")
        if d.get("n_inner") not in (None, 4 * d["n_embd"]):
            raise ValueError(f"only n_inner = 4 * n_embd is implemented, got {d['n_inner']}")
        return cls(
            vocab_size=d["vocab_size"],
            block_size=d["n_positions"],
            n_layer=d["n_layer"],
            n_head=d["n_head"],
            n_embd=d["n_embd"],
            layer_norm_eps=d.get("layer_norm_epsilon", 1e-5),
            activation=act,
            dropout=0.0,
        )


# --------------------------------------------------------------------------- parts
class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with the causal mask; reads and extends a KV cache if given."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.backend, self.causal = config.attention_backend, config.causal
        self.c_attn = nn.Linear(C, 3 * C, bias=config.bias)  # q, k, v for all heads in one matmul
        self.c_proj = nn.Linear(C, C, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        if self.backend == "buffer":
            # 1 where query row t may see key column s (s <= t). A buffer so it moves with .to(),
            # non-persistent so it stays out of the state dict (GPT-2 checkpoints differ on it).
            tril = torch.tril(torch.ones(config.block_size, config.block_size))
            self.register_buffer("bias", tril.view(1, 1, config.block_size, config.block_size), persistent=False)

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype, device) -> KVCache:
        """An empty KV cache for this layer: keys and values for max_len positions."""
        if not self.causal:
            raise ValueError(
                "caches need a causal model: without the mask, earlier positions' keys would change "
                "with every new token, so cached ones are stale (generate: pass use_cache=False)"
            )
        return KVCache(batch_size, self.n_head, max_len, self.head_dim, dtype=dtype, device=device)

    def cache_bytes(self, batch: int, seq_len: int, dtype: torch.dtype | str) -> int:
        """Bytes of this layer's KV cache after seq_len tokens: 2 · B · S · H · D · bytes."""
        return kv_cache_bytes(1, batch, seq_len, self.n_head, self.head_dim, dtype_bytes(dtype))

    def forward(
        self,
        x: torch.Tensor,
        *,
        cache: KVCache | None = None,
        start: int = 0,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, C) at positions start..start+T-1; `mask` an additive (B, 1, 1, S) padding mask
        over every key so far (S = start + T), or None."""
        B, T, C = x.size()
        H, D = self.n_head, self.head_dim
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)
        k = k.view(B, T, H, D).transpose(1, 2)
        v = v.view(B, T, H, D).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # rotate by absolute position start + t
        if cache is not None:
            k, v = cache.update(start, k, v)  # (B, H, S, D), S = start + T: every position so far
        if self.backend == "buffer":
            S = k.size(2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))  # (B, H, T, S)
            if self.causal:  # rows S-T..S-1 of the mask: the queries are the last T positions
                att = att.masked_fill(self.bias[:, :, S - T : S, :S] == 0, float("-inf"))
            if mask is not None:
                att = att + mask  # (B, H, T, S) + (B, 1, 1, S): padding keys get −inf
            # a left-padding query sees only padding keys: a row of −inf, zeros instead of NaN
            y = safe_softmax(att, dim=-1) @ v  # (B, H, T, S) @ (B, H, S, D) -> (B, H, T, D)
        else:
            y = attention(q, k, v, mask=mask, causal=self.causal, backend=self.backend)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, H, T, D) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward: C -> 4C -> GELU -> C."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.approximate = ACTIVATIONS[config.activation]
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class Block(nn.Module):
    """A Pre-LN decoder block. `attn` and `mlp` default to CausalSelfAttention and MLP; any
    module with the same call signature fits (an MoE feed-forward, a state-space mixer)."""

    def __init__(self, config: GPTConfig, attn: nn.Module | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = attn if attn is not None else CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = mlp if mlp is not None else MLP(config)
        # the parts it was given: they keep the initialisation they came with (GPT's init skips them)
        self.injected = tuple(name for name, part in (("attn", attn), ("mlp", mlp)) if part is not None)

    def forward(
        self,
        x: torch.Tensor,
        *,
        cache: KVCache | None = None,
        start: int = 0,
        rope=None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache=cache, start=start, rope=rope, mask=mask)
        return x + self.mlp(self.ln_2(x))


# --------------------------------------------------------------------------- the model
class GPT(nn.Module):
    """The decoder. `forward(idx)` returns logits (B, T, V); `forward(idx, targets)` returns
    (logits, loss), where targets[b, t] is the token that follows idx[b, t] (−100 = ignore)."""

    def __init__(self, config: GPTConfig, make_block: Callable[[GPTConfig, int], nn.Module] | None = None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        C = config.n_embd
        parts = dict(wte=nn.Embedding(config.vocab_size, C))
        if config.positions == "learned":
            parts["wpe"] = nn.Embedding(config.block_size, C)
        make_block = make_block or (lambda cfg, i: Block(cfg))
        parts.update(
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([make_block(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(C, eps=config.layer_norm_eps, bias=config.bias),
        )
        self.transformer = nn.ModuleDict(parts)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one (V, C) matrix reads and writes tokens
        if config.positions == "rope":
            cos, sin = rope_cos_sin(config.block_size, config.head_dim, base=config.rope_base)  # (T_max, D) each
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        # GPT-2's init, on what this class built: normal(0, 0.02) weights and zero biases, then each
        # residual branch's output projection at std 0.02 / sqrt(2L), so the residual stream's
        # variance does not grow with depth. Parts a `make_block` injected (an MoE, a Mamba mixer)
        # keep their own init.
        injected = [
            part
            for block in self.transformer.h
            for part in ([getattr(block, n) for n in block.injected] if isinstance(block, Block) else [block])
        ]
        skip_modules = {id(m) for part in injected for m in part.modules()}
        skip_params = {id(p) for part in injected for p in part.parameters()}
        self.apply(lambda m: None if id(m) in skip_modules else self._init_weights(m))
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") and id(p) not in skip_params:
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self, include_positions: bool = True) -> int:
        """Distinct parameters (the tied head counted once)."""
        n = sum(p.numel() for p in self.parameters())
        if not include_positions and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def block_size(self) -> int:
        """The context limit: positions 0..block_size − 1."""
        return self.config.block_size

    def new_caches(self, batch_size: int, max_len: int | None = None) -> list:
        """One empty cache per layer, made by the layer's attention part (a KVCache with room for
        max_len positions, default block_size; a Mamba mixer's fixed-size state), on the model's
        device and dtype. What `forward(idx, caches=..., start=...)` reads and extends."""
        max_len = self.config.block_size if max_len is None else max_len
        require_int("batch_size", batch_size, minimum=1)
        require_int("max_len", max_len, minimum=1)
        if max_len > self.config.block_size:
            raise ValueError(f"max_len must be <= block_size={self.config.block_size}, got {max_len}")
        w = self.transformer.wte.weight
        return [
            block.attn.new_cache(batch_size, max_len, dtype=w.dtype, device=w.device) for block in self.transformer.h
        ]

    def cache_bytes(self, batch: int, seq_len: int, dtype: torch.dtype | str | None = None) -> int:
        """Bytes of those caches after seq_len tokens, each layer counting its own (a KV cache
        2 · B · S · H · D · bytes, lib.kv_cache.kv_cache_bytes); by default in the model's dtype,
        what `new_caches` allocates."""
        dtype = self.transformer.wte.weight.dtype if dtype is None else dtype
        return sum(block.attn.cache_bytes(batch, seq_len, dtype) for block in self.transformer.h)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (V, C), which the head shares (Hugging Face's name for it)."""
        return self.transformer.wte

    @DECODER_FORWARD
    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
        start: int = 0,
    ):
        """idx (B, T) token ids at positions start..start+T-1. With `caches` (from `new_caches`),
        earlier positions' keys and values come from the caches and these are appended.

        `attention_mask` (B, start + T) of 1 (token) / 0 (padding) covers every position so far,
        cached ones included, and must be left-padded (a row's zeros all come before its ones), so
        that new tokens are appended right after each prompt. Padding keys are masked; each row's
        positions count its real tokens only, so a padded prompt gets the positions it would have
        alone. (With RoPE the shared positions are kept: a score depends only on the offset between
        two positions, which the padding shifts equally.)
        """
        B, T = idx.shape
        mask = None
        pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        if attention_mask is not None:
            keep = attention_mask.bool()  # (B, S): True at real tokens
            mask = padding_mask(keep, dtype=self.transformer.wte.weight.dtype)  # (B, 1, 1, S)
            # each row's position = how many real tokens precede it (0 on and before its first token)
            pos = (keep.long().cumsum(dim=1) - 1).clamp(min=0)[:, start : start + T]  # (B, T)
        x = self.transformer.wte(idx)  # (B, T, C)
        rope = None
        if self.config.positions == "learned":
            x = x + self.transformer.wpe(pos)  # (T, C) or (B, T, C), broadcast over B
        else:
            rope = (self.rope_cos[start : start + T], self.rope_sin[start : start + T])  # (T, D) each
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache=None if caches is None else caches[i], start=start, rope=rope, mask=mask)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
        return logits, loss

    # ----------------------------------------------------------------------- loading
    CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

    def load_checkpoint(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face GPT2LMHeadModel (or GPT2Model) state dict. Its Conv1D weights are
        stored (in, out) and are transposed to nn.Linear's (out, in). Any misfit raises a
        ValueError listing missing keys, unexpected keys and shape mismatches."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
        theirs = {}
        for key, value in state_dict.items():
            key = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
            if key.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # old checkpoints store the causal mask itself; ours is rebuilt
            theirs[key] = value.t() if key.endswith(self.CONV1D) else value
        if "transformer.wte.weight" in theirs:
            theirs.setdefault("lm_head.weight", theirs["transformer.wte.weight"])
        require_state_dict_fits(self.state_dict(), theirs, "GPTConfig")
        if not torch.equal(theirs["lm_head.weight"].cpu(), theirs["transformer.wte.weight"].cpu()):
            raise ValueError("lm_head.weight differs from transformer.wte.weight: this GPT ties them")
        self.load_state_dict(theirs, strict=True)

    @classmethod
    def from_huggingface(cls, model, **changes) -> "GPT":
        """A `GPT` with the config and weights of a `transformers.GPT2LMHeadModel`, in eval mode,
        on the model's device and in its dtype. `changes` override config fields that don't touch
        the weights (e.g. attention_backend)."""
        if not hasattr(model, "config") or not hasattr(model, "state_dict"):
            raise TypeError(f"model must be a transformers.GPT2LMHeadModel, got {type(model).__name__}")
        config = GPTConfig.from_huggingface(model.config)
        for name, value in changes.items():
            if name not in {f.name for f in fields(GPTConfig)}:
                raise TypeError(f"unknown GPTConfig field {name!r}")
            setattr(config, name, value)
        config.__post_init__()
        weight = next(model.parameters())
        gpt = cls(config)
        gpt.load_checkpoint({k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()})
        return gpt.to(device=weight.device, dtype=weight.dtype).eval()


# --------------------------------------------------------------------------- cost
def forward_flops(config: GPTConfig, new_tokens: int, total_tokens: int | None = None) -> int:
    """FLOPs (2 per multiply-add) of one forward over `new_tokens` positions whose keys reach back
    to `total_tokens` positions in all (= new_tokens without a cache; the cache length with one).

    Per layer and new token: the four projections 2·(3C² + C² + 4C² + 4C²) = 24C², and attention
    QKᵀ and AV over all S keys, 4·S·C (dense: the masked half of a causal T×T square is counted,
    as the reference path computes it). Plus the output head, 2·C·V per token. LayerNorms,
    softmax and GELU are O(T·C) and left out.
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    require_int("new_tokens", new_tokens, minimum=1)
    S = new_tokens if total_tokens is None else total_tokens
    require_int("total_tokens", S, minimum=new_tokens)
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    return new_tokens * (L * (24 * C * C + 4 * S * C) + 2 * C * V)
