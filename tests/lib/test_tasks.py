"""Synthetic tasks: the batches ask exactly what they say, and training on them works for any
model whose forward returns logits."""

import pytest
import torch
import torch.nn as nn
from refusals import assert_refuses, rows

from lib.tasks import (
    BLANK,
    IGNORE,
    RECALL,
    SelectiveCopying,
    reversal_batch,
    task_accuracy,
    task_loss,
    train_on_task,
)


def test_selective_copying_targets_are_the_symbols_in_order_at_the_markers():
    task = SelectiveCopying(n_data=5, n_blank=11, n_symbols=6)
    idx, targets = task(64, torch.Generator().manual_seed(0))
    assert idx.shape == targets.shape == (64, task.seq_len) == (64, 21)
    body = task.n_data + task.n_blank
    assert (idx[:, body:] == RECALL).all() and (idx[:, :body] != RECALL).all()
    assert (targets[:, :body] == IGNORE).all()
    for row, tgt in zip(idx, targets):
        symbols = row[:body][row[:body] != BLANK]
        assert torch.equal(symbols, tgt[body:])  # in order of appearance, one per marker
        assert ((symbols >= 2) & (symbols < task.vocab_size)).all()
    # the positions vary from sequence to sequence (the point of "selective")
    assert len({tuple((row[:body] != BLANK).nonzero().flatten().tolist()) for row in idx}) > 32


def test_same_seed_same_batch_and_bad_arguments_are_refused():
    task = SelectiveCopying()
    a = task(4, torch.Generator().manual_seed(3))
    b = task(4, torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="n_data must be >= 1"):
        SelectiveCopying(n_data=0)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        task(2, 0)
    assert task.describe(a[0][0]).endswith("? ? ? ?")


class _Lookup(nn.Module):
    """Sees the whole sequence (not causal): can solve the task, so training must reach 100%."""

    def __init__(self, task):
        super().__init__()
        self.task = task
        self.emb = nn.Embedding(task.vocab_size, 32)
        self.pos = nn.Parameter(torch.randn(task.seq_len, 32) * 0.1)
        self.mix = nn.Linear(task.seq_len * 32, task.n_data * task.vocab_size)

    def forward(self, idx):
        B, T = idx.shape
        h = (self.emb(idx) + self.pos).reshape(B, -1)
        ans = self.mix(h).reshape(B, self.task.n_data, -1)
        logits = torch.zeros(B, T, self.task.vocab_size)
        return torch.cat([logits[:, : T - self.task.n_data], ans], dim=1)


def test_training_lowers_the_loss_and_accuracy_counts_only_answers():
    torch.manual_seed(0)
    task = SelectiveCopying(n_data=2, n_blank=6, n_symbols=4)
    model = _Lookup(task)
    losses = train_on_task(model, task, steps=150, batch_size=64, lr=1e-2)
    assert losses[-1] < 0.3 * losses[0]
    assert task_accuracy(model, task) > 0.9
    idx, targets = task(8, torch.Generator().manual_seed(1))
    assert torch.isfinite(task_loss(model, idx, targets))
    with pytest.raises(ValueError, match="logits"):
        task_loss(lambda i: i.float(), idx, targets)


def test_train_on_task_hands_its_betas_to_adamw(monkeypatch):
    """betas=(0.9, 0.999) trains the same bits as the default call with AdamW's β₂ forced to 0.999,
    and other bits than the default (0.9, 0.95): the argument reaches the optimiser."""
    task = SelectiveCopying(n_data=2, n_blank=6, n_symbols=4)

    def trained(**kw):
        torch.manual_seed(0)
        model = _Lookup(task)
        train_on_task(model, task, steps=5, batch_size=8, lr=1e-2, **kw)
        return [p.detach().clone() for p in model.parameters()]

    default, given = trained(), trained(betas=(0.9, 0.999))
    real = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **k: real(*a, **{**k, "betas": (0.9, 0.999)}))
    forced = trained()
    assert all(torch.equal(a, b) for a, b in zip(given, forced))
    assert not all(torch.equal(a, b) for a, b in zip(given, default))


_TASK = SelectiveCopying(n_data=2, n_blank=6, n_symbols=4)
_BETAS = "betas must be two numbers in [0, 1) (AdamW's β₁, β₂), got"
TRAIN_ON_TASK_REFUSALS = [
    ("betas", (0.9,), ValueError, f"{_BETAS} (0.9,)"),
    ("betas", (0.9, 1.0), ValueError, f"{_BETAS} (0.9, 1.0)"),
    ("betas", (0.9, -0.1), ValueError, f"{_BETAS} (0.9, -0.1)"),
    ("betas", "0.9, 0.95", ValueError, f"{_BETAS} '0.9, 0.95'"),
    ("betas", (True, 0.9), ValueError, f"{_BETAS} (True, 0.9)"),
    ("steps", 0, ValueError, "steps must be >= 1, got 0"),
    ("batch_size", 2.0, TypeError, "batch_size must be an int, got float"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(TRAIN_ON_TASK_REFUSALS))
def test_train_on_task_refusals(argument, bad, error, message):
    torch.manual_seed(0)
    good = dict(model=_Lookup(_TASK), task=_TASK, steps=5, batch_size=8, lr=1e-2)
    assert_refuses(train_on_task, good, argument, bad, error, message)


def test_associative_recall_answers_each_query_with_its_stored_value():
    from lib.tasks import AssociativeRecall

    task = AssociativeRecall(n_pairs=6, n_queries=3, n_keys=10, n_values=7)
    idx, targets = task(128, torch.Generator().manual_seed(0))
    assert idx.shape == targets.shape == (128, task.seq_len) == (128, 16)
    P = task.n_pairs
    for row, tgt in zip(idx, targets):
        keys, values = row[0 : 2 * P : 2], row[1 : 2 * P : 2]
        assert len(set(keys.tolist())) == P and ((keys >= 2) & (keys < 12)).all()
        assert ((values >= 12) & (values < task.vocab_size)).all() and row[2 * P] == RECALL
        store = dict(zip(keys.tolist(), values.tolist()))
        queries = row[2 * P + 1 :].tolist()
        assert len(set(queries)) == len(queries) and all(q in store for q in queries)
        assert tgt[2 * P + 1 :].tolist() == [store[q] for q in queries]
        assert (tgt[: 2 * P + 1] == IGNORE).all()
    assert "| k" in task.describe(idx[0])


# fmt: off
ASSOCIATIVE_RECALL_REFUSALS = [
    ("n_pairs, n_queries", (2, 3), ValueError,
     "n_queries must be <= n_pairs (each query asks a different stored key), got n_queries=3, n_pairs=2"),
    ("n_pairs, n_keys", (9, 8), ValueError, "n_pairs must be <= n_keys (keys are distinct), got n_pairs=9, n_keys=8"),
    ("n_values", 0, ValueError, "n_values must be >= 1, got 0"),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message", rows(ASSOCIATIVE_RECALL_REFUSALS))
def test_associative_recall_refusals(argument, bad, error, message):
    from lib.tasks import AssociativeRecall

    assert_refuses(AssociativeRecall, dict(), argument, bad, error, message)


def test_reversal_batch_holds_each_source_backwards():
    b = reversal_batch(3, batch=50, max_len=9, min_len=1)
    for src, keep, dec, lab in zip(b["input_ids"], b["attention_mask"], b["decoder_input_ids"], b["labels"]):
        n = int(keep.sum())
        assert keep[:n].all() and not keep[n:].any()  # right padding
        assert torch.equal(lab[:n], src[:n].flip(0)) and (lab[n:] == -100).all()
        assert dec[0] == 2 and torch.equal(dec[1:n], lab[: n - 1])  # the target shifted right
    assert torch.equal(reversal_batch(3)["input_ids"], reversal_batch(3)["input_ids"])
    with pytest.raises(ValueError, match="min_len"):
        reversal_batch(0, min_len=5, max_len=4)
