"""The training loop every model in the course trains with, and its learning-rate schedules.

One step: draw a batch, compute the loss, zero the gradients, backpropagate, clip the gradient
norm, update with AdamW, advance the schedule, report. What differs between the course's models
is passed in: where batches come from (`next_batch`), what the loss is (`loss_of`), the schedule
and the optimiser's settings. `train_lm` below, `lib.tasks.train_on_task`, `lib.bert_mlm.train_mlm`
and `lib.moe_lm.train_moe_lm` are this loop with their model's batches and loss.

    train           the loop; returns every step's loss
    warmup_cosine   linear warm-up, then cosine decay to 10% of the peak (nanoGPT's schedule)
    warmup_linear   linear warm-up, then linear decay to 0 (BERT's schedule)
    clm_loss        the next-token loss: position t predicts token t + 1
    get_batch       random windows of a token stream and their next tokens
    train_lm        next-token training of a causal language model (GPT, Mamba, the hybrid)
    evaluate_loss   its mean next-token loss on seeded windows
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from lib._checks import require_int, require_rank, require_real, require_targets, require_tensor
from lib._replay import replayable

__all__ = ["clm_loss", "evaluate_loss", "get_batch", "train", "train_lm", "warmup_cosine", "warmup_linear"]


def warmup_cosine(steps: int, warmup: int) -> Callable[[int], float]:
    """The learning-rate multiplier at step s: (s + 1) / warmup during the warm-up, then a cosine
    from 1 down to 0.1 at the last step."""
    require_int("steps", steps, minimum=1)
    require_int("warmup", warmup, minimum=1)

    def schedule(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = (s - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule


def warmup_linear(steps: int, warmup: int) -> Callable[[int], float]:
    """The learning-rate multiplier at step s: (s + 1) / warmup during the warm-up, then a straight
    line down to 0 at the end (Post-LN BERT needs the warm-up)."""
    require_int("steps", steps, minimum=1)
    require_int("warmup", warmup, minimum=1)
    return lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup)))


def train(
    model: torch.nn.Module,
    next_batch: Callable,
    loss_of: Callable,
    *,
    steps: int,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    schedule: Callable[[int], float] | None = None,
    clip_norm: float | None = 1.0,
    on_step: Callable | None = None,
) -> list[float]:
    """Train `model` for `steps` steps; returns every step's loss (a float each).

    `next_batch(step)` gives a batch and `loss_of(model, batch)` its scalar loss. AdamW on the
    parameters that require grad (a LoRA-wrapped model trains only its adapters); `schedule(step)`
    multiplies `lr` (None: constant); the gradient norm is clipped to `clip_norm` (None: not
    clipped). `on_step(step, loss)` is called after each update (a progress bar, a live plot).
    The model trains in train mode and is left in eval mode.
    """
    require_int("steps", steps, minimum=1)
    require_real("lr", lr, above=0)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no parameter with requires_grad=True: nothing to train")
    # foreach: one operation over all parameters per update. PyTorch defaults to it on GPUs only; on a CPU its
    # default loops over the tensors in Python, which costs a model of many small tensors (a Mamba, a hybrid)
    # more than its arithmetic. The same numbers, bit for bit (tests/lib/test_gpt.py).
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), foreach=True)
    sched = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    losses = []
    for step in range(steps):
        loss = loss_of(model, next_batch(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


# --------------------------------------------------------------------------- the next-token loss
def clm_loss(logits: torch.Tensor, idx: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Causal-LM loss over one sequence batch: position t predicts token t + 1.

    logits (B, T, V) from running the model on idx (B, T). The shift drops the last position's
    logits (nothing follows it) and the first token (nothing predicts it): T - 1 predictions per
    row, all trained by one forward pass because the causal mask keeps each from seeing its answer.
    """
    require_tensor("logits", logits, floating=True)
    require_rank("logits", logits, 3, "(B, T, V)")
    require_targets("idx", idx, tuple(logits.shape[:2]), logits.shape[-1], ignore_index)
    if idx.shape[1] < 2:
        raise ValueError(f"idx needs T >= 2 tokens for a next-token loss, got T={idx.shape[1]}")
    V = logits.shape[-1]
    pred = logits[:, :-1].reshape(-1, V)  # (B, T-1, V) -> (B(T-1), V): predictions for positions 1..T-1
    target = idx[:, 1:].reshape(-1)  # (B(T-1),): the tokens that actually came next
    return F.cross_entropy(pred, target, ignore_index=ignore_index)


# --------------------------------------------------------------------------- the language-model recipe
def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator | None = None):
    """Random windows of a 1-D token stream: x (B, T) and y (B, T) = x shifted by one."""
    require_tensor("data", data)
    require_rank("data", data, 1, "(N,) a 1-D stream of token ids")
    require_int("batch_size", batch_size, minimum=1)
    require_int("seq_len", seq_len, minimum=1)
    if len(data) < seq_len + 1:
        raise ValueError(f"data must hold more than seq_len={seq_len} tokens, got {len(data)}")
    starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len)
    x = data[starts[:, None] + offsets]  # (B, T)
    y = data[starts[:, None] + offsets + 1]  # (B, T): the next token at every position
    return x, y


@replayable
def train_lm(
    model: torch.nn.Module,
    data: torch.Tensor,
    *,
    steps: int = 500,
    batch_size: int = 32,
    seq_len: int | None = None,
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    warmup: int | None = None,
    seed: int = 0,
    on_step=None,
) -> list[float]:
    """Next-token training on random windows of `data` (a 1-D token stream), by `train`: any model
    whose `forward(idx, targets)` returns (logits, loss) (GPT, MambaLM, the hybrid) and whose
    `config.block_size` gives the default window (or pass `seq_len`).

    AdamW on the parameters that require grad (so a LoRA-wrapped model trains only its adapters),
    linear warm-up over `warmup` steps (default 5%), then cosine decay to 10% of `lr`.
    `on_step(step, loss)` is called after each step. Returns every step's loss.
    """
    require_int("steps", steps, minimum=1)
    seq_len = model.config.block_size if seq_len is None else seq_len
    g = torch.Generator().manual_seed(seed)
    warmup = max(1, steps // 20) if warmup is None else warmup
    return train(
        model,
        lambda step: get_batch(data, batch_size, seq_len, g),
        lambda model, xy: model(*xy)[1],
        steps=steps,
        lr=lr,
        weight_decay=weight_decay,
        schedule=warmup_cosine(steps, warmup),
        on_step=on_step,
    )


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    data: torch.Tensor,
    *,
    batches: int = 8,
    batch_size: int = 32,
    seq_len: int | None = None,
    seed: int = 1234,
) -> float:
    """Mean next-token loss (nats per token) on `batches` seeded random windows of `data`."""
    require_int("batches", batches, minimum=1)
    seq_len = model.config.block_size if seq_len is None else seq_len
    g = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    total = 0.0
    for _ in range(batches):
        x, y = get_batch(data, batch_size, seq_len, g)
        total += model(x, y)[1].item()
    model.train(was_training)
    return total / batches
