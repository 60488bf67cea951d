"""Synthetic sequence tasks that separate architectures, generated on the fly (no data files).

    SelectiveCopying(...)           remember the few data tokens scattered among blanks, then
                                    repeat them in order when the recall markers arrive (Mamba,
                                    Gu & Dao 2023, §4.1.1: needs content-aware, selective memory)
    AssociativeRecall(...)          key-value pairs, then queries for some keys: answer each with
                                    its value (multi-query associative recall, Arora et al. 2023,
                                    "Zoology": needs in-context retrieval, attention's strength)
    train_on_task(model, task, ...) masked next-token training on any model whose forward(idx)
                                    returns logits (B, T, V) (lib.gpt.GPT, lib.mamba_lm.MambaLM, ...)
    task_accuracy(model, task, ...) the share of answer tokens predicted exactly (greedy)
    reversal_batch(step, ...)       a seq2seq batch for lib.encdec.EncoderDecoder: the target is
                                    the source backwards; `seq2seq_loss(model, batch)` its
                                    teacher-forced loss (both for lib.train.train directly)

A task is a function `task(batch, generator) -> (idx (B, T), targets (B, T))` with targets = -100
wherever nothing is asked (the loss and the accuracy ignore those positions). `reversal_batch` is
a function of the step instead, as `lib.train.train` draws its batches.

Token ids of selective copying: 0 = blank (noise), 1 = recall marker, 2 .. 2 + n_symbols - 1 the
data symbols. Vocabulary size = n_symbols + 2.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from lib._checks import require_int
from lib._replay import replayable
from lib.encdec import EncoderDecoder
from lib.train import train, warmup_cosine

__all__ = [
    "BLANK",
    "IGNORE",
    "RECALL",
    "AssociativeRecall",
    "SelectiveCopying",
    "reversal_batch",
    "seq2seq_loss",
    "task_accuracy",
    "task_loss",
    "train_on_task",
]

BLANK, RECALL, IGNORE = 0, 1, -100

Task = Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


class SelectiveCopying:
    """Selective copying: `n_data` symbols at random positions among `n_blank` blanks, then
    `n_data` recall markers; at the k-th marker the model must output the k-th symbol.

    A model with a fixed (input-independent) recurrence must mix blanks and symbols alike into
    its state; a selective one can skip the blanks. Calling the task gives one batch.
    """

    def __init__(self, n_data: int = 4, n_blank: int = 28, n_symbols: int = 8):
        self.n_data = require_int("n_data", n_data, minimum=1)
        self.n_blank = require_int("n_blank", n_blank, minimum=0)
        self.n_symbols = require_int("n_symbols", n_symbols, minimum=1)

    @property
    def vocab_size(self) -> int:
        return self.n_symbols + 2

    @property
    def seq_len(self) -> int:
        return self.n_data + self.n_blank + self.n_data

    def __repr__(self) -> str:
        return (
            f"SelectiveCopying(n_data={self.n_data}, n_blank={self.n_blank}, n_symbols={self.n_symbols}): "
            f"sequences of {self.seq_len} tokens, vocabulary {self.vocab_size}"
        )

    def __call__(self, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx (B, T), targets (B, T)): targets hold the symbols at the marker positions, -100 elsewhere."""
        require_int("batch", batch, minimum=1)
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        n, body = self.n_data, self.n_data + self.n_blank
        symbols = torch.randint(2, 2 + self.n_symbols, (batch, n), generator=generator)  # (B, n)
        # the data positions: n distinct positions in the body, in increasing order
        positions = torch.rand(batch, body, generator=generator).argsort(dim=1)[:, :n].sort(dim=1).values  # (B, n)
        idx = torch.full((batch, body + n), BLANK, dtype=torch.long)
        idx.scatter_(1, positions, symbols)
        idx[:, body:] = RECALL
        targets = torch.full_like(idx, IGNORE)
        targets[:, body:] = symbols  # the output at the k-th marker is the k-th symbol
        return idx, targets

    def describe(self, idx: torch.Tensor) -> str:
        """One sequence as text: '.' blank, '?' marker, letters for symbols."""
        names = {BLANK: ".", RECALL: "?"}
        return " ".join(names.get(int(t), chr(ord("A") + int(t) - 2)) for t in idx)


class AssociativeRecall:
    """Multi-query associative recall: `n_pairs` (key, value) pairs with distinct keys, then
    `n_queries` of those keys in random order; at each query the model must output its value.

    Token ids: 0 unused, 1 the separator between pairs and queries, keys 2 .. 2 + n_keys - 1,
    values 2 + n_keys .. 2 + n_keys + n_values - 1. A fixed-size state must store every pair it
    may be asked about; attention can look each one up. Calling the task gives one batch.
    """

    def __init__(self, n_pairs: int = 8, n_queries: int = 4, n_keys: int = 16, n_values: int = 16):
        self.n_pairs = require_int("n_pairs", n_pairs, minimum=1)
        self.n_queries = require_int("n_queries", n_queries, minimum=1)
        self.n_keys = require_int("n_keys", n_keys, minimum=1)
        self.n_values = require_int("n_values", n_values, minimum=1)
        if n_pairs > n_keys:
            raise ValueError(f"n_pairs must be <= n_keys (keys are distinct), got n_pairs={n_pairs}, n_keys={n_keys}")
        if n_queries > n_pairs:
            raise ValueError(
                f"n_queries must be <= n_pairs (each query asks a different stored key), got "
                f"n_queries={n_queries}, n_pairs={n_pairs}"
            )

    @property
    def vocab_size(self) -> int:
        return 2 + self.n_keys + self.n_values

    @property
    def seq_len(self) -> int:
        return 2 * self.n_pairs + 1 + self.n_queries

    def __repr__(self) -> str:
        return (
            f"AssociativeRecall(n_pairs={self.n_pairs}, n_queries={self.n_queries}, n_keys={self.n_keys}, "
            f"n_values={self.n_values}): sequences of {self.seq_len} tokens, vocabulary {self.vocab_size}"
        )

    def __call__(self, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx (B, T), targets (B, T)): targets hold the values at the query positions, -100 elsewhere."""
        require_int("batch", batch, minimum=1)
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        P, Q = self.n_pairs, self.n_queries
        keys = torch.rand(batch, self.n_keys, generator=generator).argsort(dim=1)[:, :P] + 2  # (B, P) distinct
        values = torch.randint(2 + self.n_keys, 2 + self.n_keys + self.n_values, (batch, P), generator=generator)
        asked = torch.rand(batch, P, generator=generator).argsort(dim=1)[:, :Q]  # (B, Q) which pairs are queried
        return self.layout(keys, values, asked)

    @staticmethod
    def layout(keys: torch.Tensor, values: torch.Tensor, asked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence for given pairs and queries: keys, values (B, P) token ids, asked (B, Q)
        indices into the pairs -> idx (B, 2P + 1 + Q) = k v k v ... | q q ..., and targets (B, 2P + 1 + Q)
        holding each query's value at the query's own position, -100 elsewhere."""
        for name, t in (("keys", keys), ("values", values), ("asked", asked)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.long or t.dim() != 2:
                raise ValueError(
                    f"{name} must be a 2-D torch.long tensor, got "
                    f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
                )
        if values.shape != keys.shape or asked.shape[0] != keys.shape[0]:
            raise ValueError(
                f"keys and values must have one shape (B, P) and asked (B, Q), got keys "
                f"{tuple(keys.shape)}, values {tuple(values.shape)}, asked {tuple(asked.shape)}"
            )
        (batch, P), Q = keys.shape, asked.shape[1]
        if Q and (int(asked.min()) < 0 or int(asked.max()) >= P):
            raise ValueError(
                f"asked must hold pair indices in [0, {P}), got values in [{int(asked.min())}, {int(asked.max())}]"
            )
        idx = torch.empty(batch, 2 * P + 1 + Q, dtype=torch.long)
        idx[:, 0 : 2 * P : 2], idx[:, 1 : 2 * P : 2] = keys, values
        idx[:, 2 * P] = RECALL  # the separator
        idx[:, 2 * P + 1 :] = keys.gather(1, asked)
        targets = torch.full_like(idx, IGNORE)
        targets[:, 2 * P + 1 :] = values.gather(1, asked)  # answered at the query itself: the next token
        return idx, targets

    def describe(self, idx: torch.Tensor) -> str:
        """One sequence as text: keys k0.., values v0.., '|' the separator."""

        def name(t: int) -> str:
            if t == RECALL:
                return "|"
            return f"k{t - 2}" if t < 2 + self.n_keys else f"v{t - 2 - self.n_keys}"

        return " ".join(name(int(t)) for t in idx)


def _logits(model, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    logits = out[0] if isinstance(out, tuple) else out
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[:2] == idx.shape):
        raise ValueError(
            f"model(idx) must return logits (B, T, V) for idx {tuple(idx.shape)}, "
            f"got {getattr(logits, 'shape', type(logits).__name__)}"
        )
    return logits


def task_loss(model, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions that ask for an answer (targets != -100)."""
    logits = _logits(model, idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


@replayable
def train_on_task(
    model,
    task: Task,
    *,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 3e-3,
    weight_decay: float = 0.0,
    seed: int = 0,
    on_step=None,
    betas: tuple[float, float] = (0.9, 0.95),
) -> list[float]:
    """AdamW with a cosine schedule (5% warm-up) on fresh batches of `task` (`lib.train.train`);
    returns every step's loss.
    `on_step(step, loss)` is called after each step (e.g. widgets.LossCurve.update).

    `betas` are AdamW's: (0.9, 0.95) as nanoGPT trains; on associative recall a small GPT leaves its
    plateau (answering with any value from the context) much later with β₂ = 0.95 than with 0.999."""
    require_int("steps", steps, minimum=1)
    require_int("batch_size", batch_size, minimum=1)
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
    ):
        raise ValueError(f"betas must be two numbers in [0, 1) (AdamW's β₁, β₂), got {betas!r}")
    g = torch.Generator().manual_seed(seed)
    return train(
        model,
        lambda step: task(batch_size, g),
        lambda model, batch: task_loss(model, *batch),
        steps=steps,
        lr=lr,
        weight_decay=weight_decay,
        betas=tuple(betas),
        schedule=warmup_cosine(steps, max(1, steps // 20)),
        on_step=on_step,
    )


@torch.no_grad()
def task_accuracy(model, task: Task, *, batches: int = 4, batch_size: int = 64, seed: int = 1234) -> float:
    """Share of answer positions whose greedy prediction is exactly the target (held-out seed)."""
    require_int("batches", batches, minimum=1)
    g = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    right = total = 0
    for _ in range(batches):
        idx, targets = task(batch_size, g)
        pred = _logits(model, idx).argmax(-1)
        asked = targets != IGNORE
        right += int((pred[asked] == targets[asked]).sum())
        total += int(asked.sum())
    model.train(was_training)
    return right / total


# --------------------------------------------------------------------------- sequence to sequence
def reversal_batch(
    step: int,
    *,
    batch: int = 64,
    max_len: int = 8,
    vocab_size: int = 16,
    min_len: int = 4,
    pad_token_id: int = 1,
    decoder_start_token_id: int = 2,
) -> dict[str, torch.Tensor]:
    """A seq2seq batch, the same for the same `step`: sources of min_len..max_len tokens (ids 3 to
    vocab_size - 1), right-padded; the target is the source backwards. Returns `input_ids`,
    `attention_mask` (B, S), `decoder_input_ids` (the start token, then the target shifted right)
    and `labels` (B, S): the target, −100 where it is padding."""
    require_int("step", step)
    require_int("max_len", max_len, minimum=1)
    require_int("min_len", min_len, minimum=1)
    if min_len > max_len:
        raise ValueError(f"min_len must be <= max_len, got min_len={min_len} > max_len={max_len}")
    if require_int("vocab_size", vocab_size, minimum=4) <= max(pad_token_id, decoder_start_token_id, 2):
        raise ValueError(f"vocab_size must leave ids above the special ones, got {vocab_size}")
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(min_len, max_len + 1, (require_int("batch", batch, minimum=1),), generator=g)
    keep = torch.arange(max_len) < lengths[:, None]  # (B, S): right padding
    src = torch.where(keep, torch.randint(3, vocab_size, (batch, max_len), generator=g), pad_token_id)
    # reverse each row's real tokens, keep the padding at the end: position j reads source n - 1 - j
    index = (lengths[:, None] - 1 - torch.arange(max_len)).clamp_min(0)
    target = torch.where(keep, src.gather(1, index), pad_token_id)
    decoder_in = torch.cat([torch.full((batch, 1), decoder_start_token_id), target[:, :-1]], dim=1)
    return dict(
        input_ids=src, attention_mask=keep.long(), decoder_input_ids=decoder_in, labels=torch.where(keep, target, -100)
    )


def seq2seq_loss(model: EncoderDecoder, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the next target token at every target position (teacher forcing)."""
    logits = model(batch["input_ids"], batch["decoder_input_ids"], batch["attention_mask"])  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
