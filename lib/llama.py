"""Llama: the decoder most open models share, built from lib's parts; SmolLM2-135M loads into it.

Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models" (arXiv 2302.13971),
section 2.2, changed GPT-2's block in three places, and grouped-query attention (Ainslie et al.
2023, arXiv 2305.13245) came with Llama 2. Parameter names are those of Hugging Face's
`transformers.LlamaForCausalLM`, so its state dict loads by name:

    embeddings   x = embed_tokens(idx)                 no position table: RoPE rotates q and k
    each block   x = x + o_proj(attn(input_layernorm(x)))            Pre-norm, as GPT-2
                 x = x + mlp(post_attention_layernorm(x))
    norm         RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x²) + eps) ⊙ w, no mean, no bias
                 (torch.nn.RMSNorm, lib.norms' reference; its fused C loop sums in a plain fp32
                 loop, which through 30 layers doubles the rounding error against fp64)
    attention    softmax(QKᵀ/√D + M)V, M causal (lib.attention), q and k rotated by their
                 absolute positions (lib.rope, Su et al. 2021); H query heads share H_kv key/value
                 heads, H / H_kv each: the KV cache shrinks by that factor
    mlp          SwiGLU (Shazeer 2020, arXiv 2002.05202): down(silu(gate(x)) * up(x))
    head         logits = norm(x) · Wᵀ, W the token embedding (tied) or its own lm_head

A `Llama` is a `lib.decode.Decoder`: `new_caches` gives each layer a `lib.kv_cache.KVCache` of
H_kv heads, and `forward(idx, caches=, start=, attention_mask=)` reads and extends them, so
`lib.decode.generate` drives it as it drives lib.gpt.GPT. The real checkpoint (SmolLM2-135M, from
a GGUF file) is loaded by `lib.smollm2`.

Glossary: B batch, T tokens, C model width (hidden_size), H query heads, H_kv key/value heads,
D = C / H head dim, F the MLP's hidden width, L layers, V vocabulary, T_max the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import (
    require_int,
    require_state_dict_fits,
)
from lib._door import DECODER_FORWARD
from lib.attention import BACKENDS, attention, attention_weights
from lib.kernels.matvec import column_major, is_column_major, linear
from lib.kv_cache import KVCache, dtype_bytes, kv_cache_bytes
from lib.masks import padding_mask
from lib.rope import LAYOUTS, apply_rope, rope_cos_sin

__all__ = ["GroupedQueryAttention", "Linear", "Llama", "LlamaBlock", "LlamaConfig", "SwiGLU"]


@dataclass
class LlamaConfig:
    vocab_size: int = 49152  # V
    block_size: int = 8192  # T_max (HF: max_position_embeddings)
    n_layer: int = 30  # L
    n_head: int = 9  # H, query heads
    n_kv_head: int = 3  # H_kv, key/value heads; H_kv = H is plain multi-head attention
    n_embd: int = 576  # C
    intermediate_size: int = 1536  # F, the SwiGLU hidden width
    rms_norm_eps: float = 1e-5
    rope_base: float = 100000.0
    rope_layout: str = "half"  # HF's rotate-half pairs; "interleaved" reads llama.cpp's row order
    tie_word_embeddings: bool = True
    attention_backend: str = "auto"  # a lib.attention backend

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size"):
            require_int(name, getattr(self, name), minimum=1)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}): "
                "each key/value head serves n_head / n_kv_head query heads"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"RoPE rotates pairs of dimensions: the head dim n_embd / n_head = {self.head_dim} must be even"
            )
        if self.rope_layout not in LAYOUTS:
            raise ValueError(f"rope_layout must be one of {LAYOUTS}, got {self.rope_layout!r}")
        if self.attention_backend not in ("auto", *BACKENDS):
            raise ValueError(
                f"attention_backend must be 'auto' or one of {sorted(BACKENDS)}, got {self.attention_backend!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def smollm2_135m(cls, **changes) -> "LlamaConfig":
        """SmolLM2-135M's shape (the defaults): 30 layers, width 576, 9 query and 3 KV heads."""
        return cls(**changes)

    @classmethod
    def tiny(cls, vocab_size: int = 64, **changes) -> "LlamaConfig":
        """A Llama small enough for tests: 2 layers, 4 query heads sharing 2 KV heads."""
        base = dict(
            vocab_size=vocab_size,
            block_size=64,
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            n_embd=32,
            intermediate_size=48,
            rope_base=10000.0,
        )
        base.update(changes)
        return cls(**base)

    @classmethod
    def from_huggingface(cls, hf_config) -> "LlamaConfig":
        """The fields of a `transformers.LlamaConfig` (or its dict) that plain Llama checkpoints use;
        anything this module does not implement (biases, RoPE scaling, another head dim) is refused."""
        d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only hidden_act='silu' (SwiGLU) is implemented, got {d['hidden_act']!r}")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ValueError(f"{flag}=True is not implemented here")
        scaling = d.get("rope_scaling") or {}
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"rope_scaling {scaling} is not implemented here (plain RoPE only)")
        base = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if head_dim * heads != d["hidden_size"]:
            raise ValueError(
                f"head_dim={head_dim} with {heads} heads is not hidden_size={d['hidden_size']}: "
                "only head_dim = hidden_size / num_attention_heads is implemented"
            )
        return cls(
            vocab_size=d["vocab_size"],
            block_size=d["max_position_embeddings"],
            n_layer=d["num_hidden_layers"],
            n_head=heads,
            n_kv_head=d.get("num_key_value_heads") or heads,
            n_embd=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_base=float(base),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )


# --------------------------------------------------------------------------- parts
class Linear(nn.Linear):
    """nn.Linear, computed by lib.kernels.matvec.linear: the same x·Wᵀ, split over the CPU's threads
    for a decode step when the weight is stored column by column (`Llama.store_by_columns`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class GroupedQueryAttention(nn.Module):
    """Causal self-attention whose H query heads share H_kv key/value heads; reads and extends a
    KV cache of H_kv heads if given."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, D = config.n_embd, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, D
        self.backend, self.rope_layout = config.attention_backend, config.rope_layout
        self.q_proj = Linear(C, config.n_head * D, bias=False)
        self.k_proj = Linear(C, config.n_kv_head * D, bias=False)  # H_kv heads: H / H_kv times fewer
        self.v_proj = Linear(C, config.n_kv_head * D, bias=False)
        self.o_proj = Linear(config.n_head * D, C, bias=False)

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype, device) -> KVCache:
        """An empty KV cache for this layer: H_kv heads of keys and values for max_len positions."""
        return KVCache(batch_size, self.n_kv_head, max_len, self.head_dim, dtype=dtype, device=device)

    def cache_bytes(self, batch: int, seq_len: int, dtype: torch.dtype | str) -> int:
        """Bytes of this layer's KV cache after seq_len tokens: 2 · B · S · H_kv · D · bytes."""
        return kv_cache_bytes(1, batch, seq_len, self.n_kv_head, self.head_dim, dtype_bytes(dtype))

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x (B, T, C) -> q (B, H, T, D), k and v (B, H_kv, T, D); q and k rotated to their positions
        (rope: the (T, D) cos and sin tables of those positions)."""
        B, T, C = x.size()
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, T, H·D) -> (B, H, T, D)
        k = self.k_proj(x).view(B, T, H_kv, D).transpose(1, 2)  # (B, T, H_kv·D) -> (B, H_kv, T, D)
        v = self.v_proj(x).view(B, T, H_kv, D).transpose(1, 2)
        q = apply_rope(q, *rope, layout=self.rope_layout)  # rotated by absolute position start + t
        k = apply_rope(k, *rope, layout=self.rope_layout)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        start: int = 0,
        mask: torch.Tensor | None = None,
        return_weights: bool = False,
    ):
        """x (B, T, C) at positions start..start+T-1 -> (B, T, C); `mask` an additive (B, 1, 1, S)
        padding mask over every key so far, or None. With return_weights, also the attention
        weights (B, H, T, S)."""
        B, T, _ = x.size()
        q, k, v = self.project(x, rope)
        if cache is not None:
            k, v = cache.update(start, k, v)  # (B, H_kv, S, D), S = start + T: every position so far
        if return_weights:
            w = attention_weights(q, k, mask=mask, causal=True)  # (B, H, T, S)
            y = w @ v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)  # each KV head serves H / H_kv queries
        else:
            y = attention(q, k, v, mask=mask, causal=True, backend=self.backend)  # (B, H, T, D)
        y = self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, H, T, D) -> (B, T, H·D) -> (B, T, C)
        return (y, w) if return_weights else y


class SwiGLU(nn.Module):
    """The gated feed-forward: C -> F (twice: a gate and a value) -> C, down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, Fw = config.n_embd, config.intermediate_size
        self.gate_proj = Linear(C, Fw, bias=False)
        self.up_proj = Linear(C, Fw, bias=False)
        self.down_proj = Linear(Fw, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, F) gated, -> (B, T, C)


class LlamaBlock(nn.Module):
    """A Pre-RMSNorm decoder block. `attn` and `mlp` default to GroupedQueryAttention and SwiGLU;
    any module with the same call signature fits."""

    def __init__(self, config: LlamaConfig, attn: nn.Module | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.rms_norm_eps)
        self.self_attn = attn if attn is not None else GroupedQueryAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLU(config)

    def forward(
        self,
        x: torch.Tensor,
        *,
        rope,
        cache: KVCache | None = None,
        start: int = 0,
        mask: torch.Tensor | None = None,
        return_weights: bool = False,
    ):
        h = self.self_attn(
            self.input_layernorm(x), rope=rope, cache=cache, start=start, mask=mask, return_weights=return_weights
        )
        h, w = h if return_weights else (h, None)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return (x, w) if return_weights else x


# --------------------------------------------------------------------------- the model
class Llama(nn.Module):
    """The decoder. `forward(idx)` returns logits (B, T, V); `forward(idx, targets)` returns
    (logits, loss), where targets[b, t] is the token that follows idx[b, t] (−100 = ignore)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        self.config = config
        C = config.n_embd
        self.model = nn.Module()  # HF's LlamaModel sits under `model.`: its names load unchanged
        self.model.embed_tokens = nn.Embedding(config.vocab_size, C)
        self.model.layers = nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layer)])
        self.model.norm = nn.RMSNorm(C, eps=config.rms_norm_eps)
        # tied: the head reads the embedding matrix itself (one (V, C) matrix reads and writes tokens)
        self.lm_head = None if config.tie_word_embeddings else Linear(C, config.vocab_size, bias=False)
        for module in self.modules():  # HF Llama's init: normal(0, 0.02) weights; the norms start at 1
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        self.reset_rope()

    def reset_rope(self, device=None) -> None:
        """(Re)build the cos and sin tables of positions 0..T_max-1, (T_max, D) each, in float32
        (a model built on the meta device gets real ones here)."""
        cfg = self.config
        cos, sin = rope_cos_sin(cfg.block_size, cfg.head_dim, base=cfg.rope_base, layout=cfg.rope_layout, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def block_size(self) -> int:
        """The context limit: positions 0..block_size − 1."""
        return self.config.block_size

    @property
    def head_weight(self) -> torch.Tensor:
        """The (V, C) matrix the head multiplies by: the embedding when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def store_by_columns(self) -> "Llama":
        """Store every weight matrix column by column (same shapes, same values): on a CPU a decode
        step then reads them about twice as fast (lib.kernels.matvec). Returns the model."""
        for p in self.parameters():
            if p.dim() == 2 and not is_column_major(p.data):
                p.data = column_major(p.data)
        return self

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def new_caches(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """One empty KVCache (H_kv heads) per layer with room for max_len positions (default
        block_size), on the model's device and dtype."""
        max_len = self.config.block_size if max_len is None else max_len
        require_int("batch_size", batch_size, minimum=1)
        require_int("max_len", max_len, minimum=1)
        if max_len > self.config.block_size:
            raise ValueError(f"max_len must be <= block_size={self.config.block_size}, got {max_len}")
        w = self.model.embed_tokens.weight
        return [
            block.self_attn.new_cache(batch_size, max_len, dtype=w.dtype, device=w.device)
            for block in self.model.layers
        ]

    def cache_bytes(self, batch: int, seq_len: int, dtype: torch.dtype | str | None = None) -> int:
        """Bytes of those caches after seq_len tokens: L · 2 · B · S · H_kv · D · bytes, by default
        in the model's dtype."""
        dtype = self.model.embed_tokens.weight.dtype if dtype is None else dtype
        return sum(block.self_attn.cache_bytes(batch, seq_len, dtype) for block in self.model.layers)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (V, C) (Hugging Face's name for it)."""
        return self.model.embed_tokens

    @DECODER_FORWARD.plus(
        return_attentions="bool",
        where={
            "caches is None or start <= caches[0].length": "start must be <= the cache length {caches[0].length} "
            "(no gaps), got {start}",
            "caches is None or start + T <= caches[0].max_len": "the caches hold {caches[0].max_len} positions; idx "
            "at {start}..{start + T - 1} would overflow them (new_caches(batch_size, max_len) with a larger max_len)",
            "not (return_attentions and targets is not None)": "return_attentions and targets go in separate calls",
        },
    )
    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
        start: int = 0,
        return_attentions: bool = False,
    ):
        """idx (B, T) token ids at positions start..start+T-1 -> logits (B, T, V). With `caches`
        (from `new_caches`), earlier positions' keys and values come from the caches and these are
        appended. With `targets`, (logits, loss); with `return_attentions`, (logits, attentions):
        every layer's attention weights, L tensors (B, H, T, S).

        `attention_mask` (B, start + T) of 1 (token) / 0 (padding) covers every position so far and
        must be left-padded. Padding keys are masked; positions are shared by the rows (a padded
        prompt starts later), which RoPE does not notice: a score depends only on the offset
        between two positions, which the padding shifts equally.
        """
        B, T = idx.shape
        w = self.model.embed_tokens.weight
        mask = None if attention_mask is None else padding_mask(attention_mask.bool(), dtype=w.dtype)  # (B, 1, 1, S)
        rope = (self.rope_cos[start : start + T].to(w.dtype), self.rope_sin[start : start + T].to(w.dtype))  # (T, D)
        x = self.model.embed_tokens(idx)  # (B, T, C)
        attentions = []
        for i, block in enumerate(self.model.layers):
            cache = None if caches is None else caches[i]
            if return_attentions:
                x, weights = block(x, rope=rope, cache=cache, start=start, mask=mask, return_weights=True)
                attentions.append(weights)
            else:
                x = block(x, rope=rope, cache=cache, start=start, mask=mask)
        logits = linear(self.model.norm(x), self.head_weight)  # (B, T, C) @ (C, V) -> (B, T, V)
        if return_attentions:
            return logits, attentions
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
        return logits, loss

    # ----------------------------------------------------------------------- loading
    def load_checkpoint(self, state_dict: dict[str, torch.Tensor], *, assign: bool = False) -> None:
        """Load a Hugging Face LlamaForCausalLM state dict (names as `model.layers.0.self_attn.q_proj.
        weight`). A tied model drops the checkpoint's `lm_head.weight` after checking it equals the
        embedding. With `assign`, the tensors become the parameters (no copy: for a model built on
        the meta device). Any misfit raises a ValueError listing missing, unexpected and
        mismatched keys."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
        theirs = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.lm_head is None and "lm_head.weight" in theirs:
            head = theirs.pop("lm_head.weight")
            embed = theirs.get("model.embed_tokens.weight")
            if embed is not None and not torch.equal(head.cpu(), embed.cpu()):
                raise ValueError(
                    "lm_head.weight differs from model.embed_tokens.weight: this checkpoint is untied; "
                    "use LlamaConfig(tie_word_embeddings=False)"
                )
        require_state_dict_fits(self.state_dict(), theirs, "LlamaConfig")
        self.load_state_dict(theirs, strict=True, assign=assign)

    @classmethod
    def from_huggingface(cls, model, **changes) -> "Llama":
        """A `Llama` with the config and weights of a `transformers.LlamaForCausalLM`, in eval mode,
        on the model's device and in its dtype. `changes` override config fields that don't touch
        the weights (attention_backend)."""
        if not hasattr(model, "config") or not hasattr(model, "state_dict"):
            raise TypeError(f"model must be a transformers.LlamaForCausalLM, got {type(model).__name__}")
        fields = dict(LlamaConfig.from_huggingface(model.config).__dict__)
        fields.update(changes)
        weight = next(model.parameters())
        llama = cls(LlamaConfig(**fields))
        llama.load_checkpoint({k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()})
        return llama.to(device=weight.device, dtype=weight.dtype).eval()
