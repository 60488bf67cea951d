"""Masked-LM pretraining of lib.bert's encoder: the MLM head, its training loop, its predictions,
and the gradients at initialisation that explain BERT's warm-up.

    BertForMaskedLM(config)           Bert + dense -> GELU -> LayerNorm -> logits (B, T, V), the
                                      output matrix tied to the word embeddings (as BERT does)
    train_mlm(model, ids, mask, ...)  AdamW on fresh 80/10/10 corruptions (lib.bert.mlm_corrupt) of
                                      random batches, linear warm-up then linear decay
    predict_masked(model, ids, mask)  top-k token ids and probabilities at every position
    init_gradient_norms(config, ...)  each encoder layer's gradient norm at initialisation, Post-LN
                                      or Pre-LN, BERT's init or Xavier's (Xiong et al. 2020,
                                      arXiv 2002.04745)

Follows Devlin et al. 2018 (arXiv 1810.04805, §3.1 and appendix A). The encoder, its loading
and the corruption itself (`mlm_corrupt`) are lib.bert.

Glossary: B batch, T tokens, C hidden size, L layers, V vocabulary, N rows of a corpus.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import require_rank, require_tensor
from lib._replay import replayable
from lib.bert import Bert, BertConfig, mlm_corrupt
from lib.train import train, warmup_linear

__all__ = ["BertForMaskedLM", "init_gradient_norms", "predict_masked", "train_mlm"]


class BertForMaskedLM(nn.Module):
    """Bert + the MLM head: dense -> GELU -> LayerNorm -> logits over the vocabulary, with the
    output matrix tied to the word embeddings (as BERT does)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.bert = Bert(config)
        self.transform = nn.Sequential(
            nn.Linear(config.hidden_size, config.hidden_size),
            nn.GELU(),
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps),
        )
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.transform(self.bert(input_ids, attention_mask))  # (B, T, C)
        logits = h @ self.bert.embeddings.word_embeddings.weight.T + self.bias  # (B, T, V)
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return logits, loss


@replayable
def train_mlm(
    model: BertForMaskedLM,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    mask_token_id: int,
    special_token_ids,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    on_step=None,
) -> list[float]:
    """Train with the masked-LM loss on fresh 80/10/10 corruptions of random batches (`lib.train.train`).

    AdamW with a linear warm-up over the first 10% of steps (Post-LN BERT needs it) and linear
    decay after. `on_step(step, loss)` is called after every step (a progress bar, a live plot).
    Returns the loss of every step.
    """
    require_tensor("ids", ids)
    require_rank("ids", ids, 2, "(N, T)")
    if attention_mask.shape != ids.shape:
        raise ValueError(f"attention_mask must have ids' shape {tuple(ids.shape)}, got {tuple(attention_mask.shape)}")
    g = torch.Generator().manual_seed(seed)
    vocab_size = model.bert.config.vocab_size

    def next_batch(step):
        rows = torch.randint(len(ids), (batch_size,), generator=g)
        corrupted, labels = mlm_corrupt(
            ids[rows],
            mask_token_id=mask_token_id,
            vocab_size=vocab_size,
            special_token_ids=special_token_ids,
            generator=g,
        )
        return corrupted, attention_mask[rows], labels

    def loss_of(model, batch):
        corrupted, mask, labels = batch
        return model(corrupted, mask, labels=labels)[1]

    return train(
        model,
        next_batch,
        loss_of,
        steps=steps,
        lr=lr,
        weight_decay=0.01,
        betas=(0.9, 0.999),
        schedule=warmup_linear(steps, max(1, steps // 10)),
        clip_norm=None,
        on_step=on_step,
    )


@torch.no_grad()
def predict_masked(model: BertForMaskedLM, ids: torch.Tensor, attention_mask: torch.Tensor, k: int = 5):
    """Top-k token ids and probabilities at every position, (B, T, k) each."""
    model.eval()
    probs = model(ids, attention_mask).softmax(-1)  # (B, T, V)
    top = probs.topk(k, dim=-1)
    return top.indices, top.values


INIT_SCHEMES = ("bert", "xavier")
GRADIENT_PARTS = ("layer", "ffn_w2")


def init_gradient_norms(
    config: BertConfig, *, batch: int = 8, T: int = 32, seed: int = 0, init: str = "bert", part: str = "layer"
) -> list[float]:
    """Gradient norm per encoder layer at initialisation, for one MLM-style loss (random tokens).

    init: "bert" (N(0, 0.02), the model's own) or "xavier" (Xavier-uniform linear weights, zero
      biases: the original Transformer's, which Xiong et al. 2020 analyse).
    part: "layer" (all of a layer's parameters) or "ffn_w2" (the feed-forward's output matrix W²,
      the weight whose gradient Xiong et al. 2020, arXiv 2002.04745, Theorem 1, bound for the last
      layer: larger for Post-LN than for Pre-LN, hence BERT's warm-up).
    """
    if init not in INIT_SCHEMES:
        raise ValueError(f"init must be one of {INIT_SCHEMES}, got {init!r}")
    if part not in GRADIENT_PARTS:
        raise ValueError(f"part must be one of {GRADIENT_PARTS}, got {part!r}")
    torch.manual_seed(seed)
    model = BertForMaskedLM(config).train()
    if init == "xavier":
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, config.vocab_size, (batch, T), generator=g)
    labels = torch.randint(5, config.vocab_size, (batch, T), generator=g)
    _, loss = model(ids, labels=labels)
    loss.backward()
    layers = model.bert.encoder.layer
    if part == "ffn_w2":
        return [layer.output.dense.weight.grad.norm().item() for layer in layers]
    return [torch.sqrt(sum((p.grad**2).sum() for p in layer.parameters())).item() for layer in layers]
