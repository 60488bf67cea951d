"""The encoder-decoder (T5, BART): a bidirectional encoder, a causal decoder, and the
cross-attention between them.

The third value of M. The encoder reads the whole source both ways (lesson 02's BERT layer,
reused as it is); the decoder writes the target left to right (causal self-attention, as GPT);
in each decoder layer, *cross-attention* lets the decoder's T queries read the encoder's S
outputs. Its mask is (T, S), rectangular, with −inf only in the columns of the source's padding
(`lib.masks.cross_attention_mask`): every target position may read the whole source.

    encoder   x = LN(E[src] + P[pos]);   L_enc x BertLayer (Post-LN, padding mask)
    decoder   y = LN(E[tgt] + P'[pos]);  L_dec x [ y = LN(y + SelfAttn(y))          causal
                                                  y = LN(y + CrossAttn(y, memory))  source pad
                                                  y = LN(y + FFN(y)) ]
    logits    y Eᵀ + b      (one token embedding E for source, target and output)

The layout and numbers of Hugging Face's BART (Lewis et al. 2019, "BART: Denoising
Sequence-to-Sequence Pre-training", arXiv 1910.13461): `EncoderDecoder.from_bart` loads a
`BartForConditionalGeneration`, and the tests check the logits agree. T5 (Raffel et al. 2019)
is the same idea with other parts: relative position buckets added to the scores instead of
position embeddings, RMS norms before each sublayer, no 1/√D, so its weights do not fit here.

Decoding: the source is encoded once, and each decoder layer's cross-attention keys and values
are a function of the encoder's output only, so `cross_kv` computes them once per source and
every step reuses them; the decoder's own keys and values grow in a `KVCache`, as in lesson 04.
`greedy_decode` does that; `greedy_decode_ref` recomputes everything at every step.

A task to train it on, `reversal_batch` (write the source backwards) with `seq2seq_loss`, is in
lib.tasks.

Glossary: B batch, S source length, T target length, C = d_model, H heads, D = C / H.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import inputs_checked, require_int, require_tensor, require_token_ids
from lib._door import door
from lib.attention import attention, attention_weights
from lib.bert import Bert, BertConfig, BertLayer
from lib.kv_cache import KVCache
from lib.masks import cross_attention_mask, padding_mask

__all__ = ["EncDecConfig", "EncoderDecoder", "greedy_decode", "greedy_decode_ref"]

_BART_POSITION_OFFSET = 2  # BART's learned positions start at row 2 of their table (a fairseq habit)


@dataclass
class EncDecConfig:
    vocab_size: int = 64
    d_model: int = 32  # C
    n_heads: int = 4  # H, in every attention (encoder, decoder, cross)
    encoder_layers: int = 2
    decoder_layers: int = 2
    ffn_dim: int = 64
    max_position_embeddings: int = 64
    pad_token_id: int = 1  # BART's ids: <s> 0, <pad> 1, </s> 2
    decoder_start_token_id: int = 2
    scale_embedding: bool = False  # True: token embeddings times √C (BART's option, off by default)
    layer_norm_eps: float = 1e-5
    dropout: float = 0.0
    attention_backend: str = "auto"  # see lib.attention.attention

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "n_heads",
            "encoder_layers",
            "decoder_layers",
            "ffn_dim",
            "max_position_embeddings",
        ):
            require_int(name, getattr(self, name), minimum=1)
        for name in ("pad_token_id", "decoder_start_token_id"):
            if not 0 <= require_int(name, getattr(self, name)) < self.vocab_size:
                raise ValueError(f"{name} must lie in [0, vocab_size={self.vocab_size}), got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")

    def encoder_layer_config(self) -> BertConfig:
        """The BertConfig whose BertLayer is this model's encoder layer."""
        return BertConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.d_model,
            num_hidden_layers=self.encoder_layers,
            num_attention_heads=self.n_heads,
            intermediate_size=self.ffn_dim,
            max_position_embeddings=self.max_position_embeddings,
            layer_norm_eps=self.layer_norm_eps,
            hidden_dropout_prob=self.dropout,
            attention_probs_dropout_prob=self.dropout,
            pad_token_id=self.pad_token_id,
            attention_backend=self.attention_backend,
        )

    @classmethod
    def from_huggingface(cls, hf_config) -> "EncDecConfig":
        """The config of a transformers `BartConfig`; a BART variant this model does not build
        (other activations, different encoder and decoder widths) raises a ValueError."""
        c = hf_config
        differs = [
            f"{a}={getattr(c, a)} vs {b}={getattr(c, b)}"
            for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim"))
            if getattr(c, a) != getattr(c, b)
        ]
        if c.activation_function != "gelu":
            differs.append(f"activation_function={c.activation_function!r} (this model uses exact GELU)")
        if differs:
            raise ValueError("this BART config does not fit EncDecConfig: " + "; ".join(differs))
        return cls(
            vocab_size=c.vocab_size,
            d_model=c.d_model,
            n_heads=c.encoder_attention_heads,
            encoder_layers=c.encoder_layers,
            decoder_layers=c.decoder_layers,
            ffn_dim=c.encoder_ffn_dim,
            max_position_embeddings=c.max_position_embeddings,
            pad_token_id=c.pad_token_id,
            decoder_start_token_id=c.decoder_start_token_id,
            scale_embedding=c.scale_embedding,
            dropout=0.0,
        )


def _heads(x: torch.Tensor, H: int) -> torch.Tensor:
    B, T, C = x.shape
    return x.view(B, T, H, C // H).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)


class Attention(nn.Module):
    """Multi-head attention whose queries come from `x` and whose keys and values were
    projected (by `project_kv`) from any sequence: `x` itself (self-attention) or the encoder's
    output (cross-attention)."""

    def __init__(self, cfg: EncDecConfig):
        super().__init__()
        C, self.H, self.backend = cfg.d_model, cfg.n_heads, cfg.attention_backend
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(C, C) for _ in range(4))

    def project_kv(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B, S, C) -> keys and values, each (B, H, S, D)."""
        return _heads(self.k_proj(src), self.H), _heads(self.v_proj(src), self.H)

    def forward(
        self,
        x: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask=None,
        causal: bool = False,
        weights: list | None = None,
    ):
        """x (B, T, C), k and v (B, H, S, D) -> (B, T, C); appends the (B, H, T, S) attention
        weights to `weights` when given a list."""
        q = _heads(self.q_proj(x), self.H)  # (B, H, T, D)
        if weights is None:
            y = attention(q, k, v, mask, causal, backend=self.backend)  # (B, H, T, D)
        else:
            weights.append(attention_weights(q, k, mask, causal))  # (B, H, T, S)
            y = weights[-1] @ v
        B, H, T, D = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, H * D))


class DecoderLayer(nn.Module):
    """Post-LN, three sublayers: causal self-attention, cross-attention, feed-forward."""

    def __init__(self, cfg: EncDecConfig):
        super().__init__()
        C = cfg.d_model
        self.self_attn, self.encoder_attn = Attention(cfg), Attention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(C, eps=cfg.layer_norm_eps)
        self.encoder_attn_layer_norm = nn.LayerNorm(C, eps=cfg.layer_norm_eps)
        self.fc1, self.fc2 = nn.Linear(C, cfg.ffn_dim), nn.Linear(cfg.ffn_dim, C)
        self.final_layer_norm = nn.LayerNorm(C, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        y,
        cross_kv,
        cross_mask,
        *,
        cache: KVCache | None = None,
        start: int = 0,
        cross_weights: list | None = None,
    ):
        k, v = self.self_attn.project_kv(y)  # the new positions' keys and values
        if cache is not None:
            k, v = cache.update(start, k, v)  # every target position so far
        y = self.self_attn_layer_norm(y + self.dropout(self.self_attn(y, k, v, causal=True)))
        cross = self.encoder_attn(y, *cross_kv, mask=cross_mask, weights=cross_weights)
        y = self.encoder_attn_layer_norm(y + self.dropout(cross))
        return self.final_layer_norm(y + self.dropout(self.fc2(F.gelu(self.fc1(y)))))


class _Stack(nn.Module):
    """Position table, embedding LayerNorm and layers: one side of the model (BART's names)."""

    def __init__(self, cfg: EncDecConfig, layers: list[nn.Module]):
        super().__init__()
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + _BART_POSITION_OFFSET, cfg.d_model)
        self.layernorm_embedding = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(layers)


class EncoderDecoder(nn.Module):
    """`forward(input_ids, decoder_input_ids, attention_mask)` -> logits (B, T, V) for the next
    target token at each target position (teacher forcing)."""

    def __init__(self, config: EncDecConfig):
        super().__init__()
        if not isinstance(config, EncDecConfig):
            raise TypeError(f"config must be an EncDecConfig, got {type(config).__name__}")
        self.config = cfg = config
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_token_id)
        bert_cfg = cfg.encoder_layer_config()
        self.encoder = _Stack(cfg, [BertLayer(bert_cfg) for _ in range(cfg.encoder_layers)])
        self.decoder = _Stack(cfg, [DecoderLayer(cfg) for _ in range(cfg.decoder_layers)])
        self.dropout = nn.Dropout(cfg.dropout)
        self.register_buffer("final_logits_bias", torch.zeros(1, cfg.vocab_size))
        self.embed_scale = cfg.d_model**0.5 if cfg.scale_embedding else 1.0
        self.apply(Bert._init_weights)  # BART's initialisation is BERT's: N(0, 0.02), zero biases

    def _embed(self, stack: _Stack, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        positions = torch.arange(start, start + ids.shape[1], device=ids.device) + _BART_POSITION_OFFSET
        x = self.shared(ids) * self.embed_scale + stack.embed_positions(positions)
        return self.dropout(stack.layernorm_embedding(x))  # (B, T, C)

    def _check_source(self, input_ids, attention_mask) -> None:
        cfg = self.config
        require_token_ids(
            "input_ids",
            input_ids,
            vocab_size=cfg.vocab_size,
            max_len=cfg.max_position_embeddings,
            context="max_position_embeddings",
        )
        if attention_mask is not None:
            require_tensor("attention_mask", attention_mask)
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask must have input_ids' shape (B, S) = {tuple(input_ids.shape)}, "
                    f"got {tuple(attention_mask.shape)}"
                )

    # ------------------------------------------------------------------ the three steps
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The source (B, S) -> the encoder's output, the decoder's *memory* (B, S, C)."""
        self._check_source(input_ids, attention_mask)
        mask = None if attention_mask is None else padding_mask(attention_mask, dtype=self.shared.weight.dtype)
        x = self._embed(self.encoder, input_ids)
        for layer in self.encoder.layers:
            x, _ = layer(x, mask)
        return x

    def cross_kv(self, memory: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's cross-attention keys and values, each (B, H, S, D): what a decoding
        loop computes once per source."""
        require_tensor("memory", memory, floating=True)
        if memory.dim() != 3 or memory.shape[-1] != self.config.d_model:
            raise ValueError(
                f"memory must be the encoder's output (B, S, C={self.config.d_model}), got {tuple(memory.shape)}"
            )
        return [layer.encoder_attn.project_kv(memory) for layer in self.decoder.layers]

    @door(
        start="int >= 0",
        decoder_input_ids="ids (B, T) < self.config.vocab_size",
        attention_mask="tensor (B, _) | None",
        return_cross_attentions="bool",
        where={
            "start + T <= self.config.max_position_embeddings": "decoder_input_ids has T={T} tokens from position "
            "{start}, past the context max_position_embeddings={self.config.max_position_embeddings}",
            "isinstance(cross_kv, (list, tuple)) and len(cross_kv) == self.config.decoder_layers": "cross_kv must be "
            "a list of {self.config.decoder_layers} (k, v) pairs, from cross_kv(memory)",
            "caches is None or len(caches) == self.config.decoder_layers": "caches must hold one KVCache per decoder "
            "layer ({self.config.decoder_layers}), got {len(caches)}",
            "caches is not None or not start": "start={start} needs the caches that hold positions 0..{start - 1}",
            "attention_mask is None or attention_mask.shape[1] == cross_kv[0][0].shape[2]": "attention_mask must "
            "cover the source's S={cross_kv[0][0].shape[2]} positions, got {tuple(attention_mask.shape)}",
        },
    )
    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        cross_kv,
        attention_mask: torch.Tensor | None = None,
        *,
        caches: list[KVCache] | None = None,
        start: int = 0,
        return_cross_attentions: bool = False,
    ):
        """Target tokens at positions start..start+T-1 -> logits (B, T, V). `cross_kv` from
        `cross_kv(memory)`; `attention_mask` the source's (B, S); `caches` one KVCache per
        decoder layer holding the target's earlier positions (None: no earlier positions).
        With `return_cross_attentions`, (logits, [each layer's cross-attention weights
        (B, H, T, S)])."""
        T = decoder_input_ids.shape[1]
        mask = None
        if attention_mask is not None:
            mask = cross_attention_mask(attention_mask, T, dtype=self.shared.weight.dtype)  # (B, 1, T, S)
        y = self._embed(self.decoder, decoder_input_ids, start)
        weights = [] if return_cross_attentions else None
        for i, layer in enumerate(self.decoder.layers):
            y = layer(
                y, cross_kv[i], mask, cache=None if caches is None else caches[i], start=start, cross_weights=weights
            )
        logits = y @ self.shared.weight.T + self.final_logits_bias  # (B, T, V), the head tied to E
        return (logits, weights) if return_cross_attentions else logits

    def forward(self, input_ids, decoder_input_ids, attention_mask=None) -> torch.Tensor:
        memory = self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, self.cross_kv(memory), attention_mask)

    def new_caches(self, batch_size: int, max_len: int) -> list[KVCache]:
        """One empty KVCache per decoder layer for the target's own keys and values."""
        cfg, w = self.config, self.shared.weight
        return [
            KVCache(batch_size, cfg.n_heads, max_len, cfg.d_model // cfg.n_heads, dtype=w.dtype, device=w.device)
            for _ in range(cfg.decoder_layers)
        ]

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_bart(cls, model) -> "EncoderDecoder":
        """An EncoderDecoder with the config and weights of a transformers
        `BartForConditionalGeneration` (the encoder's keys renamed to BertLayer's)."""
        if not hasattr(model, "config") or not hasattr(model, "state_dict"):
            raise TypeError(f"model must be a transformers BartForConditionalGeneration, got {type(model).__name__}")
        ours = cls(EncDecConfig.from_huggingface(model.config))
        theirs = model.state_dict()
        mapped = {}
        for key, value in theirs.items():
            if key.startswith(("model.encoder.embed_tokens.", "model.decoder.embed_tokens.", "lm_head.")):
                continue  # the shared embedding, tied
            mapped[_rename_bart_key(key.removeprefix("model."))] = value
        missing = sorted(set(ours.state_dict()) - set(mapped))
        unexpected = sorted(set(mapped) - set(ours.state_dict()))
        if missing or unexpected:
            raise ValueError(f"the BART state dict does not fit: missing {missing[:6]}, unexpected {unexpected[:6]}")
        ours.load_state_dict(mapped, strict=True)
        return ours.eval()


_ENCODER_RENAMES = {  # BART's encoder layer -> lib.bert.BertLayer: the same layer, other names
    "self_attn.q_proj": "attention.self.query",
    "self_attn.k_proj": "attention.self.key",
    "self_attn.v_proj": "attention.self.value",
    "self_attn.out_proj": "attention.output.dense",
    "self_attn_layer_norm": "attention.output.LayerNorm",
    "fc1": "intermediate.dense",
    "fc2": "output.dense",
    "final_layer_norm": "output.LayerNorm",
}


def _rename_bart_key(key: str) -> str:
    if not key.startswith("encoder.layers."):
        return key
    index, rest = key.removeprefix("encoder.layers.").split(".", 1)
    module, param = rest.rsplit(".", 1)
    return f"encoder.layers.{index}.{_ENCODER_RENAMES.get(module, module)}.{param}"


# ---------------------------------------------------------------------- decoding
def _check_decode(model, input_ids, max_new_tokens) -> None:
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"model must be an EncoderDecoder, got {type(model).__name__}")
    require_int("max_new_tokens", max_new_tokens, minimum=1)
    if max_new_tokens + 1 > model.config.max_position_embeddings:
        raise ValueError(
            f"max_new_tokens + 1 = {max_new_tokens + 1} target positions exceed "
            f"max_position_embeddings={model.config.max_position_embeddings}"
        )
    require_tensor("input_ids", input_ids)


@torch.no_grad()
def greedy_decode(
    model: EncoderDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int
) -> torch.Tensor:
    """Greedy decoding with the source encoded once, each layer's cross-attention K/V computed
    once, and the target's own K/V in a cache: (B, 1 + max_new_tokens) ids, starting with
    `decoder_start_token_id`. No early stop at an end token: every row gets max_new_tokens."""
    _check_decode(model, input_ids, max_new_tokens)
    memory = model.encode(input_ids, attention_mask)
    kv = model.cross_kv(memory)  # once per source
    caches = model.new_caches(input_ids.shape[0], max_new_tokens + 1)
    out = torch.full((input_ids.shape[0], 1), model.config.decoder_start_token_id, device=input_ids.device)
    with inputs_checked():  # each step's arguments are lib's own, made from the checked source
        for t in range(max_new_tokens):
            logits = model.decode(out[:, t : t + 1], kv, attention_mask, caches=caches, start=t)  # (B, 1, V)
            out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


@torch.no_grad()
def greedy_decode_ref(
    model: EncoderDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int
) -> torch.Tensor:
    """The same tokens the slow, obvious way: the whole model (encoder included) on the whole
    target so far, at every step."""
    _check_decode(model, input_ids, max_new_tokens)
    out = torch.full((input_ids.shape[0], 1), model.config.decoder_start_token_id, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits = model(input_ids, out, attention_mask)  # (B, t + 1, V)
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out
