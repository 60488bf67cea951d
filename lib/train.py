"""The training loop every model in the course trains with, and its learning-rate schedules.

One step: draw a batch, compute the loss, zero the gradients, backpropagate, clip the gradient
norm, update with AdamW, advance the schedule, report. What differs between the course's models
is passed in: where batches come from (`next_batch`), what the loss is (`loss_of`), the schedule
and the optimiser's settings. `lib.gpt.train_gpt`, `lib.tasks.train_on_task`, `lib.bert.train_mlm`
and `lib.moe_lm.train_moe_lm` are this loop with their model's batches and loss.

    train           the loop; returns every step's loss
    warmup_cosine   linear warm-up, then cosine decay to 10% of the peak (nanoGPT's schedule)
    warmup_linear   linear warm-up, then linear decay to 0 (BERT's schedule)
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from lib._checks import require_int, require_real

__all__ = ["train", "warmup_cosine", "warmup_linear"]


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


def train(model: torch.nn.Module, next_batch: Callable, loss_of: Callable, *, steps: int, lr: float,
          weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
          schedule: Callable[[int], float] | None = None, clip_norm: float | None = 1.0,
          on_step: Callable | None = None) -> list[float]:
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
