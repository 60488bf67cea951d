"""Build track 07 (the MoE layer): each check passes a correct solution, refuses the stub, and names
the mistake in at least three plausible wrong versions of its step; the checks' references agree
with Hugging Face's Mixtral and with lib.moe."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import lib.course.exercises.build07 as checks
from lib.moe import MoE, load_balancing_loss, moe_from_mixtral, route_top_k


# --------------------------------------------------------------------------- solutions (as the track's)
def my_router(x, router_weight, top_k):
    B, T, C = x.shape
    router_logits = x.reshape(B * T, C) @ router_weight.T
    probs = torch.softmax(router_logits.float(), dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    return router_logits, gates / gates.sum(dim=-1, keepdim=True), experts


def router_softmax_of_top_k(x, router_weight, top_k):
    """The softmax over the K selected logits: the same gates as Mixtral's (a right answer too)."""
    logits = x.reshape(-1, x.shape[-1]) @ router_weight.T
    top = logits.topk(top_k, dim=-1)
    return logits, torch.softmax(top.values.float(), dim=-1), top.indices


def my_dispatch(experts, num_experts):
    return [torch.where(experts == e) for e in range(num_experts)]


def my_combine(h, gates, routes, w1, w3, w2):
    y = torch.zeros_like(h)
    for e, (tokens, slots) in enumerate(routes):
        if tokens.numel() == 0:
            continue
        xe = h[tokens]
        out = (F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e]
        y.index_add_(0, tokens, out * gates[tokens, slots, None])
    return y


def moe_class(
    router=my_router,
    dispatch=my_dispatch,
    combine=my_combine,
    *,
    router_name="router",
    no_grad_routing=False,
    return_tuple=True,
    flat_y=False,
):
    class MyMoE(nn.Module):
        def __init__(self, d_model, d_ff, num_experts, top_k):
            super().__init__()
            C, Fh, E = d_model, d_ff, num_experts
            self.num_experts, self.top_k = E, top_k
            setattr(self, router_name, nn.Linear(C, E, bias=False))
            self.w1 = nn.Parameter(torch.empty(E, C, Fh).uniform_(-(C**-0.5), C**-0.5))
            self.w3 = nn.Parameter(torch.empty(E, C, Fh).uniform_(-(C**-0.5), C**-0.5))
            self.w2 = nn.Parameter(torch.empty(E, Fh, C).uniform_(-(Fh**-0.5), Fh**-0.5))

        def forward(self, x):
            B, T, C = x.shape
            weight = getattr(self, router_name).weight
            if no_grad_routing:
                with torch.no_grad():
                    router_logits, gates, experts = router(x, weight, self.top_k)
            else:
                router_logits, gates, experts = router(x, weight, self.top_k)
            routes = dispatch(experts, self.num_experts)
            y = combine(x.reshape(B * T, C), gates.to(x.dtype), routes, self.w1, self.w3, self.w2)
            y = y if flat_y else y.view(B, T, C)
            return (y, router_logits) if return_tuple else y

    return MyMoE


def my_balance_loss(router_logits, top_k):
    losses = []
    for logits in router_logits:
        N, E = logits.shape
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = logits.topk(top_k, dim=-1).indices
        f = torch.bincount(chosen.reshape(-1), minlength=E).float() / N
        losses.append(E * (f * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


SOLUTIONS = {
    "check_router": my_router,
    "check_dispatch": my_dispatch,
    "check_combine": my_combine,
    "check_moe_layer": moe_class(),
    "check_layer_balance_loss": my_balance_loss,
}


# --------------------------------------------------------------------------- wrong versions
def router_raw_gates(x, router_weight, top_k):
    logits = x.reshape(-1, x.shape[-1]) @ router_weight.T
    gates, experts = torch.softmax(logits.float(), -1).topk(top_k, dim=-1)
    return logits, gates, experts


def router_unflattened(x, router_weight, top_k):
    logits, gates, experts = my_router(x, router_weight, top_k)
    return logits.view(*x.shape[:2], -1), gates, experts


def router_returns_probabilities(x, router_weight, top_k):
    logits, gates, experts = my_router(x, router_weight, top_k)
    return torch.softmax(logits, -1), gates, experts


def router_softmax_twice(x, router_weight, top_k):
    logits = x.reshape(-1, x.shape[-1]) @ router_weight.T
    top, experts = torch.softmax(logits.float(), -1).topk(top_k, dim=-1)
    return logits, torch.softmax(top, dim=-1), experts


def router_softmax_over_tokens(x, router_weight, top_k):
    logits = x.reshape(-1, x.shape[-1]) @ router_weight.T
    gates, experts = torch.softmax(logits.float(), dim=0).topk(top_k, dim=-1)
    return logits, gates / gates.sum(-1, keepdim=True), experts


def router_smallest(x, router_weight, top_k):
    logits = x.reshape(-1, x.shape[-1]) @ router_weight.T
    gates, experts = torch.softmax(logits.float(), -1).topk(top_k, dim=-1, largest=False)
    return logits, gates / gates.sum(-1, keepdim=True), experts


def dispatch_skips_idle(experts, num_experts):
    return [torch.where(experts == e) for e in range(num_experts) if bool((experts == e).any())]


def dispatch_swapped(experts, num_experts):
    return [tuple(reversed(torch.where(experts == e))) for e in range(num_experts)]


def dispatch_first_choice(experts, num_experts):
    return [torch.where(experts[:, :1] == e) for e in range(num_experts)]


def dispatch_tokens_only(experts, num_experts):
    return [torch.where(experts == e)[0] for e in range(num_experts)]


def combine_variant(**kw):
    def combine(h, gates, routes, w1, w3, w2):
        experts = torch.full(gates.shape, -1, dtype=torch.long)
        for e, (tokens, slots) in enumerate(routes):
            experts[tokens, slots] = e
        return checks._combine_variant(h, gates, experts, w1, w3, w2, **kw)

    return combine


def combine_stacks_outputs(h, gates, routes, w1, w3, w2):
    """Collects every expert's rows and stacks them: torch.cat of an empty expert's (0, C) is fine,
    but this version indexes each expert's first token to size its buffer."""
    y = torch.zeros_like(h)
    for e, (tokens, slots) in enumerate(routes):
        first = int(tokens[0])  # IndexError for an expert with no token
        xe = h[tokens]
        out = (F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e]
        y.index_add_(0, tokens, out * gates[tokens, slots, None] + 0 * first)
    return y


def dispatch_bincount(experts, num_experts):
    """The grouped dispatch with torch.bincount but no minlength: the last experts' counts are missing."""
    flat = experts.reshape(-1)
    counts = torch.bincount(flat).tolist()
    order = torch.argsort(flat, stable=True)
    out, start = [], 0
    for e in range(num_experts):
        a = order[start : start + counts[e]]  # IndexError when expert e >= the largest expert used
        start += counts[e]
        out.append((a // experts.shape[1], a % experts.shape[1]))
    return out


def balance_pooled(router_logits, top_k):
    return my_balance_loss([torch.cat(list(router_logits))], top_k)


def balance_top1_f(router_logits, top_k):
    losses = []
    for logits in router_logits:
        N, E = logits.shape
        f = torch.bincount(logits.argmax(-1), minlength=E).float() / N
        losses.append(E * (f * torch.softmax(logits, -1).mean(0)).sum())
    return torch.stack(losses).mean()


def balance_summed_layers(router_logits, top_k):
    return my_balance_loss(router_logits, top_k) * len(router_logits)


def balance_item(router_logits, top_k):
    return my_balance_loss(router_logits, top_k).item()


def balance_detached(router_logits, top_k):
    return my_balance_loss([t.detach() for t in router_logits], top_k)


WRONG_VERSIONS = {
    "check_router": [
        (router_raw_gates, "not renormalised"),
        (router_unflattened, "flatten"),
        (router_returns_probabilities, "probabilities"),
        (router_softmax_twice, "softmax applied twice"),
        (router_softmax_over_tokens, "not over the tokens"),
        (router_smallest, "largest"),
    ],
    "check_dispatch": [
        (dispatch_skips_idle, "receive no token"),
        (dispatch_swapped, "swapped"),
        (dispatch_first_choice, "first choice"),
        (dispatch_tokens_only, "pair"),
    ],
    "check_combine": [
        (combine_variant(use_gates=False), "by its gate"),
        (combine_variant(swap=True), "SiLU goes on"),
        (combine_variant(overwrite=True), "keeps only the last"),
        (combine_variant(act=F.gelu), "not GELU"),
        (combine_variant(up=False), "up projection"),
        (combine_variant(divide=2), "not a mean"),
        (combine_stacks_outputs, "idle expert must not break"),
    ],
    "check_moe_layer": [
        (moe_class(router=router_raw_gates), "not renormalised"),
        (moe_class(combine=combine_variant(use_gates=False)), "without their gates"),
        (moe_class(dispatch=dispatch_bincount), "idle expert must not break"),
        (moe_class(dispatch=dispatch_first_choice), "first choice"),
        (moe_class(router_name="gate"), "router.weight"),
        (moe_class(no_grad_routing=True), "no gradient"),
        (moe_class(return_tuple=False), "tuple"),
        (moe_class(flat_y=True), "reshape"),
    ],
    "check_layer_balance_loss": [
        (balance_pooled, "pooled"),
        (balance_top1_f, "top-1"),
        (balance_summed_layers, "mean"),
        (balance_item, "tensor"),
        (balance_detached, "gradient"),
    ],
}


def test_the_layer_check_says_which_earlier_step_is_unfinished():
    def unwritten_combine(h, gates, routes, w1, w3, w2):
        raise NotImplementedError

    report = checks.check_moe_layer(moe_class(combine=unwritten_combine))
    assert not report.passed and "unwritten_combine is not written yet" in report.problem, report
    assert "finish that step first" in report.hint


# --------------------------------------------------------------------------- the references themselves
def test_softmax_over_the_selected_logits_passes_too():
    """Mixtral's softmax-then-renormalise and the softmax over the K chosen logits are one function."""
    assert checks.check_router(router_softmax_of_top_k).passed


def test_the_router_reference_is_hugging_faces_and_equals_lib_softmax_topk():
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    router = MixtralTopKRouter(checks._mixtral_config(8, 4, 6, 2))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        router.weight.normal_()
        logits, gates, experts = router(x)
    lib_gates, lib_experts = route_top_k(logits, 2, "softmax_topk")
    assert torch.equal(lib_experts, experts)
    torch.testing.assert_close(lib_gates, gates, atol=1e-6, rtol=0)  # fp32 softmax of 6 values


def test_the_combine_reference_is_hugging_faces_experts_and_equals_lib():
    torch.manual_seed(0)
    moe = MoE(8, 12, 4, 2, activation="swiglu", gating="softmax_topk", dispatch="loop")
    h = torch.randn(7, 8)
    gates, experts = moe.route(moe.router(h))
    hf = checks._hf_experts(moe.w1.detach(), moe.w3.detach(), moe.w2.detach(), 2)
    with torch.no_grad():
        y_lib, _ = moe(h.view(1, 7, 8))
        y_hf = hf(h, experts, gates)
    torch.testing.assert_close(y_hf, y_lib.view(7, 8), atol=1e-5, rtol=0)  # fp32, another summation order


def test_the_layer_check_compares_with_hugging_faces_block():
    """A layer that equals lib.moe.MoE with the default gating (softmax over the K chosen logits) is
    Mixtral's layer too; one built for Switch's raw gates is refused on the Mixtral case itself."""
    report = checks.check_moe_layer(moe_class(router=router_softmax_of_top_k))
    assert report.passed, report
    report = checks.check_moe_layer(moe_class(router=router_raw_gates))
    assert "MixtralSparseMoeBlock" in report.failed_case and "Hugging Face" in report.problem


def test_loading_mixtral_into_the_learners_layer_by_name():
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(1)
    block = MixtralSparseMoeBlock(checks._mixtral_config(16, 24, 4, 2)).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    layer = moe_class()(16, 24, 4, 2)
    assert checks._load(layer, moe_from_mixtral(block)) is None
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], block(x), atol=1e-5, rtol=0)


def test_the_balance_check_uses_layers_where_pooling_is_blind():
    layers = checks._mirrored_layers()
    pooled = load_balancing_loss(layers, 1, pooled=True)
    assert abs(pooled.item() - 1.0) < 1e-6 and load_balancing_loss(layers, 1).item() > 1.3
