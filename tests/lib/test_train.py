"""lib.train: the one training loop is the loop written out by hand (bit for bit), its schedules
are the stated formulas, it trains only what requires grad, and it refuses bad input clearly."""

import math

import pytest
import torch
import torch.nn.functional as F
from refusals import built, not_float, refusal_test

from lib.gpt import GPT, GPTConfig
from lib.train import clm_loss, get_batch, train, train_lm, warmup_cosine, warmup_linear

DATA = torch.randint(0, 32, (1500,), generator=torch.Generator().manual_seed(0))


def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(vocab_size=32))


def _by_hand(model, steps, lr, schedule, clip):
    """AdamW, the schedule, clipping: the loop as every trainer here used to spell it out."""
    g = torch.Generator().manual_seed(5)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    model.train()
    losses = []
    for _ in range(steps):
        x, y = get_batch(DATA, 4, 16, g)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("schedule, clip", [(warmup_cosine(12, 2), 1.0), (None, None), (warmup_linear(12, 3), 0.5)])
def test_the_loop_is_the_loop_written_by_hand_bit_for_bit(schedule, clip):
    a, b = _model(), _model()
    want = _by_hand(a, 12, 3e-3, schedule, clip)
    g = torch.Generator().manual_seed(5)
    seen = []
    got = train(
        b,
        lambda step: get_batch(DATA, 4, 16, g),
        lambda model, xy: model(*xy)[1],
        steps=12,
        lr=3e-3,
        weight_decay=0.1,
        schedule=schedule,
        clip_norm=clip,
        on_step=lambda s, loss: seen.append((s, loss)),
    )
    assert got == want and seen == list(enumerate(want)) and not b.training
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_train_lm_is_the_loop_with_its_batches_and_a_cosine_schedule():
    a, b = _model(), _model()
    got = train_lm(a, DATA, steps=10, batch_size=4, seq_len=16, seed=5)
    assert got == _by_hand(b, 10, 3e-3, warmup_cosine(10, 1), 1.0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_the_schedules_are_the_stated_formulas():
    cos = warmup_cosine(100, 10)
    assert [cos(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert cos(10) == 1.0 and math.isclose(cos(55), 0.55) and math.isclose(cos(100), 0.1)
    lin = warmup_linear(100, 10)
    assert [lin(s) for s in (0, 9)] == [0.1, 1.0] and math.isclose(lin(55), 0.5) and lin(100) == 0.0


def test_only_parameters_that_require_grad_move():
    model = _model()
    frozen = model.transformer.wte.weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    g = torch.Generator().manual_seed(1)
    train(model, lambda step: get_batch(DATA, 4, 16, g), lambda m, xy: m(*xy)[1], steps=3, lr=1e-2)
    assert torch.equal(frozen, before)


def _frozen_model():
    model = _model()
    model.requires_grad_(False)
    return model


TRAIN_REFUSALS = [
    ("steps", 0, ValueError, "steps must be >= 1, got 0"),
    ("lr", -1.0, ValueError, "lr must be a finite number > 0, got -1.0"),
    ("model", built(_frozen_model), ValueError, "model has no parameter with requires_grad=True: nothing to train"),
    ("steps", 2.0, TypeError, "steps must be an int, got float"),
]
test_train_refusals = refusal_test(
    train,
    built(
        lambda: dict(
            model=_model(),
            next_batch=lambda step: get_batch(DATA, 4, 16, torch.Generator()),
            loss_of=lambda m, xy: m(*xy)[1],
            steps=1,
            lr=0.001,
        )
    ),
    TRAIN_REFUSALS,
)


def test_warmup_cosine_refuses_no_warmup():
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        warmup_cosine(10, 0)


def test_shifted_loss_equals_forward_with_shifted_targets():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny()).eval()
    idx = torch.randint(64, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(idx)
        _, loss = model(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(clm_loss(logits, idx), loss, atol=1e-6, rtol=1e-6)
    by_hand = torch.stack([F.cross_entropy(logits[b, t], idx[b, t + 1]) for b in range(3) for t in range(16)]).mean()
    torch.testing.assert_close(clm_loss(logits, idx), by_hand, atol=1e-6, rtol=1e-6)


# fmt: off
CLM_LOSS_REFUSALS = [
    ("logits, idx", (torch.zeros(3, 1, 64), torch.zeros(3, 1, dtype=torch.long)), ValueError,
     "idx needs T >= 2 tokens for a next-token loss, got T=1"),
    ("idx", torch.full((2, 5), 70), ValueError, "idx must lie in [0, V=64) (or be -100 to skip a position), got 70"),
    ("idx", torch.zeros(2, 4, dtype=torch.long), ValueError, "idx must have shape (B, T) = (2, 5), got (2, 4)"),
    ("logits", torch.zeros(2, 5, 64, dtype=torch.long), TypeError, not_float("logits")),
]
# fmt: on
test_clm_loss_refusals = refusal_test(
    clm_loss,
    built(lambda: dict(logits=torch.zeros(2, 5, 64), idx=torch.zeros(2, 5, dtype=torch.long))),
    CLM_LOSS_REFUSALS,
)
