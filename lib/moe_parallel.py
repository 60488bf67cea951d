"""Expert parallelism: the experts of one MoE layer spread over P processes, tokens sent by all-to-all.

The layout of GShard (Lepikhin et al. 2020, arXiv 2006.16668) and the Switch Transformer
(§2, "expert parallelism"; Fig. 3): every process (rank) holds its own tokens and a copy of the
router, and owns E/P of the experts. One forward on rank r:

    route        logits, gates, experts = router(x_r)                      as lib.moe.MoE
    group        sort its N·K assignments by expert: expert e lives on rank e // (E/P), so the
                 buffer is also grouped by destination rank
    counts       all_to_all_single of the per-expert counts (E,): each rank learns how many rows
                 every other rank will send to each of its experts
    dispatch     all_to_all_single of the rows, with those uneven split sizes
    compute      each local expert on its contiguous segment of what arrived
    combine      the reverse all_to_all_single sends the results home; weighted index_add

`all_to_all_single` is not differentiable by default: `_AllToAll` is an autograd.Function whose
backward is the reverse exchange (what came from rank p goes back to p as a gradient). Gradients of
the local experts then sum over every rank's tokens, as in one process; the replicated router's
gradient is each rank's share and is summed across ranks (all_reduce), as data parallelism does.

On CPU the backend is gloo (the list form `dist.all_to_all` refuses uneven sizes there: counts go
first, then `all_to_all_single` with split sizes); on GPUs it would be nccl. `run_expert_parallel`
starts P local processes on 127.0.0.1 and returns their outputs, gradients and bytes exchanged;
`single_process_reference` computes the same quantities with one lib.moe.MoE, to compare.
Dropless only (capacity_factor=None): with a capacity, which assignments drop depends on how the
tokens are split between ranks.

Glossary: P processes (world size), r a rank, E experts, E_r = E/P experts per rank, K experts per
token, N tokens on a rank, A = N·K assignments, R rows received, C model width, F expert width.
"""

from __future__ import annotations

import copy
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from lib._checks import require_int
from lib.moe import MoE

__all__ = ["ExpertParallelMoE", "ExpertParallelResult", "all_to_all", "run_expert_parallel", "single_process_reference"]


# --------------------------------------------------------------------------- a differentiable exchange
class _AllToAll(torch.autograd.Function):
    """Rows of x go to ranks by `send_splits`; `recv_splits` rows arrive from each rank, in rank order.
    Backward: the same exchange reversed, carrying the gradient of each received row back home."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, counter):
        ctx.send_splits, ctx.recv_splits, ctx.group, ctx.counter = send_splits, recv_splits, group, counter
        return _exchange(x, send_splits, recv_splits, group, counter, "forward")

    @staticmethod
    def backward(ctx, grad):
        g = _exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group, ctx.counter, "backward")
        return g, None, None, None, None


def _exchange(x, send_splits, recv_splits, group, counter, phase):
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))  # (R, ...)
    dist.all_to_all_single(out, x, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    if counter is not None:  # rows kept on this rank never cross a wire: count the others only
        me = dist.get_rank(group)
        row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row
        counter[f"{phase}_sent"] += row * (sum(send_splits) - send_splits[me])
        counter[f"{phase}_received"] += row * (sum(recv_splits) - recv_splits[me])
    return out


def all_to_all(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None, counter: dict | None = None
) -> torch.Tensor:
    """Differentiable `all_to_all_single` on dim 0: x (sum(send_splits), ...) -> (sum(recv_splits), ...).
    `counter`, a dict, accumulates the bytes sent to and received from other ranks."""
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group, counter)


# --------------------------------------------------------------------------- the layer
class ExpertParallelMoE(nn.Module):
    """This rank's part of a lib.moe.MoE: the full router (replicated) and experts
    [r·E/P, (r+1)·E/P) only, copied from `moe` (build `moe` identically on every rank, e.g. seeded;
    `moe` itself is left as it was). `layer` holds the copy: its router and its w1, w2 (, w3) of
    shape (E/P, ...) are this rank's parameters.
    forward(x) with x (B, T, C), this rank's tokens, returns (y, router_logits) as MoE does.
    `bytes` counts what this rank sent and received (forward and backward), counts included."""

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        if not isinstance(moe, MoE):
            raise TypeError(f"moe must be a lib.moe.MoE, got {type(moe).__name__}")
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call dist.init_process_group first (or use run_expert_parallel)"
            )
        if moe.capacity_factor is not None:
            raise ValueError(
                f"expert parallelism here is dropless: moe.capacity_factor must be None, got {moe.capacity_factor}"
            )
        P, r = dist.get_world_size(group), dist.get_rank(group)
        if moe.num_experts % P:
            raise ValueError(f"num_experts ({moe.num_experts}) must be divisible by the world size ({P})")
        self.group, self.world_size, self.rank = group, P, r
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.local = moe.num_experts // P  # E_r
        self.first = r * self.local  # global id of this rank's first expert
        self.layer = copy.deepcopy(moe)  # its route() and expert(), with this rank's slice of the experts
        lo, hi = self.first, self.first + self.local
        for name in ("w1", "w2", "w3"):
            w = getattr(moe, name)
            if w is not None:
                setattr(self.layer, name, nn.Parameter(w.detach()[lo:hi].clone()))  # (E_r, ...)
        self.last_rows_sent: list[int] | None = None
        self.bytes = {"forward_sent": 0, "forward_received": 0, "backward_sent": 0, "backward_received": 0}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe, P, Er, K = self.layer, self.world_size, self.local, self.top_k
        if x.dim() != 3 or x.shape[-1] != moe.d_model:
            raise ValueError(f"x must have shape (B, T, d_model={moe.d_model}), got {tuple(x.shape)}")
        B, T, C = x.shape
        h = x.reshape(B * T, C)  # (N, C)
        logits = moe.router(h)  # (N, E)
        gates, experts = moe.route(logits)  # (N, K) each
        flat = experts.reshape(-1)  # (A,)
        order = torch.argsort(flat, stable=True)  # (A,) grouped by expert, hence by destination rank
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,) rows for each expert
        recv_counts = torch.empty_like(counts)  # (E,) = P x (E_r,): from rank p, rows for each local expert
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        self.bytes["forward_sent"] += (P - 1) * Er * counts.element_size()
        self.bytes["forward_received"] += (P - 1) * Er * counts.element_size()
        send = counts.view(P, Er).sum(1).tolist()  # rows to each rank
        self.last_rows_sent = send
        recv_by = recv_counts.view(P, Er)  # (P, E_r)
        recv = recv_by.sum(1).tolist()  # rows from each rank

        xs = h[order // K]  # (A, C) grouped by destination
        xr = all_to_all(xs, send, recv, self.group, self.bytes)  # (R, C): by source rank, then local expert
        # regroup by local expert: the rows for expert j sit in P pieces, one per source rank
        local_id = torch.repeat_interleave(torch.arange(Er, device=x.device).repeat(P), recv_by.reshape(-1))  # (R,)
        perm = torch.argsort(local_id, stable=True)  # (R,)
        sizes = recv_by.sum(0).tolist()  # (E_r,) rows per local expert
        # every local expert runs, even on 0 rows, so each rank's graph reaches the backward exchange
        ys = torch.cat([moe.expert(seg, *w) for seg, w in zip(xr[perm].split(sizes), moe._weights(0, Er))])  # (R, C)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=x.device)  # inverse permutation
        ys = ys[back]  # (R, C) in arrival order again
        yh = all_to_all(ys, recv, send, self.group, self.bytes)  # (A, C) home, in `order`
        out = torch.zeros_like(h).index_add_(0, order // K, yh * gates.reshape(-1)[order, None])  # (N, C)
        return out.view(B, T, C), logits


# --------------------------------------------------------------------------- a local launcher
@dataclass
class ExpertParallelResult:
    """What `run_expert_parallel` measured, assembled across ranks (rows in rank order)."""

    world_size: int
    layer: dict  # MoE constructor arguments
    state_dict: dict  # the full layer's weights (every rank started from these)
    x: torch.Tensor  # (P·B, T, C) all tokens; rank r had rows r·B..(r+1)·B-1
    grad_output: torch.Tensor  # (P·B, T, C) the cotangent: each rank's loss is (y_r · g_r).sum()
    y: torch.Tensor  # (P·B, T, C)
    x_grad: torch.Tensor  # (P·B, T, C)
    grads: dict  # parameter name -> full gradient (experts stitched from their owners; router summed)
    bytes: list[dict] = field(default_factory=list)  # per rank: forward/backward bytes sent and received
    rows_sent: list[list[int]] = field(default_factory=list)  # per rank: rows sent to each rank (dispatch)
    seconds: list[float] = field(default_factory=list)  # per rank: forward + backward wall time


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_inputs(layer: dict, world_size: int, batch_per_rank: int, seq_len: int, seed: int):
    torch.manual_seed(seed)
    moe = MoE(**layer)
    g = torch.Generator().manual_seed(seed + 1)
    shape = (world_size * batch_per_rank, seq_len, layer["d_model"])
    return moe, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _worker(
    rank: int, world_size: int, port: int, layer: dict, batch_per_rank: int, seq_len: int, seed: int, out_dir: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        moe, x, g = _make_inputs(layer, world_size, batch_per_rank, seq_len, seed)
        ep = ExpertParallelMoE(moe)
        rows = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
        xr = x[rows].clone().requires_grad_(True)
        start = time.perf_counter()
        y, _ = ep(xr)
        (y * g[rows]).sum().backward()
        seconds = time.perf_counter() - start
        router_grad = ep.layer.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # the replicated router: every rank's tokens contribute
        grads = {"router.weight": router_grad}
        grads.update({n: getattr(ep.layer, n).grad for n in ("w1", "w2", "w3") if getattr(ep.layer, n) is not None})
        torch.save(
            dict(
                y=y.detach(),
                x_grad=xr.grad,
                grads=grads,
                bytes=dict(ep.bytes),
                seconds=seconds,
                rows_sent=ep.last_rows_sent,
            ),
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def run_expert_parallel(
    world_size: int = 2,
    *,
    d_model: int = 16,
    d_ff: int = 32,
    num_experts: int = 4,
    top_k: int = 2,
    activation: str = "gelu",
    gating: str = "topk_softmax",
    batch_per_rank: int = 2,
    seq_len: int = 8,
    seed: int = 0,
    timeout: float = 120.0,
) -> ExpertParallelResult:
    """Run one forward and backward of an MoE layer split over `world_size` local processes (gloo on
    127.0.0.1, a free port), each holding `batch_per_rank` rows of a seeded batch and E/P experts.
    Returns outputs, input and weight gradients, and bytes exchanged per rank (`ExpertParallelResult`)."""
    require_int("world_size", world_size, minimum=1)
    require_int("batch_per_rank", batch_per_rank, minimum=1)
    require_int("seq_len", seq_len, minimum=1)
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    layer = dict(d_model=d_model, d_ff=d_ff, num_experts=num_experts, top_k=top_k, activation=activation, gating=gating)
    MoE(**layer)  # argument errors here, in the parent, rather than in P children
    if num_experts % world_size:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by world_size ({world_size})")
    moe, x, g = _make_inputs(layer, world_size, batch_per_rank, seq_len, seed)
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, _free_port(), layer, batch_per_rank, seq_len, seed, out_dir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"expert-parallel workers did not finish within {timeout} s")
        parts = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]
    grads = {"router.weight": parts[0]["grads"]["router.weight"]}
    for name in parts[0]["grads"]:
        if name != "router.weight":
            grads[name] = torch.cat([p["grads"][name] for p in parts])  # (E, ...) from E/P per owner
    return ExpertParallelResult(
        world_size=world_size,
        layer=layer,
        state_dict={k: v.clone() for k, v in moe.state_dict().items()},
        x=x,
        grad_output=g,
        y=torch.cat([p["y"] for p in parts]),
        x_grad=torch.cat([p["x_grad"] for p in parts]),
        grads=grads,
        bytes=[p["bytes"] for p in parts],
        rows_sent=[p["rows_sent"] for p in parts],
        seconds=[p["seconds"] for p in parts],
    )


def single_process_reference(result: ExpertParallelResult) -> dict:
    """The same forward and backward in one process with one lib.moe.MoE: y, x_grad and grads."""
    if not isinstance(result, ExpertParallelResult):
        raise TypeError(f"result must be an ExpertParallelResult, got {type(result).__name__}")
    moe = MoE(**result.layer)
    moe.load_state_dict(result.state_dict)
    x = result.x.clone().requires_grad_(True)
    y, _ = moe(x)
    (y * result.grad_output).sum().backward()
    grads = {"router.weight": moe.router.weight.grad}
    grads.update({n: getattr(moe, n).grad for n in ("w1", "w2", "w3") if getattr(moe, n) is not None})
    return dict(y=y.detach(), x_grad=x.grad, grads=grads)
