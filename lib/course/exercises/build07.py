"""Checks for build track 07, "the MoE layer" (lessons/build/07-build-moe.md).

    check_router(fn)              fn(x (B, T, C), router_weight (E, C), top_k) -> (router_logits
                                  (B·T, E), gates (B·T, K), experts (B·T, K)), equal to Hugging
                                  Face's MixtralTopKRouter and to lib.moe's "softmax_topk" gating
    check_dispatch(fn)            fn(experts (N, K), num_experts) -> E pairs (tokens, slots): which
                                  token's which slot goes to expert e (empty for an idle expert)
    check_combine(fn)             fn(h (N, C), gates (N, K), routes, w1, w3, w2) -> y (N, C): the
                                  SwiGLU experts on their tokens, weighted by the gates, summed per
                                  token; equal to Hugging Face's MixtralExperts
    check_moe_layer(cls)          MyMoE(d_model, d_ff, num_experts, top_k), forward(x) -> (y
                                  (B, T, C), router_logits (B·T, E)), equal to lib.moe.MoE (swiglu,
                                  softmax_topk) and to Hugging Face's MixtralSparseMoeBlock
    check_layer_balance_loss(fn)  fn([router_logits (N, E) per layer], top_k) -> the Switch loss
                                  per layer, averaged: lib.moe.load_balancing_loss(pooled=False)

Every check runs the learner's code on crafted cases (an expert that gets no token, one token,
top-1, negative logits), compares with the library and, where the step has one, with Hugging
Face's Mixtral modules (transformers 5.x, built from a tiny random config: nothing downloaded),
and names the mistake it recognises. Glossary: B batch, T tokens per row, N = B·T tokens,
C model width, F expert hidden width, E experts, K experts per token.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib.course.exercises import CheckReport, call_learner
from lib.moe import MoE, load_balancing_loss, moe_from_mixtral, route_top_k

__all__ = ["check_combine", "check_dispatch", "check_layer_balance_loss", "check_moe_layer", "check_router"]

# fp32 throughout: a router logit is a C <= 16 term dot product and a gate a softmax over E <= 8
# values (~1e-7 relative); an expert output sums F <= 24 products, and a token adds K <= 3 of
# them in whatever order the learner's loop takes (HF's and lib's orders differ too): 1e-5 is a
# wide margin, and every mistake the checks name moves the outputs by 1e-2 or more.
TOL = dict(atol=1e-5, rtol=1e-5)


class EarlierStep(Exception):
    """An earlier step's stub raised inside this step's code."""


EARLIER_STEP_HINT = "finish that step first: this step runs your earlier steps' code"


def guard_earlier_steps(obj):
    """obj's call, where a stub raising in another step's code (not in obj's own function or
    methods) becomes EarlierStep naming that code, so that a report says which step is
    unfinished instead of "not attempted yet". (Track 08's checks use it too.)"""
    if not callable(obj):
        return obj
    owner = obj if isinstance(obj, type) else type(obj) if isinstance(obj, nn.Module) else None
    if owner is not None:
        own = {f.__code__ for f in vars(owner).values() if hasattr(f, "__code__")}
    else:
        own = {getattr(obj, "__code__", None)}

    def call(*args):
        unfinished = None
        try:
            return obj(*args)
        except NotImplementedError as err:
            tb = err.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            code = tb.tb_frame.f_code
            if code in own:
                raise
            unfinished = getattr(code, "co_qualname", code.co_name)
        # raised outside `except`, so that no NotImplementedError is chained to it
        raise EarlierStep(f"{unfinished} is not written yet (its stub still raises)")

    return call


def _idle_hint(idle: list[int]) -> str:
    """The hint for an exception in a case where some experts receive no token."""
    which = f"expert {idle[0]}" if len(idle) == 1 else "experts " + ", ".join(map(str, idle))
    verb = "gets" if len(idle) == 1 else "get"
    return (
        f"in this case {which} {verb} no token, and an idle expert must not break the layer: "
        "skip it when its token list is empty, or make sure your code works on 0 rows "
        "(torch.bincount needs minlength=E)"
    )


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seeded(seed: int, make):
    """make() with torch's global generator seeded, the caller's generator left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def _mixtral_config(C: int, F_: int, E: int, K: int):
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=C, intermediate_size=F_, num_local_experts=E, num_experts_per_tok=K)
    config._experts_implementation = "eager"  # the plain per-expert loop (standalone: none set)
    return config


def _is_tensors(got, n: int) -> bool:
    return isinstance(got, (tuple, list)) and len(got) == n and all(isinstance(t, torch.Tensor) for t in got)


def _close(a: torch.Tensor, b: torch.Tensor, **tol) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), **(tol or TOL)))


def _by_expert(gates: torch.Tensor, experts: torch.Tensor):
    """Each row's (expert, gate) pairs sorted by expert id: the same choice in any slot order."""
    order = experts.long().argsort(dim=-1)
    return gates.gather(-1, order), experts.long().gather(-1, order)


# --------------------------------------------------------------------------- 7.1 the router
def check_router(fn) -> CheckReport:
    """fn(x, router_weight, top_k) -> (router_logits (N, E), gates (N, K), experts (N, K)) as
    Mixtral: softmax over all E in fp32, the K largest probabilities, divided by their sum."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    name = "Step 7.1 (the router)"
    specs = [
        ("B=2, T=5, C=8, E=4, top-2 (against Hugging Face's MixtralTopKRouter)", 2, 5, 8, 4, 2, 1.0),
        ("one token (B=1, T=1), E=8, top-2", 1, 1, 8, 8, 2, 1.0),
        ("top-3 of 6 experts, B=3, T=3", 3, 3, 8, 6, 3, 1.0),
        ("top-1 of 3 experts, large negative logits", 2, 4, 8, 3, 1, 30.0),
    ]
    n = len(specs)
    for i, (case, B, T, C, E, K, scale) in enumerate(specs):
        g = _gen(10 + i)
        x = torch.randn(B, T, C, generator=g) * scale
        w = torch.randn(E, C, generator=g) * 0.5
        if scale > 1:  # positive weights, negative inputs: every logit is large and negative
            w, x = w.abs(), -x.abs()
        hf = MixtralTopKRouter(_mixtral_config(C, 4, E, K))
        with torch.no_grad():
            hf.weight.copy_(w)
            logits, gates, experts = hf(x)  # (N, E), (N, K) fp32, (N, K)
        got, report = call_learner(name, fn, (x.clone(), w.clone(), K), case, n)
        if report is not None:
            return report
        problem, hint = _router_problem(got, x, K, logits, gates, experts)
        if problem:
            return CheckReport(name, False, n, case, problem, hint)
    return CheckReport(name, True, n)


def _router_problem(got, x, K, logits, gates, experts):
    B, T, C = x.shape
    N, E = logits.shape
    if not _is_tensors(got, 3):
        return (
            f"returned {type(got).__name__}, expected a tuple (router_logits, gates, experts)",
            "return all three: the logits feed the balance loss, the gates and experts the dispatch",
        )
    g_logits, g_gates, g_experts = got
    if g_logits.shape == (B, T, E):
        return (
            "router_logits have shape (B, T, E)",
            "flatten the tokens first, x.reshape(B * T, C): Mixtral's router returns (B·T, E), one row per token",
        )
    if g_logits.shape != (N, E):
        return (
            f"router_logits have shape {tuple(g_logits.shape)}, expected {(N, E)}",
            "router_logits = x (B·T, C) @ router_weight.T (C, E)",
        )
    if not _close(g_logits, logits):
        if _close(g_logits, torch.softmax(logits, -1)):
            return (
                "router_logits are probabilities",
                "return the raw scores x·Wᵀ before any softmax: the balance loss and the z-loss take logits",
            )
        return (
            "wrong router_logits",
            "router_logits = x.reshape(B·T, C) @ router_weight.T: the weight is (E, C), as nn.Linear(C, E) stores it",
        )
    if g_gates.shape != (N, K) or g_experts.shape != (N, K):
        return (
            f"gates {tuple(g_gates.shape)} and experts {tuple(g_experts.shape)}, expected both {(N, K)}",
            "keep the top_k per token: probs.topk(top_k, dim=-1)",
        )
    if g_experts.is_floating_point():
        return "experts hold floats", "experts are indices: the .indices of topk (int64)"
    want_g, want_e = _by_expert(gates, experts)
    got_g, got_e = _by_expert(g_gates.to(gates.dtype), g_experts)
    if not torch.equal(got_e, want_e):
        smallest = logits.topk(K, dim=-1, largest=False).indices
        if torch.equal(got_e, _by_expert(gates, smallest)[1]):
            return ("wrong experts: the K smallest", "topk keeps the largest by default: do not pass largest=False")
        by_tokens = torch.softmax(logits, dim=0).topk(K, dim=-1).indices
        if torch.equal(got_e, _by_expert(gates, by_tokens)[1]):
            return (
                "wrong experts",
                "the softmax runs over each token's E experts (dim=-1), not over the tokens (dim=0)",
            )
        return ("wrong experts", "each token's K experts are those with the largest logits (equally: probabilities)")
    if g_gates.dtype != torch.float32:
        return (
            f"gates have dtype {g_gates.dtype}",
            "Mixtral takes the softmax in float32: softmax(router_logits.float(), dim=-1)",
        )
    if _close(got_g, want_g):
        return None, None
    probs = torch.softmax(logits.float(), dim=-1)
    raw = probs.gather(-1, experts)
    variants = [
        (
            raw,
            "the gates are not renormalised: Mixtral takes the softmax over all E logits, keeps "
            "the K largest probabilities, then divides them by their sum, so each token's gates "
            "sum to 1 (Switch and Qwen2-MoE's norm_topk_prob=False keep them raw)",
        ),
        (
            torch.softmax(raw, dim=-1),
            "softmax applied twice: the K kept values are already "
            "probabilities; renormalise them by dividing by their sum",
        ),
        (
            logits.gather(-1, experts),
            "the gates are the raw logits: turn them into "
            "probabilities (softmax over all E, then top-K and "
            "renormalise, as Mixtral)",
        ),
        (
            torch.softmax(logits, dim=0).gather(-1, experts),
            "the softmax ran over the tokens (dim=0): normalise each token's E logits (dim=-1)",
        ),
    ]
    for variant, hint in variants:
        if _close(got_g, _by_expert(variant, experts)[0]):
            return "wrong gates", hint
    return (
        "wrong gates",
        "gates = softmax(router_logits, dim=-1) in float32, topk(K), then "
        "divided by their sum (equal to the softmax over the K selected logits alone)",
    )


# --------------------------------------------------------------------------- 7.2 dispatch
def _pairs(tokens: torch.Tensor, slots: torch.Tensor) -> list[tuple[int, int]]:
    return sorted(zip(tokens.long().tolist(), slots.long().tolist()))


def check_dispatch(fn) -> CheckReport:
    """fn(experts (N, K), num_experts) -> a list of E pairs (tokens (n_e,), slots (n_e,)) with
    experts[tokens, slots] == e: every assignment of expert e, an empty pair for an idle expert."""
    name = "Step 7.2 (dispatch: which tokens go to which expert)"
    rand = torch.randn(20, 5, generator=_gen(3)).topk(2, dim=-1).indices  # (20, 2)
    cases = [
        ("top-1: 5 tokens, 3 experts, expert 1 gets no token", torch.tensor([[0], [2], [0], [2], [0]]), 3),
        (
            "top-2 of 6 experts: experts 1 and 5 (the last) get no token",
            torch.tensor([[0, 2], [3, 4], [2, 0], [4, 3], [0, 3], [2, 4], [3, 0]]),
            6,
        ),
        ("one token, top-2 of 4", torch.tensor([[3, 1]]), 4),
        ("20 tokens, top-2 of 5, from random logits", rand, 5),
    ]
    n = len(cases)
    for case, experts, E in cases:
        got, report = call_learner(name, fn, (experts.clone(), E), case, n)
        if report is not None:
            return report
        problem, hint = _dispatch_problem(got, experts, E)
        if problem:
            return CheckReport(name, False, n, case, problem, hint)
    return CheckReport(name, True, n)


def _dispatch_problem(got, experts, E):
    used = len(set(experts.reshape(-1).tolist()))
    if isinstance(got, torch.Tensor) or not isinstance(got, (list, tuple)):
        return (
            f"returned {type(got).__name__}, expected a list of E = {E} pairs (tokens, slots)",
            "one entry per expert e: torch.where(experts == e) gives its (tokens, slots)",
        )
    if len(got) != E:
        if len(got) == used:
            return (
                f"{len(got)} entries for E = {E} experts",
                "the experts that receive no token "
                "are missing: keep an empty (tokens, slots) pair for each, so that entry e "
                "always belongs to expert e",
            )
        return (f"{len(got)} entries for E = {E} experts", "one (tokens, slots) pair per expert, E of them, in order")
    for e, entry in enumerate(got):
        want = torch.where(experts == e)  # (tokens, slots)
        if isinstance(entry, torch.Tensor):
            return (
                f"entry {e} is one tensor, expected a pair (tokens, slots)",
                "return both: the slot k says which of the token's K gates weighs this "
                "expert's output (torch.where(experts == e) returns the pair; .nonzero() gives "
                "it as (n, 2) columns)",
            )
        if not _is_tensors(entry, 2) or entry[0].dim() != 1 or entry[0].shape != entry[1].shape:
            return (
                f"entry {e} is not a pair of 1-D tensors of one length",
                "each entry: (tokens (n_e,), slots (n_e,)), e.g. torch.where(experts == e)",
            )
        tokens, slots = entry
        if tokens.is_floating_point() or slots.is_floating_point():
            return (f"entry {e} holds floats", "tokens and slots are indices: int64 tensors (torch.where gives them)")
        if _pairs(tokens, slots) == _pairs(*want):
            continue
        if _pairs(slots, tokens) == _pairs(*want):
            return (
                f"expert {e}: tokens and slots swapped",
                "on experts == e, an (N, K) mask, torch.where returns (token rows, slot "
                "columns) in that order (Mixtral's own mask is (E, K, N), so there torch.where "
                "gives (slot, token))",
            )
        first = torch.where(experts[:, :1] == e)
        if experts.shape[1] > 1 and _pairs(tokens, slots) == _pairs(*first):
            return (
                f"expert {e}: only the tokens whose first choice it is",
                "every token goes to all K of its experts: search every slot, experts == e over (N, K)",
            )
        got_tokens, want_tokens = sorted(tokens.long().tolist()), sorted(want[0].tolist())
        if got_tokens == want_tokens:
            return (
                f"expert {e}: the right tokens with the wrong slots",
                "slot k is the column where experts[t, k] == e",
            )
        return (
            f"expert {e}: wrong tokens ({got_tokens}, expected {want_tokens})",
            "expert e gets every (token t, slot k) with experts[t, k] == e",
        )
    return None, None


# --------------------------------------------------------------------------- 7.3 experts, combine
def _hf_experts(w1, w3, w2, K):
    """Hugging Face's MixtralExperts holding w1, w3 (E, C, F) and w2 (E, F, C), its fused layout."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    E, C, F_ = w1.shape
    experts = MixtralExperts(_mixtral_config(C, F_, E, K))
    with torch.no_grad():
        gate_up = torch.cat([w1.transpose(1, 2), w3.transpose(1, 2)], dim=1)  # (E, 2F, C)
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(w2.transpose(1, 2))  # (E, F, C) -> (E, C, F)
    return experts


def _combine_variant(
    h, gates, experts, w1, w3, w2, *, act=F.silu, swap=False, use_gates=True, up=True, overwrite=False, divide=1
):
    """Plausible versions of the combine, computed per expert in fp32 (the right one by default)."""
    y = torch.zeros_like(h)
    for e in range(w1.shape[0]):
        tok, slot = torch.where(experts == e)
        if tok.numel() == 0:
            continue
        a, b = (w3[e], w1[e]) if swap else (w1[e], w3[e])
        z = act(h[tok] @ a) * (h[tok] @ b) if up else act(h[tok] @ a)
        out = z @ w2[e]  # (n_e, C)
        if use_gates:
            out = out * gates[tok, slot, None]
        if overwrite:
            y[tok] = out
        else:
            y.index_add_(0, tok, out)
    return y / divide


def _combine_hint(got, h, gates, experts, w1, w3, w2) -> str:
    K = experts.shape[1]
    silu = "SwiGLU's activation is SiLU (x·sigmoid(x), torch.nn.functional.silu)"
    variants = [
        (
            dict(use_gates=False),
            "weight each expert's output by its gate, gates[tokens, slots, None], before adding it to the token's row",
        ),
        (
            dict(swap=True),
            "SiLU goes on x·w1 (Mixtral's gate projection); x·w3 (the up "
            "projection) multiplies it: (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]",
        ),
        (dict(act=F.gelu), f"{silu}, not GELU"),
        (dict(act=F.relu), f"{silu}, not ReLU"),
        (dict(up=False), "SwiGLU multiplies silu(x @ w1[e]) by the up projection x @ w3[e] before w2[e]"),
        (
            dict(overwrite=True),
            "add each expert's weighted output into its tokens' rows "
            "(y.index_add_(0, tokens, out) or y[tokens] += out): with K = 2 a "
            "token gets two experts' outputs, and `y[tokens] = out` keeps only "
            "the last",
        ),
        (dict(divide=K), "a weighted sum, not a mean: the gates already sum to 1, so do not divide by K"),
    ]
    for kw, hint in variants:
        if K == 1 and "divide" in kw:
            continue
        if _close(got, _combine_variant(h, gates, experts, w1, w3, w2, **kw)):
            return hint
    return "y[t] = Σ_k gates[t, k] · (silu(h[t] @ w1[e]) * (h[t] @ w3[e])) @ w2[e], e = experts[t, k]"


def check_combine(fn) -> CheckReport:
    """fn(h (N, C), gates (N, K), routes, w1 (E, C, F), w3 (E, C, F), w2 (E, F, C)) -> y (N, C);
    routes = [(tokens, slots) for each expert], as Step 7.2 returns them."""
    name = "Step 7.3 (the experts and the combine)"
    C, F_ = 8, 12
    specs = [
        ("6 tokens, top-2 of 4 experts (against Hugging Face's MixtralExperts)", 6, 4, 2, None),
        ("experts 1 and 3 get no token (top-2 of 4)", 5, 4, 2, [0, 2]),
        ("top-1 of 3 experts: each token's gate is 1", 4, 3, 1, None),
        ("one token, top-2 of 4", 1, 4, 2, None),
    ]
    n = len(specs)
    for i, (case, N, E, K, allowed) in enumerate(specs):
        g = _gen(20 + i)
        h = torch.randn(N, C, generator=g)
        w1 = torch.randn(E, C, F_, generator=g) * 0.4
        w3 = torch.randn(E, C, F_, generator=g) * 0.4
        w2 = torch.randn(E, F_, C, generator=g) * 0.4
        logits = torch.randn(N, E, generator=g) * 2
        if allowed is not None:  # only these experts can be chosen
            blocked = torch.ones(E, dtype=torch.bool)
            blocked[allowed] = False
            logits[:, blocked] = -1e4
        gates, experts = route_top_k(logits, K, "softmax_topk")  # (N, K) each
        routes = [torch.where(experts == e) for e in range(E)]
        with torch.no_grad():
            expected = _hf_experts(w1, w3, w2, K)(h, experts, gates)  # (N, C)
        args = (
            h.clone(),
            gates.clone(),
            [(t.clone(), s.clone()) for t, s in routes],
            w1.clone(),
            w3.clone(),
            w2.clone(),
        )
        got, report = call_learner(name, fn, args, case, n)
        if report is not None:
            idle = [e for e, (t, _) in enumerate(routes) if t.numel() == 0]
            if idle and report.problem != "not attempted yet":
                report.hint = _idle_hint(idle)
            return report
        fail = lambda problem, hint=None, case=case: CheckReport(  # noqa: E731
            name, False, n, case, problem, hint
        )
        if not isinstance(got, torch.Tensor):
            return fail(f"returned {type(got).__name__}, expected a tensor (N, C)", "did you forget a `return`?")
        if got.shape != (N, C):
            return fail(
                f"returned shape {tuple(got.shape)}, expected {(N, C)}",
                "one output row per token: start from y = torch.zeros_like(h), add into it",
            )
        if not _close(got, expected):
            return fail("wrong values", _combine_hint(got, h, gates, experts, w1, w3, w2))
    return CheckReport(name, True, n)


# --------------------------------------------------------------------------- 7.4 the layer
EXPECTED_PARAMETERS = "router.weight (E, C), w1 (E, C, F), w3 (E, C, F), w2 (E, F, C)"


def _silence(moe: MoE, experts: list[int], x: torch.Tensor) -> torch.Tensor:
    """Make `experts` unreachable: feature 0 of every token is 5, their router row reads -50."""
    x = x.clone()
    x[..., 0] = 5.0
    with torch.no_grad():
        moe.router.weight[:, 0] = 0.0
        moe.router.weight[experts, 0] = -50.0
    return x


def _random_weights(module: nn.Module) -> nn.Module:
    """Every parameter drawn from N(0, 0.3²) (HF's init leaves the experts empty); eval mode."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module.eval()


def _reference(C, F_, E, K, seed) -> MoE:
    return _seeded(seed, lambda: MoE(C, F_, E, K, activation="swiglu", gating="softmax_topk"))


def _layer_variants(ref: MoE, x: torch.Tensor):
    """(output, hint) for the plausible wrong layers with ref's weights."""
    B, T, C = x.shape
    h = x.reshape(B * T, C)
    logits = ref.router(h)
    gates, experts = route_top_k(logits, ref.top_k, "softmax_topk")
    raw, _ = route_top_k(logits, ref.top_k, "softmax_topk_raw")
    w = (ref.w1.detach(), ref.w3.detach(), ref.w2.detach())
    out = [
        (
            _combine_variant(h, raw, experts, *w),
            "the gates are not renormalised (Step 7.1): Mixtral divides the K kept probabilities by their sum",
        ),
        (
            _combine_variant(h, gates, experts, *w, use_gates=False),
            "the experts' outputs are added without their gates (Step 7.3)",
        ),
        (
            _combine_variant(h, gates, experts, *w, swap=True),
            "w1 and w3 are swapped (Step 7.3, "
            "or how the layer passes them): SiLU goes on x @ w1[e], the gate projection",
        ),
        (
            _combine_variant(h, gates[:, :1], experts[:, :1], *w),
            "only each token's first choice reaches an expert (Step 7.2): a token goes to all K of its experts",
        ),
    ]
    return [(y.view(B, T, C), hint) for y, hint in out]


def _load(layer: nn.Module, ref: MoE) -> str | None:
    """Copy ref's weights into the learner's layer by name; a problem text if the names differ."""
    theirs = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    if theirs != ours:
        listed = ", ".join(f"{k} {s}" for k, s in sorted(theirs.items())) or "none"
        here = ", ".join(f"{k} {s}" for k, s in sorted(ours.items()))
        return (
            f"the layer's parameters are {listed}; expected exactly {EXPECTED_PARAMETERS}, "
            f"here {here}: lib.moe.MoE's names, so that Mixtral's weights load by name"
        )
    layer.load_state_dict(ref.state_dict())
    return None


def check_moe_layer(cls) -> CheckReport:
    """MyMoE(d_model, d_ff, num_experts, top_k): forward(x (B, T, C)) -> (y (B, T, C),
    router_logits (B·T, E)), equal to lib.moe.MoE(activation="swiglu", gating="softmax_topk") and
    to Hugging Face's MixtralSparseMoeBlock with the same weights."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    name = "Step 7.4 (the whole MoE layer)"
    specs = [
        (
            "B=2, T=6, C=16, F=24, E=4, top-2: Hugging Face's MixtralSparseMoeBlock, its weights copied in",
            2,
            6,
            16,
            24,
            4,
            2,
        ),
        ("experts 1 and 5 (the last) get no token (E=6, top-2)", 2, 5, 16, 24, 6, 2),
        ("one token (B=1, T=1), E=4, top-2", 1, 1, 16, 24, 4, 2),
        ("top-1 of 3 experts, B=3, T=7 (21 tokens)", 3, 7, 16, 24, 3, 1),
    ]
    n = len(specs)
    for i, (case, B, T, C, F_, E, K) in enumerate(specs):
        x = torch.randn(B, T, C, generator=_gen(30 + i))
        if i == 0:
            config = _mixtral_config(C, F_, E, K)
            block = _seeded(30, lambda: _random_weights(MixtralSparseMoeBlock(config)))
            with torch.no_grad():
                expected = block(x)  # (B, T, C): the real Mixtral block
            ref = moe_from_mixtral(block)
        else:
            ref = _reference(C, F_, E, K, 30 + i)
            if i == 1:
                x = _silence(ref, [1, 5], x)
            with torch.no_grad():
                expected, _ = ref(x)
        with torch.no_grad():
            expected_logits = ref.router(x.reshape(B * T, C))  # (N, E)
        chosen = set(ref.route(expected_logits)[1].reshape(-1).tolist())
        idle = sorted(set(range(E)) - chosen)

        with torch.random.fork_rng(devices=[]):  # the learner's init draws: leave theirs alone
            layer, report = call_learner(name, guard_earlier_steps(cls), (C, F_, E, K), case, n)
        if report is not None:
            return _earlier(report)
        fail = lambda problem, hint=None, case=case: CheckReport(  # noqa: E731
            name, False, n, case, problem, hint
        )
        if not isinstance(layer, nn.Module):
            return fail(
                f"MyMoE(...) gave {type(layer).__name__}, expected an nn.Module",
                "class MyMoE(nn.Module): call super().__init__() first",
            )
        problem = _load(layer, ref)
        if problem:
            return fail(
                problem,
                "self.router = nn.Linear(C, E, bias=False); self.w1 = "
                "nn.Parameter(torch.empty(E, C, F)), likewise w3, and w2 (E, F, C)",
            )
        xg = x.clone().requires_grad_(i == 0)
        got, report = call_learner(name, guard_earlier_steps(layer), (xg,), case, n)
        if report is not None:
            if (report.problem or "").startswith("your function raised EarlierStep"):
                return _earlier(report)
            if idle and report.problem != "not attempted yet":
                report.hint = _idle_hint(idle) + " (Steps 7.2 and 7.3)"
            return report
        if not _is_tensors(got, 2):
            return fail(
                f"forward returned {type(got).__name__}, expected a tuple (y, router_logits)",
                "return both: the router logits feed the balance loss (Step 7.5)",
            )
        y, logits = got
        if logits.shape != (B * T, E):
            return fail(
                f"router_logits have shape {tuple(logits.shape)}, expected {(B * T, E)}",
                "one row per token, (B·T, E), as Mixtral's router returns them",
            )
        if not _close(logits.detach(), expected_logits):
            if _close(logits.detach(), torch.softmax(expected_logits, -1)):
                return fail("router_logits are probabilities", "return the raw logits, before the softmax")
            return fail("wrong router_logits", "router_logits = self.router(x.reshape(B * T, C)) (Step 7.1)")
        if y.shape != (B, T, C):
            hint = "reshape the (B·T, C) result back to (B, T, C)" if y.shape == (B * T, C) else None
            return fail(f"y has shape {tuple(y.shape)}, expected {(B, T, C)}", hint)
        if not _close(y.detach(), expected):
            hint = next(
                (h for v, h in _layer_variants(ref, x) if _close(y.detach(), v.detach())),
                "compare your layer step by step with Steps 7.1-7.3 on this case",
            )
            where = "Hugging Face's Mixtral block" if i == 0 else "lib.moe.MoE"
            largest = (y.detach() - expected).abs().max().item()
            return fail(f"y differs from {where} (largest difference {largest:.3g})", hint)
        if i == 0:
            problem = _gradient_problem(layer, ref, x, y)
            if problem:
                return fail(*problem)
    return CheckReport(name, True, n)


def _earlier(report: CheckReport) -> CheckReport:
    if (report.problem or "").startswith("your function raised EarlierStep"):
        report.hint = EARLIER_STEP_HINT
    return report


def _gradient_problem(layer, ref, x, y):
    """The router learns only through the gates: its gradient must match lib's."""
    upstream = torch.randn(y.shape, generator=_gen(99))
    if not y.requires_grad:
        return ("y carries no gradient", "do not compute the layer under torch.no_grad() or detach its output")
    (y * upstream).sum().backward()
    ref.zero_grad(set_to_none=True)
    y_ref, _ = ref(x)
    (y_ref * upstream).sum().backward()
    grad = layer.router.weight.grad
    if grad is None or not bool(grad.abs().gt(0).any()):
        return (
            "the router's weight gets no gradient",
            "compute the gates outside "
            "torch.no_grad() and without .detach(): the router learns only through the gates "
            "that weigh the experts' outputs",
        )
    # fp32 backward through the same few products: 1e-4 covers the different summation orders
    if not torch.allclose(grad, ref.router.weight.grad, atol=1e-4, rtol=1e-4):
        return (
            "the router's gradient differs from lib.moe.MoE's",
            "the gates must be the "
            "differentiable softmax probabilities (Step 7.1); only the choice of experts is a "
            "discrete, gradient-free step",
        )
    return None


# --------------------------------------------------------------------------- 7.5 balance loss
def _mirrored_layers(N: int = 64, E: int = 4):
    """Layer 0 sends expert 1's tokens to expert 0; layer 1 is the mirror image (lib's test)."""
    preferred = torch.arange(N) % E
    preferred[preferred == 1] = 0
    layer0 = torch.zeros(N, E)
    layer0[torch.arange(N), preferred] = 4.0
    return [layer0, layer0[:, [1, 0, 2, 3]].clone()]


def _loss_variants(layers, K):
    """(value, hint) of the plausible wrong losses."""
    E = layers[0].shape[-1]

    def per_layer(logits, k_count=K, gates_P=False, f_scale=1.0):
        N = logits.shape[0]
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = logits.topk(k_count, dim=-1).indices
        f = torch.bincount(chosen.reshape(-1), minlength=E).float() / N * f_scale
        if gates_P:
            top = probs.gather(-1, chosen)
            top = top / top.sum(-1, keepdim=True)
            P = torch.zeros(N, E).scatter(-1, chosen, top).mean(0)
        else:
            P = probs.mean(0)
        return E * (f * P).sum()

    stack = lambda **kw: torch.stack([per_layer(t, **kw) for t in layers])  # noqa: E731
    return [
        (
            load_balancing_loss(layers, K, pooled=True),
            "you pooled all layers' tokens into one f "
            "and one P (Hugging Face's form): compute the loss for each layer on its own, then "
            "average; pooled, opposite imbalances in two layers cancel",
        ),
        (stack(k_count=1).mean(), "f counted only each token's top-1 choice: count all K of its experts, so Σ f_i = K"),
        (
            stack(f_scale=1 / K).mean(),
            "f_i divides by N, the tokens, not by N·K: Σ f_i = K, and even routing gives a loss of K",
        ),
        (stack().sum(), "average over the layers (mean), not sum: the loss must not grow with the depth"),
        (stack().mean() / E, "multiply by E, the number of experts"),
        (
            stack(gates_P=True).mean(),
            "P_i is the mean of the full softmax over all E experts, not of the K renormalised gates",
        ),
    ]


def check_layer_balance_loss(fn) -> CheckReport:
    """fn(router_logits: a list of per-layer (N, E) logits, top_k) -> a 0-dim tensor equal to
    lib.moe.load_balancing_loss(router_logits, top_k) (per layer, averaged; not pooled), with its
    gradient."""
    name = "Step 7.5 (the balance loss, per layer)"
    g = _gen(40)
    skewed = torch.randn(24, 4, generator=g) * 2
    skewed[:, 0] += 3.0
    cases = [
        ("one layer, 8 experts, top-2", [torch.randn(32, 8, generator=g) * 2], 2),
        ("two layers with opposite imbalances, top-1", _mirrored_layers(), 1),
        (
            "three layers, top-2, 40, 12 and 24 tokens",
            [torch.randn(40, 4, generator=g) * 2, torch.randn(12, 4, generator=g), skewed],
            2,
        ),
        ("two layers, top-3 of 6", [torch.randn(20, 6, generator=g) * 3 for _ in range(2)], 3),
    ]
    n = len(cases)
    # fp32 sums of <= 40 probabilities per expert: ~1e-7 relative
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6))  # noqa: E731
    for case, layers, K in cases:
        leaves = [t.clone().requires_grad_(True) for t in layers]
        got, report = call_learner(name, fn, (leaves, K), case, n)
        if report is not None:
            return report
        fail = lambda problem, hint=None, case=case: CheckReport(  # noqa: E731
            name, False, n, case, problem, hint
        )
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            what = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return fail(
                f"returned {what}, expected a one-number tensor",
                "return the tensor "
                "itself (not .item()): it joins the training loss, and its gradient "
                "trains the routers",
            )
        got = got.reshape(())
        expected = load_balancing_loss(layers, K)
        if not close(got.detach(), expected):
            hint = next(
                (h for v, h in _loss_variants(layers, K) if close(got.detach(), v)),
                "for each layer: E · Σ_i f_i · P_i (f_i: share of its tokens with expert "
                "i among their top K; P_i: its mean softmax probability of i); then the "
                "mean over layers",
            )
            return fail(f"returned {got.item():.5f}, expected {expected.item():.5f}", hint)
        if not got.requires_grad:
            return fail(
                "the loss carries no gradient",
                "keep P in the graph: no .detach(), "
                ".item() or torch.no_grad() around the softmax (f is a count, has none)",
            )
        got.backward()
        ref_leaves = [t.clone().requires_grad_(True) for t in layers]
        load_balancing_loss(ref_leaves, K).backward()
        for i, (mine, ref) in enumerate(zip(leaves, ref_leaves)):
            grad = torch.zeros_like(mine) if mine.grad is None else mine.grad
            if not torch.allclose(grad, ref.grad, rtol=1e-4, atol=1e-7):
                return fail(
                    f"the right value, but the gradient on layer {i}'s logits differs",
                    "the gradient flows through P only: f is a count (no gradient); do not detach P",
                )
    return CheckReport(name, True, n)
