"""A small Mixture-of-Experts language model, and the experiment that watches its router.

    MoEFeedForward(moe)         a lib.moe.MoE in lib.gpt.Block's `mlp` slot; keeps the router
                                logits of its last forward for the balance losses
    moe_gpt(config, E, K)       a lib.gpt.GPT whose every feed-forward is an MoE of E experts, top-K
    router_logits_of(model)     every MoE layer's router logits (N, E) from the last forward
    train_moe_lm(alpha, ...)    train one with loss ce + α · balance (+ z-loss), recording each layer's
                                per-expert load f and probability P step by step (`MoETrainRecord`):
                                lesson 07's collapse and balance
    drop_rate(model, data, cf)  the share of assignments a trained model drops at capacity factor cf,
                                on fresh batches of its data

The layer itself, its dispatches, losses and capacity are lib.moe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib._checks import require_int, require_rank, require_real, require_tensor
from lib._replay import replayable
from lib.corpus import CharVocab, facts_corpus
from lib.gpt import GPT, Block, GPTConfig
from lib.moe import LAYER_SIZES, MoE, load_balancing_loss, router_z_loss
from lib.train import get_batch, train

__all__ = ["MoEFeedForward", "MoETrainRecord", "drop_rate", "moe_gpt", "router_logits_of", "train_moe_lm"]


class MoEFeedForward(nn.Module):
    """Fits an MoE into lib.gpt.Block's `mlp` slot: returns y alone and keeps the router logits
    (N, E) of the last forward in `router_logits`, for the auxiliary loss."""

    def __init__(self, moe: MoE):
        super().__init__()
        if not isinstance(moe, MoE):
            raise TypeError(f"moe must be a lib.moe.MoE, got {type(moe).__name__}")
        self.moe = moe
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.router_logits = self.moe(x)  # (B, T, C), (N, E)
        return y


def moe_gpt(config, num_experts: int = 8, top_k: int = 2, d_ff: int | None = None, **moe_kwargs):
    """A lib.gpt.GPT whose every block's feed-forward is an MoE of `num_experts` experts of width
    d_ff (default 4·n_embd, GPT's own MLP width, so one expert = one dense MLP's matrices)."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a lib.gpt.GPTConfig, got {type(config).__name__}")
    d_ff = 4 * config.n_embd if d_ff is None else d_ff
    activation = moe_kwargs.get("activation", "gelu")
    LAYER_SIZES.check(d_model=config.n_embd, d_ff=d_ff, num_experts=num_experts, top_k=top_k, activation=activation)

    def make_block(cfg, i):
        return Block(cfg, mlp=MoEFeedForward(MoE(cfg.n_embd, d_ff, num_experts, top_k, **moe_kwargs)))

    return GPT(config, make_block=make_block)


def router_logits_of(model: nn.Module) -> list[torch.Tensor]:
    """The router logits (N, E) of every MoEFeedForward in `model` from its last forward, in order."""
    return [m.router_logits for m in model.modules() if isinstance(m, MoEFeedForward) and m.router_logits is not None]


@dataclass
class MoETrainRecord:
    """One `train_moe_lm` run, step by step: plain lists and one tensor, for plots and tables."""

    alpha: float  # the auxiliary loss coefficient
    num_experts: int
    top_k: int
    loss: list[float] = field(default_factory=list)  # next-token loss (nats/token), without the aux term
    aux_loss: list[float] = field(default_factory=list)  # the balance loss trained on (= K when even)
    aux_loss_per_layer: list[float] = field(default_factory=list)  # load_balancing_loss, per layer (the default)
    aux_loss_pooled: list[float] = field(default_factory=list)  # load_balancing_loss(pooled=True), HF's
    pooled: bool = False  # whether the run trained on the pooled balance loss
    z_loss: list[float] = field(default_factory=list)
    drop_rate: list[float] = field(default_factory=list)  # mean over layers
    dead_experts: list[int] = field(default_factory=list)  # (layer, expert) pairs that got no token this step
    load: torch.Tensor | None = None  # (steps, L, E): f, the share of each layer's assignments per expert
    prob: torch.Tensor | None = None  # (steps, L, E): P, each layer's mean router probability per expert
    seconds: float = 0.0
    model: nn.Module | None = field(default=None, repr=False)  # the model (set before training; in eval mode after)
    data: torch.Tensor | None = field(default=None, repr=False)  # the token stream it trained on
    assignments: list[list[int]] = field(default_factory=list)  # per probe step: layer 0's first-choice expert
    assignment_steps: list[int] = field(default_factory=list)  # the steps at which the probe was routed
    tokens: list[str] | None = None  # the probe's tokens as text (when the default character data is used)

    @property
    def layer_imbalance(self) -> torch.Tensor:
        """(steps, L): each layer's busiest expert's load f over the even share 1/E (1 = even)."""
        return self.load.max(dim=-1).values * self.num_experts

    @property
    def imbalance(self) -> list[float]:
        """Per step: the busiest expert of the worst layer, its load over the even share 1/E (1 = even).
        The worst layer, not a mean over layers: one balanced layer must not hide an unbalanced one."""
        return self.layer_imbalance.max(dim=-1).values.tolist()

    @property
    def prob_imbalance(self) -> list[float]:
        """Per step: the largest mean router probability P_i over the even 1/E, in the worst layer.
        Each layer's loss E·Σ f_i P_i reads K when its f and P are flat; the pooled loss (HF's) reads
        K when the layers' f and P *averaged* are flat, which opposite imbalances in two layers give."""
        return (self.prob.max(dim=-1).values * self.num_experts).max(dim=-1).values.tolist()

    def summary(self, last: int = 10) -> dict[str, float]:
        """The last `last` steps, averaged: main loss, aux loss (as trained), both forms of it
        ("aux_per_layer", "aux_pooled"), the busiest expert's load f over the even share in the worst
        layer ("busiest"), the largest mean probability P over the even share in the worst layer
        ("busiest_prob"), dead (layer, expert) pairs per step, and the drop rate (0 without capacity)."""
        require_int("last", last, minimum=1)
        if last > len(self.loss):
            raise ValueError(f"last must be <= the {len(self.loss)} recorded steps, got {last}")

        def mean(xs):
            return sum(xs[-last:]) / last

        return dict(
            main=mean(self.loss),
            aux=mean(self.aux_loss),
            aux_per_layer=mean(self.aux_loss_per_layer),
            aux_pooled=mean(self.aux_loss_pooled),
            busiest=mean(self.imbalance),
            busiest_prob=mean(self.prob_imbalance),
            dead=mean(self.dead_experts),
            drop_rate=mean(self.drop_rate),
        )

    def final_load(self, last: int = 10) -> torch.Tensor:
        """(L, E) load f (each layer's assignments' shares, summing to 1) averaged over the last `last` steps."""
        return self.load[-last:].mean(dim=0)

    def final_prob(self, last: int = 10) -> torch.Tensor:
        """(L, E) mean router probability P of each layer's experts, averaged over the last `last` steps."""
        return self.prob[-last:].mean(dim=0)


@replayable(seeds_global_rng=True)  # it calls torch.manual_seed(seed) before any draw
def train_moe_lm(
    alpha: float = 1e-2,
    *,
    steps: int = 150,
    num_experts: int = 8,
    top_k: int = 2,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    d_ff: int = 128,
    batch_size: int = 16,
    seq_len: int = 32,
    lr: float = 1e-2,
    z_loss: float = 0.0,
    capacity_factor: float | None = None,
    gating: str = "topk_softmax",
    pooled_balance: bool = False,
    data: torch.Tensor | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    on_step: Callable[[int, MoETrainRecord], None] | None = None,
    probe_every: int = 5,
) -> MoETrainRecord:
    """Train a small MoE GPT (`moe_gpt`) on next-token prediction with loss
    ce + alpha · load_balancing_loss + z_loss · router_z_loss, recording every step's losses and
    each layer's per-expert load f and probability P. The balance loss is Switch's, per layer and
    averaged over layers; `pooled_balance=True` trains on Hugging Face's pooled form instead (both
    are recorded either way). `data` is a 1-D token stream (default: lib.corpus.facts_corpus as
    characters).

    AdamW at a constant `lr`, seeded: the same arguments give the same record. At the defaults a
    run took about 10 s on a shared two-core machine (one torch thread; six runs, the lesson's α
    sweep, 74 s). `on_step(step, record)` is called after each step.
    """
    require_real("alpha", alpha, at_least=0)
    require_real("z_loss", z_loss, at_least=0)
    require_int("steps", steps, minimum=1)
    require_int("probe_every", probe_every, minimum=1)
    if not isinstance(pooled_balance, bool):
        raise TypeError(f"pooled_balance must be a bool, got {type(pooled_balance).__name__}")
    vocab = None
    if data is None:
        text = "\n".join(facts_corpus(1000, seed=0)) + "\n"  # one corpus; `seed` varies init and batches
        vocab = CharVocab.build(text)
        data, vocab_size = vocab.encode(text), len(vocab)
    require_tensor("data", data)
    require_rank("data", data, 1, "(N,) a 1-D stream of token ids")
    vocab_size = int(data.max()) + 1 if vocab_size is None else vocab_size
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=vocab_size, block_size=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    model = moe_gpt(config, num_experts, top_k, d_ff, capacity_factor=capacity_factor, gating=gating)
    g = torch.Generator().manual_seed(seed)
    record = MoETrainRecord(
        alpha=float(alpha), num_experts=num_experts, top_k=top_k, pooled=pooled_balance, data=data, model=model
    )
    probe = data[:seq_len].unsqueeze(0)  # (1, T): one fixed window, routed every `probe_every` steps
    if vocab is not None:
        record.tokens = list(vocab.decode(probe[0].tolist()))
    loads, probs, parts = [], [], {}

    def loss_of(model, xy):
        _, ce = model(*xy)
        logits = router_logits_of(model)  # L x (N, E)
        aux = load_balancing_loss(logits, top_k, pooled=pooled_balance)
        parts.update(ce=ce, aux=aux, z=router_z_loss(logits), logits=logits)
        return ce + alpha * aux + z_loss * parts["z"]

    def after_step(step, _loss):
        stats = [m.moe.last_stats for m in model.modules() if isinstance(m, MoEFeedForward)]
        loads.append(torch.stack([s.load for s in stats]).float())  # (L, E)
        probs.append(
            torch.stack(
                [
                    F.softmax(lg.detach(), dim=-1, dtype=torch.promote_types(lg.dtype, torch.float32)).mean(dim=0)
                    for lg in parts["logits"]
                ]
            ).float()
        )  # (L, E): P, as the router's gates
        record.loss.append(parts["ce"].item())
        record.aux_loss.append(parts["aux"].item())
        with torch.no_grad():  # the other form, for the record (detached: it does not train)
            other = load_balancing_loss(parts["logits"], top_k, pooled=not pooled_balance).item()
        record.aux_loss_pooled.append(other if not pooled_balance else record.aux_loss[-1])
        record.aux_loss_per_layer.append(record.aux_loss[-1] if not pooled_balance else other)
        record.z_loss.append(parts["z"].item())
        record.drop_rate.append(sum(s.drop_rate for s in stats) / len(stats))
        record.dead_experts.append(sum(int((s.routed == 0).sum()) for s in stats))
        if step % probe_every == 0 or step == steps - 1:  # after the routing stats: this forward overwrites them
            with torch.no_grad():
                model(probe)
            record.assignments.append(router_logits_of(model)[0].argmax(dim=-1).tolist())  # (T,) layer 0
            record.assignment_steps.append(step)
        if on_step is not None:
            record.load, record.prob = torch.stack(loads), torch.stack(probs)  # (step + 1, L, E)
            on_step(step, record)

    start = time.perf_counter()
    train(
        model, lambda step: get_batch(data, batch_size, seq_len, g), loss_of, steps=steps, lr=lr, on_step=after_step
    )  # constant lr, clipped at 1.0, as the lesson's runs were made
    record.load, record.prob = torch.stack(loads), torch.stack(probs)  # (steps, L, E)
    record.seconds = time.perf_counter() - start
    record.model = model
    return record


def drop_rate(
    model: nn.Module,
    data: torch.Tensor,
    capacity_factor: float,
    *,
    batches: int = 4,
    batch_size: int = 16,
    seq_len: int = 32,
    seed: int = 123,
) -> float:
    """The share of the N·K assignments a (trained) MoE model drops at `capacity_factor`, over all its
    MoE layers and `batches` fresh batches of `data` drawn with their own generator (`seed`), so
    the training's random state is untouched. Every layer's capacity factor is set back after."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError("model holds no lib.moe.MoE layer")
    require_int("batches", batches, minimum=1)
    g = torch.Generator().manual_seed(seed)
    idx = [get_batch(data, batch_size, seq_len, g)[0] for _ in range(batches)]  # (B, T) each
    before = [layer.capacity_factor for layer in layers]
    dropped = assigned = 0
    try:
        for layer in layers:
            layer.capacity_factor = capacity_factor  # checked by the layer
        with torch.no_grad():
            for x in idx:
                model(x)
                dropped += sum(layer.last_stats.dropped for layer in layers)
                assigned += sum(layer.last_stats.assignments for layer in layers)
    finally:
        for layer, cf in zip(layers, before):
            layer.capacity_factor = cf
    return dropped / assigned
