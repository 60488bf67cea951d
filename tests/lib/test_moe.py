"""lib.moe: the two dispatch paths agree with each other and with a dense reference (forward and
gradients, with idle experts and with drops), the balance loss per layer (and, pooled, equal to Hugging
Face's), capacity
arithmetic and first-come-first-served dropping, gating variants, parameter counts, bad input."""

import math

import pytest
import torch
from refusals import assert_refuses, not_float, refusal_test, rows

from lib.moe import (
    MoE,
    expert_capacity,
    load_balancing_loss,
    moe_from_mixtral,
    moe_ref,
    route_top_k,
    router_z_loss,
    switch_loss,
)
from lib.moe_counts import MIXTRAL_8X7B, moe_param_counts

# fp32 throughout: the two dispatches run the same matmuls on the same rows but sum a token's K
# expert outputs in a different order (index_add per expert vs one index_add), so they agree to a
# few ulps of O(1) values; 1e-5 absolute leaves a wide margin. The dense reference runs in fp64.
ATOL = 1e-5


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(d_model=16, d_ff=32, num_experts=6, top_k=2) | kw
    return MoE(args.pop("d_model"), args.pop("d_ff"), args.pop("num_experts"), args.pop("top_k"), **args)


def _silence(moe: MoE, experts: list[int], x: torch.Tensor) -> torch.Tensor:
    """Make `experts` unreachable: feature 0 of every token is 5, and their router row reads it as -50."""
    x = x.clone()
    x[..., 0] = 5.0
    with torch.no_grad():
        moe.router.weight[:, 0] = 0.0
        moe.router.weight[experts, 0] = -50.0
    return x


def _run(moe: MoE, x: torch.Tensor, dispatch: str):
    moe.dispatch = dispatch
    moe.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    y, logits = moe(xg)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return y.detach(), xg.grad, grads, moe.last_stats


@pytest.mark.parametrize("activation", ["gelu", "silu", "swiglu"])
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_grouped_dispatch_equals_loop_forward_and_gradients_with_idle_experts(activation, capacity_factor):
    moe = _layer(activation=activation, capacity_factor=capacity_factor)
    x = _silence(moe, [1, 4], torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1)))
    y_loop, gx_loop, g_loop, s_loop = _run(moe, x, "loop")
    y_grp, gx_grp, g_grp, s_grp = _run(moe, x, "grouped")
    assert s_loop.routed[[1, 4]].tolist() == [0, 0]  # the idle experts really got nothing
    assert torch.equal(s_loop.routed, s_grp.routed) and torch.equal(s_loop.kept, s_grp.kept)
    if capacity_factor is not None:
        assert s_loop.dropped > 0  # the capped case really drops
    torch.testing.assert_close(y_grp, y_loop, atol=ATOL, rtol=0)
    torch.testing.assert_close(gx_grp, gx_loop, atol=ATOL, rtol=0)
    for name in g_loop:
        torch.testing.assert_close(g_grp[name], g_loop[name], atol=ATOL, rtol=0, msg=name)
    assert torch.count_nonzero(g_grp["w1"][[1, 4]]) == 0  # an idle expert gets a zero gradient, not an error


@pytest.mark.parametrize("gating", ["topk_softmax", "softmax_topk", "softmax_topk_raw"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.3])
@pytest.mark.parametrize("dispatch", ["loop", "grouped"])
def test_dispatch_matches_dense_reference(gating, capacity_factor, dispatch):
    moe = _layer(seed=3, gating=gating, capacity_factor=capacity_factor, dispatch=dispatch, num_experts=5, top_k=3)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(4))
    y, _ = moe(x)
    torch.testing.assert_close(y, moe_ref(moe, x), atol=ATOL, rtol=0)


def test_forward_returns_output_like_x_and_router_logits_per_token():
    moe = _layer()
    x = torch.randn(2, 5, 16)
    y, logits = moe(x)
    assert y.shape == x.shape and logits.shape == (10, 6)
    torch.testing.assert_close(logits, x.reshape(10, 16) @ moe.router.weight.t())
    stats = moe.last_stats
    assert stats.num_tokens == 10 and stats.assignments == 20 and int(stats.routed.sum()) == 20
    assert stats.capacity is None and stats.dropped == 0 and stats.drop_rate == 0.0
    assert math.isclose(float(stats.load.sum()), 1.0)


# --------------------------------------------------------------------------- gating
def test_gating_weights_sum_to_one_over_the_k_and_the_two_normalised_forms_agree():
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    moe = _layer(num_experts=8, top_k=3)
    out = {}
    for gating in ("topk_softmax", "softmax_topk", "softmax_topk_raw"):
        moe.gating = gating
        out[gating] = moe.route(logits)
    for gating in ("topk_softmax", "softmax_topk"):
        gates, experts = out[gating]
        # fp32 softmax of 3 or 8 terms: sums are 1 to within a few ulps
        torch.testing.assert_close(gates.sum(-1), torch.ones(50), atol=1e-6, rtol=0)
        assert torch.equal(experts, logits.topk(3, dim=-1).indices)
    # softmax over the K chosen logits == softmax over all E, top-K, renormalised: the same function
    torch.testing.assert_close(out["topk_softmax"][0], out["softmax_topk"][0], atol=1e-6, rtol=0)
    raw = out["softmax_topk_raw"][0]
    assert bool((raw.sum(-1) < 1).all())  # unrenormalised: the K chosen probabilities out of all E
    torch.testing.assert_close(raw, torch.softmax(logits, -1).topk(3, dim=-1).values)


def test_matches_hugging_face_mixtral_sparse_moe_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 6, 16)
    moe = moe_from_mixtral(block)
    with torch.no_grad():
        theirs = block(x)
        ours, _ = moe(x)
    # same fp32 matmuls, rows added in the same per-expert order; 1e-5 covers BLAS blocking differences
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- losses
@pytest.mark.parametrize("E,K", [(8, 2), (4, 1), (6, 3)])
def test_pooled_load_balancing_loss_equals_hugging_face_mixtral(E, K):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(E * 10 + K)
    layers = tuple(torch.randn(40, E, generator=g) * 2 for _ in range(3))
    # fp32 sums of 40-120 probabilities in a different order: equal to ~1e-7 relative
    for logits in (layers[:1], layers):
        theirs = load_balancing_loss_func(logits, E, K)
        torch.testing.assert_close(load_balancing_loss(list(logits), K, pooled=True), theirs, atol=1e-6, rtol=1e-6)
    # one layer: per layer and pooled are the same loss
    torch.testing.assert_close(
        load_balancing_loss(layers[0], K), load_balancing_loss_func(layers[:1], E, K), atol=1e-6, rtol=1e-6
    )
    assert load_balancing_loss(layers[0].view(4, 10, E), K) == load_balancing_loss(layers[0], K)


def test_load_balancing_loss_is_the_mean_of_each_layers_switch_loss():
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(40, 8, generator=g) * 2 for _ in range(3)]
    per_layer = [load_balancing_loss(t, 2) for t in layers]
    torch.testing.assert_close(load_balancing_loss(layers, 2), torch.stack(per_layer).mean())
    torch.testing.assert_close(load_balancing_loss(tuple(layers), 2), load_balancing_loss(layers, 2))


def test_per_layer_loss_sees_opposite_imbalances_that_the_pooled_loss_cancels():
    """Layer 0 over-uses expert 0 (and leaves expert 1 idle), layer 1 the mirror image: pooled, f and
    P are flat and the loss reads the even value K with no gradient at all; per layer, each layer
    reads its own excess, and the gradient lowers each layer's own favourite."""
    E, K, N = 4, 1, 64
    preferred = torch.arange(N) % E  # an even router: each expert first choice of N/E tokens
    preferred[preferred == 1] = 0  # layer 0: expert 1's tokens go to expert 0 too
    layer0 = torch.zeros(N, E)
    layer0[torch.arange(N), preferred] = 4.0
    layer1 = layer0[:, [1, 0, 2, 3]]  # the same router with experts 0 and 1 swapped
    pooled = load_balancing_loss([layer0, layer1], K, pooled=True)
    per_layer = load_balancing_loss([layer0, layer1], K)
    assert math.isclose(pooled.item(), K, rel_tol=1e-6)  # blind: it reads perfectly even
    assert per_layer.item() > 1.3 * K  # each layer sends half its tokens to one expert of 4
    torch.testing.assert_close(per_layer, load_balancing_loss(layer0, K))
    a, b = layer0.clone().requires_grad_(), layer1.clone().requires_grad_()
    load_balancing_loss([a, b], K).backward()
    assert float(a.grad[:, 0].sum()) > 0 and float(b.grad[:, 1].sum()) > 0  # descent lowers each favourite
    a.grad = b.grad = None
    load_balancing_loss([a, b], K, pooled=True).backward()  # pooled f flat: E·Σ f_i P_i ∝ Σ P_i = 1
    assert float(a.grad.abs().max()) < 1e-7 and float(b.grad.abs().max()) < 1e-7


def test_load_balancing_loss_is_k_when_routing_is_even_and_pushes_busy_experts_down():
    E, K = 4, 2
    # each token prefers a different pair, cycling through all pairs evenly, with probabilities
    # symmetric overall: f_i = K/E and P_i = 1/E, so the loss is E · E · (K/E)(1/E) = K
    pairs = [(0, 1), (2, 3), (1, 2), (3, 0)]
    logits = torch.zeros(8, E)
    for t, (a, b) in enumerate(pairs * 2):
        logits[t, [a, b]] = 1.0
    assert math.isclose(load_balancing_loss(logits, K).item(), K, rel_tol=1e-6)
    skewed = torch.zeros(8, E, requires_grad=True)
    with torch.no_grad():
        skewed[:, :2] += 1.0  # everyone picks experts 0 and 1
    load_balancing_loss(skewed, K).backward()
    assert bool((skewed.grad[:, :2] > 0).all())  # gradient descent lowers the busy experts' logits


def test_router_z_loss_is_mean_squared_logsumexp():
    logits = torch.zeros(5, 8)
    assert math.isclose(router_z_loss(logits).item(), math.log(8) ** 2, rel_tol=1e-6)
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(router_z_loss(x), (torch.logsumexp(x, -1) ** 2).mean())
    # per layer, averaged: with every layer routing the same number of tokens, the pooled mean
    y = torch.randn(7, 4, generator=torch.Generator().manual_seed(1)) * 3
    torch.testing.assert_close(router_z_loss([x, y]), (torch.logsumexp(torch.cat([x, y]), -1) ** 2).mean())
    short = y[:3]  # unequal token counts: each layer weighs the same
    torch.testing.assert_close(router_z_loss([x, short]), (router_z_loss(x) + router_z_loss(short)) / 2)


# --------------------------------------------------------------------------- capacity
def test_expert_capacity_arithmetic():
    assert expert_capacity(4096, 8, 2, 1.25) == 1280  # 1.25 · 4096 · 2 / 8
    assert expert_capacity(4096, 8, 2, 1.0) == 1024
    assert expert_capacity(10, 4, 1, 1.0) == 3  # ceil(2.5)
    assert expert_capacity(100, 10, 1, 1.1) == 11  # not 12: 1.1 is taken as 11/10
    assert expert_capacity(3, 8, 1, 0.01) == 1  # never below one slot
    assert expert_capacity(10, 4, 2, None) is None


def test_no_capacity_drops_nothing_and_small_capacity_drops_the_overflow():
    moe = _layer(seed=5, num_experts=4, top_k=2)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(6))
    moe(x)
    assert moe.last_stats.dropped == 0 and moe.last_stats.drop_rate == 0.0
    for cf in (0.5, 1.0):
        moe.capacity_factor = cf
        moe(x)
        s = moe.last_stats
        cap = expert_capacity(32, 4, 2, cf)
        assert s.capacity == cap
        assert s.kept.tolist() == [min(int(n), cap) for n in s.routed]
        assert s.dropped == sum(max(0, int(n) - cap) for n in s.routed)
        assert math.isclose(s.drop_rate, s.dropped / 64)


@pytest.mark.parametrize("dispatch", ["loop", "grouped"])
def test_dropped_tokens_get_zero_output_first_come_first_served(dispatch):
    # every token prefers expert 2; top-1, so its gate is 1 and its output is expert 2's FFN alone
    moe = _layer(num_experts=4, top_k=1, capacity_factor=1.0, dispatch=dispatch)  # capacity ceil(6/4) = 2
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2, 0] = 1.0
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    x[..., 0] = x[..., 0].abs() + 1.0
    y, _ = moe(x)
    assert moe.last_stats.capacity == 2 and moe.last_stats.dropped == 4
    flat = y.reshape(6, 16)
    expected = moe.expert(x.reshape(6, 16)[:2], moe.w1[2], moe.w2[2])  # (2, C): the first two in token order
    torch.testing.assert_close(flat[:2], expected, atol=ATOL, rtol=0)
    assert torch.count_nonzero(flat[2:]) == 0  # positions 2..5 arrived too late: zero, the residual carries them


# --------------------------------------------------------------------------- counting
def test_param_counts_for_the_lesson_layer():
    c = moe_param_counts(256, 1024, 8, 2)
    assert c["expert"] == 2 * 256 * 1024 and c["router"] == 256 * 8
    assert c["total"] == 8 * c["expert"] + c["router"] and c["active"] == 2 * c["expert"] + c["router"]
    assert c["flops_per_token"] == 2 * c["active"]
    assert moe_param_counts(256, 1024, 8, 2, activation="swiglu")["expert"] == 3 * 256 * 1024
    moe = MoE(256, 1024, 8, 2)
    assert sum(p.numel() for p in moe.parameters()) == c["total"]


def test_param_counts_for_mixtral_8x7b_equal_hugging_face_and_the_published_active_count():
    from transformers import MixtralConfig, MixtralForCausalLM

    c = moe_param_counts(**MIXTRAL_8X7B)
    config = MixtralConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):  # shapes only: 46.7 B parameters would not fit in memory
        model = MixtralForCausalLM(config)
    assert c["total"] == sum(p.numel() for p in model.parameters())
    assert round(c["total"] / 1e9, 1) == 46.7 and round(c["active"] / 1e9, 1) == 12.9  # Mistral AI's figures


# --------------------------------------------------------------------------- bad input
_K = "top_k must be <= num_experts (each token picks K distinct experts), got top_k="
_CAPACITY = "capacity_factor must be a finite number > 0 or None, got"
_GATINGS = "('topk_softmax', 'softmax_topk', 'softmax_topk_raw')"
LAYER_REFUSALS = [
    ("top_k", 7, ValueError, f"{_K}7, num_experts=6"),
    ("top_k", 0, ValueError, "top_k must be >= 1, got 0"),
    ("num_experts, top_k", (0, 1), ValueError, "num_experts must be >= 1, got 0"),
    ("d_model", 0, ValueError, "d_model must be >= 1, got 0"),
    ("d_ff", 2.0, TypeError, "d_ff must be an int, got float"),
    ("capacity_factor", 0, ValueError, f"{_CAPACITY} 0"),
    ("capacity_factor", -1.5, ValueError, f"{_CAPACITY} -1.5"),
    ("dispatch", "scatter", ValueError, "dispatch must be one of ('grouped', 'loop'), got 'scatter'"),
    ("gating", "sigmoid", ValueError, f"gating must be one of {_GATINGS}, got 'sigmoid'"),
    ("activation", "relu", ValueError, "activation must be one of ('gelu', 'silu', 'swiglu'), got 'relu'"),
]
test_layer_refusals = refusal_test(MoE, dict(d_model=16, d_ff=32, num_experts=6, top_k=2), LAYER_REFUSALS)


_X = "x must have shape (B, T, self.d_model)"
# fmt: off
FORWARD_REFUSALS = [
    ("x", torch.zeros(2, 3, 8), ValueError, f"{_X} with self.d_model = 16, got (2, 3, 8)"),
    ("x", torch.zeros(6, 16), ValueError, f"{_X} (3 dims), got (6, 16)"),
    ("x", torch.zeros(0, 3, 16), ValueError, f"{_X} with every size >= 1, got (0, 3, 16)"),
    ("x", torch.ones(2, 3, 16, dtype=torch.long), TypeError, not_float("x")),
    ("x", torch.zeros(2, 3, 16).double(), ValueError,
     "x must match the layer's weights (torch.float32 on cpu), got torch.float64 on cpu"),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message", rows(FORWARD_REFUSALS))
@pytest.mark.parametrize("forward", ["forward", "moe_ref"])
def test_forward_refusals(forward, argument, bad, error, message):
    moe = _layer()
    call = moe if forward == "forward" else (lambda x: moe_ref(moe, x))
    assert_refuses(call, {}, argument, bad, error, message)


def test_attributes_are_checked_when_set():
    moe = _layer()
    with pytest.raises(ValueError, match=r"dispatch must be one of \('grouped', 'loop'\), got 'fast'"):
        moe.dispatch = "fast"
    with pytest.raises(ValueError, match=f"{_CAPACITY} 0.0"):
        moe.capacity_factor = 0.0
    with pytest.raises(TypeError, match="capacity_factor must be a real number or None, got str"):
        moe.capacity_factor = "1.25"


_E = "top_k must be <= the number of experts E, got top_k="
_LOGITS = "logits must have shape (N, E) (2 dims), got"
# fmt: off
OTHER_REFUSALS = [
    (route_top_k, dict(logits=torch.zeros(4, 3, 2), top_k=1), ValueError, f"{_LOGITS} (4, 3, 2)"),
    (route_top_k, dict(logits=torch.zeros(4, 3), top_k=4), ValueError, f"{_E}4, E=3"),
    (route_top_k, dict(logits=torch.zeros(4, 3), top_k=0), ValueError, "top_k must be >= 1, got 0"),
    (route_top_k, dict(logits=torch.zeros(4, 3), top_k=1, gating="softmax"), ValueError,
     f"gating must be one of {_GATINGS}, got 'softmax'"),
    (route_top_k, dict(logits=torch.zeros(4, 3, dtype=torch.long), top_k=1), TypeError, not_float("logits")),
    (switch_loss, dict(logits=torch.zeros(4, 3), top_k=5), ValueError, f"{_E}5, E=3"),
    (switch_loss, dict(logits=torch.zeros(12), top_k=1), ValueError, f"{_LOGITS} (12,)"),
    (load_balancing_loss, dict(router_logits=torch.zeros(5, 4), top_k=5), ValueError, f"{_E}5, E=4"),
    (load_balancing_loss, dict(router_logits=[], top_k=1), ValueError,
     "router_logits must hold at least one layer's (N, E) logits, got an empty sequence"),
    (
        load_balancing_loss,
        dict(router_logits=[torch.zeros(5, 4), torch.zeros(5, 6)], top_k=1),
        ValueError,
        "router_logits[1] must have shape (N, E) or (B, T, E) with E = 4 as in router_logits[0] and hold a token, "
        "got (5, 6)",
    ),
    (load_balancing_loss, dict(router_logits=torch.zeros(5, 4), top_k=1, pooled="yes"), TypeError,
     "pooled must be a bool, got str"),
    (router_z_loss, dict(router_logits=torch.zeros(5)), ValueError,
     "router_logits must have shape (N, E) or (B, T, E) and hold a token, got (5,)"),
    (expert_capacity, dict(num_tokens=10, num_experts=4, top_k=1, capacity_factor=0), ValueError, f"{_CAPACITY} 0"),
    (moe_param_counts, dict(d_model=16, d_ff=32, num_experts=2, top_k=3), ValueError, f"{_K}3, num_experts=2"),
    (moe_param_counts, dict(d_model=16, d_ff=32, num_experts=2, top_k=1, n_head=5), ValueError,
     "d_model (16) must be divisible by n_head (5), and n_head by n_kv_head (5)"),
]
# fmt: on


@pytest.mark.parametrize("fn, args, error, message", OTHER_REFUSALS, ids=lambda v: getattr(v, "__name__", None))
def test_routing_losses_and_counts_refusals(fn, args, error, message):
    with pytest.raises(error) as info:
        fn(**args)
    assert str(info.value) == message


def test_switch_loss_of_one_layer_is_load_balancing_loss_of_that_layer():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(switch_loss(logits, 2), load_balancing_loss(logits, 2))
    gates, experts = route_top_k(logits, 2)
    top = logits.topk(2, dim=-1)
    assert torch.equal(experts, top.indices) and torch.allclose(gates, top.values.softmax(-1))
