"""lib.moe_lm: the MoE language model keeps every layer's router logits and trains; its training
experiment records load and router probability per step, reproducibly; moe_gpt refuses bad sizes
before building anything."""

import math

import pytest
import torch

from lib.gpt import GPTConfig
from lib.moe import load_balancing_loss
from lib.moe_lm import moe_gpt, router_logits_of, train_moe_lm


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
    with pytest.raises(ValueError, match="top_k must be <= num_experts=4"):
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
