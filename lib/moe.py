"""Mixture of Experts: a routed feed-forward, two ways to dispatch it, balance losses, capacity.

Follows Shazeer et al. 2017 (sparsely-gated MoE), the Switch Transformer (Fedus, Zoph, Shazeer,
arXiv 2101.03961, §2.1 capacity, §2.2 the auxiliary loss), ST-MoE (Zoph et al., arXiv 2202.08906,
the router z-loss) and Mixtral (Hugging Face's `MixtralSparseMoeBlock`: softmax, top-2,
renormalise; SwiGLU experts w1, w3, w2):

    router       logits = x · W_r                        (N, E): one score per expert and token
    top-K        the K largest logits of each token      experts (N, K), K distinct per token
    gates        g = softmax over those K logits         (N, K), each row sums to 1
    experts      y_t = Σ_k g_tk · FFN_{e_tk}(x_t)        FFN_e: C -> F -> C, weights stacked over E
    capacity     each expert takes at most ceil(cf · N · K / E) assignments; the rest are dropped
    balance      aux = E · Σ_i f_i · P_i  (Switch)       z = mean_t logsumexp(logits_t)² (ST-MoE)
                 each per layer, averaged over the L layers (f_i, P_i: layer l's own expert i)

`MoE.dispatch` picks how the tokens reach their experts, with equal results (the tests assert it):
    "loop"       for each expert: find its tokens (torch.where over all assignments), gather them,
                 run the FFN, index_add the weighted result back. E searches, E gathers, E scatters.
    "grouped"    one stable argsort of the N·K assignments by expert, one gather into a buffer
                 where each expert's rows are contiguous, the FFN on each contiguous segment, one
                 index_add back (the layout MegaBlocks and grouped-GEMM kernels start from).
`moe_ref` computes the same layer densely (every expert on every token, masked), as the reference;
`moe_from_mixtral` loads a Hugging Face MixtralSparseMoeBlock's weights (same outputs, tested).

Dropping (capacity_factor not None): an expert serves its assignments first come, first served in
token order (row-major over B, T), as the Switch Transformer does; the ones past its capacity are
dropped, i.e. contribute 0 to that token's output: the token still passes through the block's
residual connection. A token's K experts are distinct, so token order alone ranks an expert's queue.

Also here: `load_balancing_loss` (per layer, as Switch; `pooled=True` is Hugging Face's Mixtral
`load_balancing_loss_func`, which pools all layers' tokens so that opposite imbalances in two
layers cancel), `router_z_loss`, `expert_capacity`. Counting (`moe_param_counts`: active vs total
parameters, FLOPs per token; `MIXTRAL_8X7B`) is lib.moe_counts. A small MoE language model built
from this layer, and its training experiment, are lib.moe_lm; expert parallelism is
lib.moe_parallel.

Glossary: B batch, T tokens per row, C model width (d_model), F expert hidden width (d_ff),
E experts, K experts per token (top_k), N = B·T tokens, A = N·K assignments (token, expert pairs),
L layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import require_tensor
from lib._door import door

__all__ = [
    "ACTIVATIONS",
    "DISPATCHES",
    "GATINGS",
    "MoE",
    "RoutingStats",
    "LAYER_SIZES",
    "expert_capacity",
    "load_balancing_loss",
    "moe_from_mixtral",
    "moe_ref",
    "route_top_k",
    "router_z_loss",
    "switch_loss",
]

ACTIVATIONS = ("gelu", "silu", "swiglu")  # swiglu: three matrices, w2(silu(x·w1) * (x·w3)), as Mixtral
GATINGS = {
    "topk_softmax": "softmax over the K selected logits (the default)",
    "softmax_topk": "softmax over all E, keep the top K, renormalise to sum 1 (Mixtral)",
    "softmax_topk_raw": "softmax over all E, keep the top K unrenormalised (Switch, Qwen2-MoE norm_topk_prob=False)",
}
DISPATCHES = ("grouped", "loop")


# --------------------------------------------------------------------------- the contracts
LAYER_SIZES = door(
    d_model="int >= 1",
    d_ff="int >= 1",
    num_experts="int >= 1",
    num_tokens="int >= 1",
    top_k="int >= 1",
    activation="one of ACTIVATIONS",
    capacity_factor="real > 0 | None",
    num_layers="int >= 1",
    gating="one of GATINGS",
    dispatch="one of DISPATCHES",
    where={
        "top_k <= num_experts": "top_k must be <= num_experts (each token picks K distinct experts)",
    },
)
_ROUTING = LAYER_SIZES.plus(logits="float (N, E)", where={"top_k <= E": "top_k must be <= the number of experts E"})
_INPUT = door(
    x="float (B, T, self.d_model)",
    where={
        "x.dtype == self.w1.dtype and x.device == self.w1.device": "x must match the layer's weights "
        "({self.w1.dtype} on {self.w1.device}), got {x.dtype} on {x.device}",
    },
)


@LAYER_SIZES
def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Assignments one expert may take: ceil(capacity_factor · num_tokens · top_k / num_experts).

    capacity_factor 1.0 is exactly the even share N·K/E; 1.25 leaves 25% headroom (Switch).
    None means no limit (returns None: dropless). The product is taken on the decimal value
    (1.1 is 11/10), so float rounding cannot add a slot: expert_capacity(100, 10, 1, 1.1) == 11.
    """
    if capacity_factor is None:
        return None
    return math.ceil(Fraction(repr(float(capacity_factor))) * num_tokens * top_k / num_experts)


def _softmax_dtype(logits: torch.Tensor) -> torch.dtype:
    """At least fp32, as HF Mixtral's router (fp64 stays fp64)."""
    return torch.promote_types(logits.dtype, torch.float32)


@_ROUTING
def route_top_k(logits: torch.Tensor, top_k: int, gating: str = "topk_softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> gates (N, K) in the logits' dtype, experts (N, K) int64, by `gating`
    (GATINGS: "topk_softmax" the softmax over the K chosen logits; "softmax_topk" Mixtral's, the
    softmax over all E, top K, renormalised; "softmax_topk_raw" the same without renormalising)."""
    if gating == "topk_softmax":
        top, experts = logits.topk(top_k, dim=-1)  # (N, K) each
        gates = F.softmax(top, dim=-1, dtype=_softmax_dtype(logits))
    else:
        probs = F.softmax(logits, dim=-1, dtype=_softmax_dtype(logits))  # (N, E), fp32 or more, as HF Mixtral
        gates, experts = probs.topk(top_k, dim=-1)  # (N, K) each
        if gating == "softmax_topk":
            gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates.to(logits.dtype), experts


@dataclass
class RoutingStats:
    """What one forward did with its tokens (`MoE.last_stats`); counts are (E,) int64 tensors."""

    num_tokens: int  # N
    assignments: int  # A = N·K
    capacity: int | None  # per expert; None = no limit
    routed: torch.Tensor  # (E,) assignments the router sent to each expert
    kept: torch.Tensor  # (E,) assignments each expert processed (routed, capped at capacity)

    @property
    def dropped(self) -> int:
        return int((self.routed - self.kept).sum())

    @property
    def drop_rate(self) -> float:
        """Share of the N·K assignments dropped for lack of capacity."""
        return self.dropped / self.assignments

    @property
    def load(self) -> torch.Tensor:
        """(E,) share of the routed assignments each expert got (sums to 1)."""
        return self.routed.double() / self.assignments


# --------------------------------------------------------------------------- the layer
class MoE(nn.Module):
    """A top-K routed mixture of E feed-forward experts.

    `forward(x)` with x (B, T, d_model) returns (y, router_logits): y (B, T, d_model), the weighted
    sum of each token's K experts (0 for a token all of whose assignments were dropped), and the
    router logits (B·T, E) for `load_balancing_loss` / `router_z_loss`. `last_stats` holds the
    forward's `RoutingStats` (per-expert counts, capacity, drop rate).

    Parameters: `router` (an nn.Linear C -> E, no bias), `w1` (E, C, F), `w2` (E, F, C) and, for
    activation="swiglu", `w3` (E, C, F): expert e computes act(x·w1[e])·w2[e], or for SwiGLU
    (silu(x·w1[e]) * (x·w3[e]))·w2[e]. `dispatch`, `gating` and `capacity_factor` are plain
    attributes, checked when set: ST-MoE trains with capacity 1.25 and evaluates with 2.0.
    """

    @LAYER_SIZES
    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int = 2,
        *,
        activation: str = "gelu",
        gating: str = "topk_softmax",
        capacity_factor: float | None = None,
        dispatch: str = "grouped",
    ):
        super().__init__()
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.activation = activation
        self.gating, self.capacity_factor, self.dispatch = gating, capacity_factor, dispatch
        E, C, Fh = num_experts, d_model, d_ff
        self.router = nn.Linear(C, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, C, Fh))
        self.w2 = nn.Parameter(torch.empty(E, Fh, C))
        self.register_parameter("w3", nn.Parameter(torch.empty(E, C, Fh)) if activation == "swiglu" else None)
        self.reset_parameters()
        self.last_stats: RoutingStats | None = None

    def reset_parameters(self) -> None:
        """Each expert's matrices as nn.Linear initialises its weight: U(-1/√fan_in, 1/√fan_in)."""
        self.router.reset_parameters()
        for w in (self.w1, self.w2, self.w3):
            if w is not None:
                bound = 1.0 / math.sqrt(w.shape[1])
                nn.init.uniform_(w, -bound, bound)

    # checked attributes: a wrong name fails where it is set, naming the choices
    @property
    def dispatch(self) -> str:
        return self._dispatch

    @dispatch.setter
    def dispatch(self, value: str) -> None:
        LAYER_SIZES.check(dispatch=value)
        self._dispatch = value

    @property
    def gating(self) -> str:
        return self._gating

    @gating.setter
    def gating(self, value: str) -> None:
        LAYER_SIZES.check(gating=value)
        self._gating = value

    @property
    def capacity_factor(self) -> float | None:
        return self._capacity_factor

    @capacity_factor.setter
    def capacity_factor(self, value: float | None) -> None:
        LAYER_SIZES.check(capacity_factor=value)
        self._capacity_factor = value

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"activation={self.activation!r}, gating={self.gating!r}, "
            f"capacity_factor={self.capacity_factor}, dispatch={self.dispatch!r}"
        )

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits (N, E) -> gates (N, K), experts (N, K), by this layer's `gating`."""
        return route_top_k(logits, self.top_k, self.gating)

    def expert(self, h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None = None):
        """One expert's FFN on rows h (n, C) with its matrices w1 (C, F), w2 (F, C), w3 (C, F)."""
        a = h @ w1  # (n, C) @ (C, F) -> (n, F)
        if self.activation == "swiglu":
            a = F.silu(a) * (h @ w3)  # (n, F): the gate times the up projection
        else:
            a = F.gelu(a) if self.activation == "gelu" else F.silu(a)
        return a @ w2  # (n, F) @ (F, C) -> (n, C)

    def _weights(self, lo: int = 0, hi: int | None = None):
        """Per-expert (w1, w2, w3) triples for experts lo..hi-1, split once (one autograd node)."""
        hi = self.num_experts if hi is None else hi
        w3 = self.w3[lo:hi].unbind(0) if self.w3 is not None else [None] * (hi - lo)
        return list(zip(self.w1[lo:hi].unbind(0), self.w2[lo:hi].unbind(0), w3))

    @_INPUT
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        E, K = self.num_experts, self.top_k
        h = x.reshape(B * T, C)  # (B, T, C) -> (N, C)
        logits = self.router(h)  # (N, E)
        gates, experts = self.route(logits)  # (N, K), (N, K)
        cap = expert_capacity(B * T, E, K, self.capacity_factor)
        routed = torch.bincount(experts.reshape(-1), minlength=E)  # (E,)
        if self.dispatch == "loop":
            y, kept = self._dispatch_loop(h, gates, experts, cap)
        else:
            y, kept = self._dispatch_grouped(h, gates, experts, cap, routed)
        self.last_stats = RoutingStats(B * T, B * T * K, cap, routed.detach(), kept.detach())
        return y.view(B, T, C), logits  # (N, C) -> (B, T, C); (N, E)

    def _dispatch_loop(self, h, gates, experts, cap):
        """Per expert: search all N·K assignments for its own, gather, FFN, weighted index_add."""
        out = torch.zeros_like(h)  # (N, C)
        kept = []
        for e, (w1, w2, w3) in enumerate(self._weights()):
            tok, slot = torch.where(experts == e)  # (n_e,) each, in token order: first come first served
            if cap is not None:
                tok, slot = tok[:cap], slot[:cap]
            kept.append(tok.numel())
            if tok.numel() == 0:
                continue
            y = self.expert(h[tok], w1, w2, w3)  # (n_e, C)
            out.index_add_(0, tok, y * gates[tok, slot, None])  # (n_e, C) weighted, added into its tokens' rows
        return out, torch.tensor(kept, device=h.device)

    def _dispatch_grouped(self, h, gates, experts, cap, routed):
        """One stable sort by expert, one gather, the FFN per contiguous segment, one index_add."""
        N, K = experts.shape
        flat = experts.reshape(-1)  # (A,): assignment a is token a // K, slot a % K
        order = torch.argsort(flat, stable=True)  # (A,) grouped by expert, token order within each group
        kept = routed
        if cap is not None:
            starts = routed.cumsum(0) - routed  # (E,) where each expert's group begins in `order`
            rank = torch.arange(order.numel(), device=h.device) - starts[flat[order]]  # (A,) place in its queue
            order = order[rank < cap]  # (A',) the assignments within capacity, still grouped
            kept = routed.clamp(max=cap)
        tok = order // K  # (A',) the token of each kept assignment
        xs = h[tok]  # (A', C): expert e's rows are one contiguous segment
        sizes = kept.tolist()
        ys = torch.cat([self.expert(seg, *w) for seg, w, n in zip(xs.split(sizes), self._weights(), sizes) if n])
        out = torch.zeros_like(h).index_add_(0, tok, ys * gates.reshape(-1)[order, None])  # (N, C)
        return out, kept


def moe_from_mixtral(block) -> MoE:
    """An MoE (activation="swiglu", gating="softmax_topk") holding the weights of a Hugging Face
    `MixtralSparseMoeBlock` (transformers 5.x layout: `gate.weight` (E, C), fused `experts.gate_up_proj`
    (E, 2F, C) and `experts.down_proj` (E, C, F)); it computes the same function (tests assert it)."""
    experts, gate = getattr(block, "experts", None), getattr(block, "gate", None)
    if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj") and hasattr(gate, "weight")):
        raise TypeError(
            f"block must be a transformers 5.x MixtralSparseMoeBlock (gate.weight, experts.gate_up_proj, "
            f"experts.down_proj), got {type(block).__name__}"
        )
    E, two_F, C = experts.gate_up_proj.shape
    moe = MoE(C, two_F // 2, E, block.top_k, activation="swiglu", gating="softmax_topk")
    moe.to(device=gate.weight.device, dtype=gate.weight.dtype)
    with torch.no_grad():
        moe.router.weight.copy_(gate.weight)  # (E, C)
        gate_proj, up_proj = experts.gate_up_proj.chunk(2, dim=1)  # (E, F, C) each: HF's F.linear layout
        moe.w1.copy_(gate_proj.transpose(1, 2))  # (E, F, C) -> (E, C, F)
        moe.w3.copy_(up_proj.transpose(1, 2))
        moe.w2.copy_(experts.down_proj.transpose(1, 2))  # (E, C, F) -> (E, F, C)
    return moe


def moe_ref(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same layer computed densely in fp32: every expert on every token, combined with an (N, E)
    gate matrix that is zero off the chosen experts and on dropped assignments. Capacity is applied
    by a cumulative count over tokens (a third way to rank each expert's queue). Returns y (B, T, C)."""
    if not isinstance(moe, MoE):
        raise TypeError(f"moe must be a lib.moe.MoE, got {type(moe).__name__}")
    _INPUT.check(self=moe, x=x)
    B, T, C = x.shape
    E, K = moe.num_experts, moe.top_k
    h = x.reshape(B * T, C).double()  # (N, C)
    logits = h @ moe.router.weight.double().t()  # (N, E)
    gates, experts = route_top_k(logits, K, moe.gating)  # (N, K)
    chosen = F.one_hot(experts, E).to(h.dtype)  # (N, K, E)
    cap = expert_capacity(B * T, E, K, moe.capacity_factor)
    if cap is not None:
        queue = chosen.sum(1).cumsum(0)  # (N, E): how many tokens up to and including t chose e
        chosen = chosen * (queue <= cap)[:, None, :]  # (N, K, E): past capacity, the assignment is dropped
    G = (gates[..., None] * chosen).sum(1)  # (N, K, 1) * (N, K, E) -> (N, E)
    a = torch.einsum("nc,ecf->enf", h, moe.w1.double())  # (E, N, F)
    if moe.activation == "swiglu":
        a = F.silu(a) * torch.einsum("nc,ecf->enf", h, moe.w3.double())
    else:
        a = F.gelu(a) if moe.activation == "gelu" else F.silu(a)
    y_all = torch.einsum("enf,efc->enc", a, moe.w2.double())  # (E, N, C): every expert's output
    y = torch.einsum("ne,enc->nc", G, y_all)  # (N, C)
    return y.view(B, T, C).to(x.dtype)


# --------------------------------------------------------------------------- balance losses
def _as_layers(router_logits) -> list[torch.Tensor]:
    """A (N, E) or (B, T, E) tensor (one layer), or a list/tuple of per-layer ones -> [(N, E), ...]."""
    layers = list(router_logits) if isinstance(router_logits, (list, tuple)) else [router_logits]
    if not layers:
        raise ValueError("router_logits must hold at least one layer's (N, E) logits, got an empty sequence")
    for i, t in enumerate(layers):
        name = f"router_logits[{i}]" if isinstance(router_logits, (list, tuple)) else "router_logits"
        require_tensor(name, t, floating=True)
        if t.dim() not in (2, 3) or t.numel() == 0 or t.shape[-1] != layers[0].shape[-1]:
            E = f" with E = {layers[0].shape[-1]} as in router_logits[0]" if i else ""
            raise ValueError(f"{name} must have shape (N, E) or (B, T, E){E} and hold a token, got {tuple(t.shape)}")
    return [t.reshape(-1, t.shape[-1]) for t in layers]


@_ROUTING
def switch_loss(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """E · Σ_i f_i · P_i over one set of tokens' logits (N, E): one layer's Switch loss."""
    N, E = logits.shape
    probs = F.softmax(logits, dim=-1, dtype=_softmax_dtype(logits))  # (N, E)
    chosen = logits.topk(top_k, dim=-1).indices  # (N, K)
    f = torch.bincount(chosen.reshape(-1), minlength=E).to(probs.dtype) / N  # (E,), sums to K
    P = probs.mean(dim=0)  # (E,), sums to 1
    return E * (f * P).sum()


@door(top_k="int >= 1", pooled="bool")
def load_balancing_loss(router_logits, top_k: int, *, pooled: bool = False) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss E · Σ_i f_i · P_i (§2.2, eq. 4-6), for top-K routing,
    computed for each MoE layer and averaged over the layers.

    f_i: the fraction of a layer's tokens that send one of their K assignments to expert i (each
    token's K assignments counted, so Σ f_i = K); P_i: the layer's mean router probability of
    expert i. f carries no gradient (a count); the loss pushes the probabilities of over-used
    experts down. At perfectly even routing (f_i = K/E, P_i = 1/E) it is K, so with K = 1 it is
    the paper's 1. `router_logits`: one layer's (N, E) or (B, T, E), or a list/tuple of layers.

    Per layer, as Switch adds one loss per Switch layer: expert i of layer 0 and expert i of layer 1
    are different experts. `pooled=True` is Hugging Face's Mixtral `load_balancing_loss_func(
    gate_logits, E, K)` instead (equal to it, tested): all layers' tokens concatenated into one f and
    one P, so layer 0 over-using expert 0 and layer 1 over-using expert 1 average to a flat f and P
    and read the even value K: pooling lets opposite imbalances in different layers cancel (raised
    in transformers issues #28255 and #31464). For one layer the two are equal.
    """
    layers = _as_layers(router_logits)  # [(N, E), ...], checked; switch_loss checks top_k against E
    if pooled:
        return switch_loss(torch.cat(layers), top_k)  # (L·N, E): one f and one P for every layer
    return torch.stack([switch_loss(logits, top_k) for logits in layers]).mean()


def router_z_loss(router_logits) -> torch.Tensor:
    """ST-MoE's router z-loss (§3.1, eq. 5): mean over tokens of logsumexp(logits)², which keeps
    the router's logits small (bf16 round-off in the softmax grows with their size). Per layer,
    averaged over layers, as `load_balancing_loss`; a square is never negative, so nothing cancels
    across layers, and when every layer routes the same tokens (as in one model) this equals the
    mean over all layers' tokens pooled: the choice only weights layers of unequal token counts."""
    return torch.stack(
        [
            torch.logsumexp(logits.to(_softmax_dtype(logits)), dim=-1).pow(2).mean()
            for logits in _as_layers(router_logits)
        ]
    ).mean()
