"""lib.moe_lm: the MoE language model keeps every layer's router logits and trains; its training
experiment records each layer's load and router probability per step, reproducibly, trains on the
per-layer balance loss (pooled on request) and counts drops at a capacity; moe_gpt refuses bad sizes
before building anything."""

import math

import pytest
import torch

from lib.gpt import GPTConfig
from lib.moe import MoE, load_balancing_loss
from lib.moe_lm import drop_rate, moe_gpt, router_logits_of, train_moe_lm
from lib.train import get_batch


def test_moe_gpt_keeps_router_logits_of_every_layer_and_trains():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = moe_gpt(config, num_experts=4, top_k=2, d_ff=32)
    idx = torch.randint(20, (3, 8))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 8, 20)
    router = router_logits_of(model)
    assert len(router) == 2 and all(r.shape == (24, 4) for r in router)
    (loss + 0.01 * load_balancing_loss(router, 2)).backward()
    assert model.transformer.h[0].mlp.moe.router.weight.grad is not None


def test_train_moe_lm_records_load_per_step_and_is_reproducible():
    kw = dict(steps=3, n_layer=1, n_embd=16, n_head=2, d_ff=16, num_experts=4, batch_size=2, seq_len=8)
    a = train_moe_lm(0.01, **kw)
    b = train_moe_lm(0.01, **kw)
    assert a.loss == b.loss and len(a.loss) == len(a.aux_loss) == len(a.dead_experts) == 3
    assert a.load.shape == (3, 1, 4)
    torch.testing.assert_close(a.load.sum(-1), torch.ones(3, 1))
    assert len(a.imbalance) == 3 and all(i >= 1.0 for i in a.imbalance)
    # P is the mean router probability the aux loss sees: with one layer and no capacity, each step's
    # aux loss is E·Σ f_i P_i with f = load·K (fp32 record of float32 training: relative 1e-5)
    assert a.prob.shape == (3, 1, 4)
    torch.testing.assert_close(a.prob.sum(-1), torch.ones(3, 1))
    for s in range(3):
        f, P = a.load[s, 0] * 2, a.prob[s, 0]
        assert math.isclose(a.aux_loss[s], 4 * float((f * P).sum()), rel_tol=1e-5)
    assert len(a.prob_imbalance) == 3 and all(i >= 1.0 for i in a.prob_imbalance)
    # the probe is routed at steps 0 and the last, first-choice experts of layer 0, without changing training
    assert a.assignment_steps == [0, 2] and len(a.assignments) == 2 and len(a.assignments[0]) == 8
    assert all(0 <= e < 4 for row in a.assignments for e in row) and len(a.tokens) == 8
    c = train_moe_lm(0.01, probe_every=1, **kw)
    assert c.loss == a.loss and c.assignment_steps == [0, 1, 2]
    with pytest.raises(ValueError, match="probe_every must be >= 1"):
        train_moe_lm(0.01, probe_every=0, **kw)


def test_moe_gpt_refuses_bad_sizes_without_touching_the_random_state():
    state = torch.random.get_rng_state()
    with pytest.raises(
        ValueError,
        match="top_k must be <= num_experts \\(each token picks K distinct experts\\), got top_k=5, num_experts=4",
    ):
        moe_gpt(GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16), num_experts=4, top_k=5)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_moe_gpt_keeps_each_parts_own_init():
    """GPT's init touches only what GPT builds: the router keeps MoE's own nn.Linear init,
    U(±1/√C) (std 1/√(3C) = 0.072 at C = 64), not GPT-2's normal(0, 0.02), and the attention
    keeps GPT-2's."""
    torch.manual_seed(0)
    C = 64
    model = moe_gpt(GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=C), num_experts=8, top_k=2)
    bound = 1 / math.sqrt(C)
    for block in model.transformer.h:
        router = block.mlp.moe.router.weight.detach()  # (8, 64): 512 draws, the std within 10% of its value
        assert float(router.abs().max()) <= bound
        assert abs(float(router.std()) - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3)
        assert abs(float(block.attn.c_attn.weight.detach().std()) - 0.02) < 0.002  # 24,576 draws of GPT-2's init


def test_the_balance_loss_is_per_layer_by_default_and_pooled_on_request():
    """Each step's aux loss is the mean over layers of E·Σ f_i P_i with each layer's own f and P;
    the pooled form (recorded beside it, trained on with pooled_balance=True) uses the layers' mean
    f and P. The imbalance measures are the worst layer's."""
    kw = dict(steps=4, n_layer=2, n_embd=16, n_head=2, d_ff=16, num_experts=4, batch_size=2, seq_len=8)
    a = train_moe_lm(1.0, **kw)
    assert not a.pooled and a.load.shape == a.prob.shape == (4, 2, 4)
    for s in range(4):
        f, P = a.load[s] * 2, a.prob[s]  # (L, E) each; f sums to K = 2 per layer
        per_layer = float((4 * (f * P).sum(-1)).mean())
        pooled = float(4 * (f.mean(0) * P.mean(0)).sum())  # every layer routes the same N tokens
        assert math.isclose(a.aux_loss[s], per_layer, rel_tol=1e-5) and a.aux_loss_per_layer[s] == a.aux_loss[s]
        assert math.isclose(a.aux_loss_pooled[s], pooled, rel_tol=1e-5)
    worst = (a.load.max(-1).values * 4).max(-1).values
    assert a.imbalance == worst.tolist()
    assert a.layer_imbalance.shape == (4, 2) and a.final_prob(2).shape == a.final_load(2).shape == (2, 4)
    summary = a.summary(last=2)
    assert summary["aux_pooled"] == sum(a.aux_loss_pooled[-2:]) / 2 and summary["drop_rate"] == 0.0
    b = train_moe_lm(1.0, pooled_balance=True, **kw)
    assert b.pooled and b.aux_loss == b.aux_loss_pooled and b.loss[0] == a.loss[0] and b.loss != a.loss
    with pytest.raises(TypeError, match="pooled_balance must be a bool"):
        train_moe_lm(1.0, pooled_balance="yes", **kw)


def test_drop_rate_counts_dropped_assignments_on_fresh_batches_and_restores_the_capacity():
    kw = dict(steps=3, n_layer=2, n_embd=16, n_head=2, d_ff=16, num_experts=4, batch_size=2, seq_len=8)
    rec = train_moe_lm(0.0, **kw)
    state = torch.random.get_rng_state()
    rate = drop_rate(rec.model, rec.data, 1.0, batches=3, batch_size=4, seq_len=8)
    assert torch.equal(torch.random.get_rng_state(), state)  # its own generator
    layers = [m for m in rec.model.modules() if isinstance(m, MoE)]
    assert all(layer.capacity_factor is None for layer in layers)
    # by hand: the same batches, every layer's dropped over routed assignments
    g = torch.Generator().manual_seed(123)
    dropped = assigned = 0
    for layer in layers:
        layer.capacity_factor = 1.0
    with torch.no_grad():
        for _ in range(3):
            rec.model(get_batch(rec.data, 4, 8, g)[0])
            dropped += sum(layer.last_stats.dropped for layer in layers)
            assigned += sum(layer.last_stats.assignments for layer in layers)
    assert rate == dropped / assigned
    assert drop_rate(rec.model, rec.data, 4.0, batches=2, batch_size=4, seq_len=8) == 0.0  # room for everything
    with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
        drop_rate(rec.model, rec.data, 0.0)
    assert layers[0].capacity_factor == 1.0  # set back to what it was, even after a refusal
