"""Paged KV memory: PagedAttention's block table in plain PyTorch, and a serving simulator.

Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP 2023 (arXiv 2309.06180). A server that stores each request's KV cache as one contiguous
range must reserve that range when the request is admitted, before it knows how long the output
will be. §3 of the paper names three ways this wastes KV memory:

    reserved slots           slots kept for tokens the request has not generated yet (they will
                             be filled, but hold nothing useful meanwhile)
    internal fragmentation   slots beyond the request's true final length: over-provisioning to
                             the maximum length, never filled
    external fragmentation   free memory between allocations, in holes too small for the next
                             request

PagedAttention stores K/V in fixed-size blocks of b tokens anywhere in a pool, and a per-sequence
block table maps logical block i to its physical block (the OS page table idea). A request takes
one block at a time as it grows, so the only waste is the unfilled tail of its last block.

    BlockAllocator, OutOfBlocks   a pool of physical block ids, lowest free id first
    PagedKVCache                  one layer's K/V blocks (N, H_kv, b, D) and a block table per sequence
    paged_attention               attention over K/V gathered through block tables (the paper's §4.1
                                  kernel, here as gather + mask + lib.attention.attention)
    paged_attention_ref           the same per sequence on its own contiguous K/V: the truth
    Request, make_workload        a synthetic serving workload (Poisson arrivals, geometric lengths)
    simulate_serving, SimResult   a server's KV memory step by step, contiguous or paged
    sweep_block_sizes             the paged simulation over several block sizes

Glossary: B batch (sequences), H query heads, H_kv key/value heads (H_kv divides H), D head dim,
T new query tokens per sequence (1 while decoding), S tokens of a sequence, N physical blocks in
the pool, b block size (tokens per block), M blocks in the longest block table.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import torch

from lib._checks import require_int, require_rank, require_real, require_same, require_tensor
from lib.attention import attention, attention_ref
from lib.masks import additive_from_bool

__all__ = [
    "POLICIES",
    "RESERVE_RULES",
    "BlockAllocator",
    "OutOfBlocks",
    "PagedKVCache",
    "Request",
    "SimResult",
    "make_workload",
    "paged_attention",
    "paged_attention_ref",
    "simulate_serving",
    "sweep_block_sizes",
]

POLICIES = ("contiguous", "paged")
RESERVE_RULES = ("max_len", "pow2", "oracle")


# --------------------------------------------------------------------------- blocks
class OutOfBlocks(RuntimeError):
    """The block pool has no free block left."""


class BlockAllocator:
    """Hands out physical block ids 0..num_blocks-1, always the lowest free one (deterministic)."""

    def __init__(self, num_blocks: int):
        require_int("num_blocks", num_blocks, minimum=1)
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a min-heap (a sorted list is already one)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use; free a sequence first")
        block = heapq.heappop(self._free)
        self._used.add(block)
        return block

    def free(self, block_id: int) -> None:
        require_int("block_id", block_id, minimum=0)
        if block_id >= self.num_blocks:
            raise ValueError(f"block_id must be < num_blocks={self.num_blocks}, got {block_id}")
        if block_id not in self._used:
            raise ValueError(f"block {block_id} is not allocated (double free?)")
        self._used.remove(block_id)
        heapq.heappush(self._free, block_id)

    def free_many(self, block_ids) -> None:
        """Free several blocks; all or none (any unallocated id raises before anything is freed)."""
        ids = list(block_ids)
        if len(set(ids)) != len(ids) or not self._used.issuperset(ids):
            bad = sorted({i for i in ids if i not in self._used or ids.count(i) > 1}, key=repr)
            raise ValueError(f"blocks {bad} are not allocated or are listed twice (double free?)")
        self._used.difference_update(ids)
        for block_id in ids:
            heapq.heappush(self._free, block_id)


class PagedKVCache:
    """One attention layer's keys and values in a pool of blocks, addressed through block tables.

    k_blocks, v_blocks: (N, H_kv, b, D). Sequence `seq_id` holds S tokens; its token at position
    p lives in physical block `table[p // b]` at offset `p % b`.
    """

    def __init__(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device=None):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("n_kv_heads", n_kv_heads),
                            ("head_dim", head_dim)):
            require_int(name, value, minimum=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype}")
        shape = (num_blocks, n_kv_heads, block_size, head_dim)  # (N, H_kv, b, D)
        self.k_blocks = torch.zeros(shape, dtype=dtype, device=device)
        self.v_blocks = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[int, list[int]] = {}  # seq_id -> physical block ids, logical order
        self.lengths: dict[int, int] = {}  # seq_id -> tokens written

    def _known(self, seq_id) -> int:
        require_int("seq_id", seq_id, minimum=0)
        if seq_id not in self.tables:
            raise ValueError(f"seq_id {seq_id} is not in the cache (known: {sorted(self.tables)})")
        return seq_id

    def append(self, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (H_kv, T, D) as the next T tokens of `seq_id`, taking blocks as needed.

        The write may start mid-block and span several blocks. If the pool cannot hold all T
        tokens, nothing is written and `OutOfBlocks` is raised.
        """
        require_int("seq_id", seq_id, minimum=0)
        _, H_kv, b, D = self.k_blocks.shape
        for name, x in (("k", k), ("v", v)):
            require_tensor(name, x, floating=True)
            require_rank(name, x, 3, "(H_kv, T, D)")
            if x.shape[0] != H_kv or x.shape[2] != D or x.shape[1] < 1:
                raise ValueError(f"{name} must have shape (H_kv, T, D) = ({H_kv}, T>=1, {D}), got {tuple(x.shape)}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must hold the same number of tokens, got {k.shape[1]} and {v.shape[1]}")
        require_same(("k", "v", "k_blocks"), (k, v, self.k_blocks), "device")
        table = self.tables.get(seq_id, [])
        start = self.lengths.get(seq_id, 0)
        end = start + k.shape[1]
        need = -(-end // b) - len(table)
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"seq_id {seq_id} needs {need} more blocks, only {self.allocator.num_free} are free")
        table = table + [self.allocator.allocate() for _ in range(need)]
        pos = torch.arange(start, end, device=k.device)  # (T,) logical positions
        phys = torch.tensor(table, dtype=torch.long, device=k.device)[pos // b]  # (T,) physical block of each
        offset = pos % b  # (T,)
        # Two index tensors split by a slice: the indexed dim T comes first, (T, H_kv, D).
        self.k_blocks[phys, :, offset] = k.transpose(0, 1).to(self.k_blocks.dtype)  # (H_kv, T, D) -> (T, H_kv, D)
        self.v_blocks[phys, :, offset] = v.transpose(0, 1).to(self.v_blocks.dtype)
        self.tables[seq_id], self.lengths[seq_id] = table, end

    def free(self, seq_id: int) -> None:
        """Return every block of `seq_id` to the pool and forget it."""
        self.allocator.free_many(self.tables.pop(self._known(seq_id)))
        del self.lengths[seq_id]

    def _check_ids(self, seq_ids) -> list[int]:
        if not isinstance(seq_ids, (list, tuple)) or not seq_ids:
            raise TypeError(f"seq_ids must be a non-empty list of sequence ids, got {seq_ids!r}")
        return [self._known(s) for s in seq_ids]

    def block_table(self, seq_ids) -> torch.Tensor:
        """(B, M) int64 physical block ids, one row per sequence, padded with block 0 (the
        padding is never read: paged_attention masks keys past each sequence's length)."""
        ids = self._check_ids(seq_ids)
        M = max(len(self.tables[s]) for s in ids)
        rows = [self.tables[s] + [0] * (M - len(self.tables[s])) for s in ids]
        return torch.tensor(rows, dtype=torch.long, device=self.k_blocks.device)

    def seq_lens(self, seq_ids) -> torch.Tensor:
        """(B,) int64 tokens held by each sequence."""
        ids = self._check_ids(seq_ids)
        return torch.tensor([self.lengths[s] for s in ids], dtype=torch.long, device=self.k_blocks.device)

    def gather(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's k, v as contiguous (H_kv, S, D) tensors (copies)."""
        self._known(seq_id)
        table = torch.tensor(self.tables[seq_id], dtype=torch.long, device=self.k_blocks.device)
        S, (_, H_kv, b, D) = self.lengths[seq_id], self.k_blocks.shape
        out = []
        for blocks in (self.k_blocks, self.v_blocks):
            x = blocks[table]  # (n, H_kv, b, D), n = blocks of this sequence
            x = x.transpose(0, 1).reshape(H_kv, len(table) * b, D)  # (H_kv, n, b, D) -> (H_kv, n*b, D)
            out.append(x[:, :S].contiguous())
        return out[0], out[1]


# --------------------------------------------------------------------------- attention
def _check_paged(q, k_blocks, v_blocks, block_table, seq_lens) -> None:
    for name, x in (("q", q), ("k_blocks", k_blocks), ("v_blocks", v_blocks)):
        require_tensor(name, x, floating=True)
    require_rank("q", q, 4, "(B, H, T, D)")
    require_rank("k_blocks", k_blocks, 4, "(N, H_kv, b, D)")
    require_rank("v_blocks", v_blocks, 4, "(N, H_kv, b, D_v)")
    require_same(("q", "k_blocks", "v_blocks"), (q, k_blocks, v_blocks), "dtype")
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens)):
        require_tensor(name, x)
        if x.dtype != torch.long:
            raise TypeError(f"{name} must be an int64 (torch.long) tensor, got {x.dtype}")
    require_rank("block_table", block_table, 2, "(B, M)")
    require_rank("seq_lens", seq_lens, 1, "(B,)")
    require_same(("q", "k_blocks", "v_blocks", "block_table", "seq_lens"),
                 (q, k_blocks, v_blocks, block_table, seq_lens), "device")
    if 0 in q.shape or 0 in k_blocks.shape or 0 in v_blocks.shape or 0 in block_table.shape:
        raise ValueError(f"no dimension may be empty, got q {tuple(q.shape)}, k_blocks {tuple(k_blocks.shape)}, "
                         f"v_blocks {tuple(v_blocks.shape)}, block_table {tuple(block_table.shape)}")
    B, H, T, D = q.shape
    N, H_kv, b, D_k = k_blocks.shape
    if tuple(v_blocks.shape[:3]) != (N, H_kv, b):
        raise ValueError(f"k_blocks (N, H_kv, b, D) and v_blocks (N, H_kv, b, D_v) must agree on N, H_kv, b, "
                         f"got {tuple(k_blocks.shape)} and {tuple(v_blocks.shape)}")
    if D_k != D:
        raise ValueError(f"q (B, H, T, D) and k_blocks (N, H_kv, b, D) must share D, got {D} and {D_k}")
    if H % H_kv != 0:
        raise ValueError(f"the query heads H={H} must be a multiple of the key/value heads H_kv={H_kv}")
    if block_table.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(f"block_table (B, M) and seq_lens (B,) need B={B} rows (q's batch), "
                         f"got {tuple(block_table.shape)} and {tuple(seq_lens.shape)}")
    if bool((block_table < 0).any()) or bool((block_table >= N).any()):
        raise ValueError(f"block_table holds physical block ids, which must be in [0, N={N}); "
                         f"got values in [{int(block_table.min())}, {int(block_table.max())}]")
    capacity = block_table.shape[1] * b
    if bool((seq_lens < T).any()) or bool((seq_lens > capacity).any()):
        raise ValueError(f"seq_lens must lie in [T={T}, M*b={capacity}] (the queries are each sequence's last T "
                         f"tokens; its table holds M={block_table.shape[1]} blocks of b={b}), got {seq_lens.tolist()}")


def paged_attention(q, k_blocks, v_blocks, block_table, seq_lens, *, scale: float | None = None,
                    backend: str = "auto") -> torch.Tensor:
    """Causal attention for B sequences whose keys and values live in blocks.

    q (B, H, T, D): the newest T tokens of each sequence (T = 1 for a decode step);
    k_blocks (N, H_kv, b, D), v_blocks (N, H_kv, b, D_v): the block pool;
    block_table (B, M) int64: physical block of each sequence's logical block (padding: any id);
    seq_lens (B,) int64: tokens of each sequence, its queries included.
    Returns (B, H, T, D_v). Query i of sequence β sits at position seq_lens[β] - T + i and sees
    keys j <= that position (bottom-right causal alignment per sequence).
    """
    _check_paged(q, k_blocks, v_blocks, block_table, seq_lens)
    B, H, T, D = q.shape
    N, H_kv, b, _ = k_blocks.shape
    M = block_table.shape[1]
    S = M * b  # padded key length
    k = k_blocks[block_table]  # (B, M) ids -> (B, M, H_kv, b, D)
    v = v_blocks[block_table]  # (B, M, H_kv, b, D_v)
    # Logical position m*b + offset: put heads first, then fuse (block, offset) into one key axis.
    k = k.permute(0, 2, 1, 3, 4).reshape(B, H_kv, S, D)  # (B, M, H_kv, b, D) -> (B, H_kv, M*b, D)
    v = v.permute(0, 2, 1, 3, 4).reshape(B, H_kv, S, v.shape[-1])  # -> (B, H_kv, M*b, D_v)
    # Slots past a sequence's length hold another request's stale tokens, or never-written memory
    # (a real pool is torch.empty, possibly NaN bit patterns): zero them, since a weight of exactly
    # 0 times NaN is still NaN.
    key_pos = torch.arange(S, device=q.device)  # (S,)
    stale = (key_pos[None, :] >= seq_lens[:, None])[:, None, :, None]  # (B, S) -> (B, 1, S, 1)
    k, v = k.masked_fill(stale, 0.0), v.masked_fill(stale, 0.0)
    # lib.attention's causal=True would align every sequence's queries to the padded end S, wrong
    # for shorter ones; so the causal and the padding conditions go into one mask here.
    query_pos = seq_lens[:, None] - T + torch.arange(T, device=q.device)[None, :]  # (B, T)
    keep = key_pos[None, None, :] <= query_pos[:, :, None]  # (B, T, S); implies key_pos < seq_len
    mask = additive_from_bool(keep, dtype=q.dtype)[:, None]  # (B, T, S) -> (B, 1, T, S)
    return attention(q, k, v, mask=mask, causal=False, scale=scale, backend=backend)


def paged_attention_ref(q: torch.Tensor, ks, vs, *, scale: float | None = None) -> torch.Tensor:
    """The truth: per sequence β, `attention_ref(q[β], ks[β], vs[β], causal=True)`.

    q (B, H, T, D); ks, vs: lists of B tensors (H_kv, S_β, D), each sequence's own contiguous K/V.
    Returns (B, H, T, D_v).
    """
    require_tensor("q", q, floating=True)
    require_rank("q", q, 4, "(B, H, T, D)")
    B = q.shape[0]
    for name, xs in (("ks", ks), ("vs", vs)):
        if not isinstance(xs, (list, tuple)) or len(xs) != B:
            raise TypeError(f"{name} must be a list of B={B} tensors (H_kv, S_b, D), got {type(xs).__name__}"
                            + (f" of length {len(xs)}" if isinstance(xs, (list, tuple)) else ""))
        for i, x in enumerate(xs):
            require_tensor(f"{name}[{i}]", x, floating=True)
            require_rank(f"{name}[{i}]", x, 3, "(H_kv, S_b, D)")
    outs = [attention_ref(q[i:i + 1], ks[i][None], vs[i][None], causal=True, scale=scale)  # (1, H, T, D_v)
            for i in range(B)]
    return torch.cat(outs, dim=0)


# --------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Request:
    """A serving request: arrives at step `arrival`, brings `prompt_len` tokens, will generate
    `output_len` (which the server does not know in advance, except under reserve="oracle")."""

    rid: int
    arrival: int
    prompt_len: int
    output_len: int

    def __post_init__(self):
        require_int("rid", self.rid, minimum=0)
        require_int("arrival", self.arrival, minimum=0)
        require_int("prompt_len", self.prompt_len, minimum=1)
        require_int("output_len", self.output_len, minimum=1)


def _geometric(rng: random.Random, mean: float) -> int:
    """A draw from the geometric distribution on {1, 2, ...} with the given mean, by inversion."""
    if mean == 1.0:
        return 1
    u = 1.0 - rng.random()  # in (0, 1]
    return 1 + int(math.log(u) / math.log(1.0 - 1.0 / mean))


def make_workload(n_requests: int, *, seed: int = 0, arrival_rate: float = 1.0, prompt_mean: float = 200,
                  output_mean: float = 200, max_len: int = 1024) -> list[Request]:
    """`n_requests` synthetic requests, rid 0..n-1 in arrival order.

    Arrivals: a Poisson process with `arrival_rate` requests per step (exponential gaps with mean
    1/arrival_rate, the first gap counted from time 0); a request arriving at time τ is seen at
    step floor(τ). Lengths: prompt and output are independent geometric draws on {1, 2, ...} with
    means `prompt_mean` and `output_mean` (the discrete exponential: many short requests, a long
    tail). Then the prompt is cut to max_len - 1 and the output to max_len - prompt, so every
    request fits the model's context; the cut puts a little probability mass at the cap.
    Draws come from `random.Random(seed)`, per request in the order gap, prompt, output.
    """
    require_int("n_requests", n_requests, minimum=1)
    require_int("seed", seed, minimum=0)
    rate = require_real("arrival_rate", arrival_rate, above=0)
    p_mean = require_real("prompt_mean", prompt_mean, at_least=1)
    o_mean = require_real("output_mean", output_mean, at_least=1)
    require_int("max_len", max_len, minimum=2)
    rng = random.Random(seed)
    time, out = 0.0, []
    for rid in range(n_requests):
        time += rng.expovariate(rate)
        prompt = min(_geometric(rng, p_mean), max_len - 1)
        output = min(_geometric(rng, o_mean), max_len - prompt)
        out.append(Request(rid=rid, arrival=int(time), prompt_len=prompt, output_len=output))
    return out


# --------------------------------------------------------------------------- simulator
@dataclass(repr=False)
class SimResult:
    """What `simulate_serving` measured. Per-step lists are indexed by step 0..makespan-1 and
    measured after the step's decode and admissions, before finished requests release memory.

    For each running request with reserved slots R, real tokens U (prompt + generated so far) and
    true final length F = prompt_len + output_len, the R slots split into
        U                  real tokens (K/V that exist)
        min(R, F) - U      reserved for future tokens: will be filled by this request later
        R - min(R, F)      internal fragmentation: will never be filled (R beyond F)
    Contiguous reservation with max_len has all three; paged has no internal fragmentation
    except in the last block of a request's final steps, and reserves at most b - 1 future slots.
    External fragmentation (`stranded_tokens`): at a step where requests wait, the free slots
    lying in holes smaller than the reservation the first waiting request needs; 0 when nobody
    waits, and always 0 for paged (any free block can serve any request).
    """

    policy: str
    capacity_tokens: int
    max_len: int
    block_size: int | None  # paged only
    reserve: str | None  # contiguous only
    requests: tuple[Request, ...]
    used_tokens: list[int] = field(default_factory=list)
    reserved_tokens: list[int] = field(default_factory=list)
    future_tokens: list[int] = field(default_factory=list)
    stranded_tokens: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    finished_steps: dict[int, int] = field(default_factory=dict)  # rid -> step it finished
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens prefilled again when preempted requests were readmitted
    snapshots: list[tuple[int, tuple]] = field(default_factory=list)  # (step, layout), evenly spaced

    @property
    def makespan(self) -> int:
        """Steps from step 0 until the last request finished."""
        return len(self.used_tokens)

    @property
    def unit(self) -> int:
        """Tokens per memory unit of the snapshots: 1 (token slots) or the block size."""
        return self.block_size if self.policy == "paged" else 1

    @property
    def num_units(self) -> int:
        return self.capacity_tokens // self.unit

    def token_share(self) -> float:
        """Σ used / Σ reserved over all steps: the share of reserved slots holding real tokens."""
        return sum(self.used_tokens) / sum(self.reserved_tokens)

    def waste_share(self) -> float:
        """1 - token_share(): reserved for future tokens + internal fragmentation."""
        return 1.0 - self.token_share()

    def future_share(self) -> float:
        """Σ reserved-for-future-tokens / Σ reserved."""
        return sum(self.future_tokens) / sum(self.reserved_tokens)

    def internal_fragmentation(self) -> float:
        """Σ (reserved slots beyond each request's true final length) / Σ reserved."""
        reserved = sum(self.reserved_tokens)
        return (reserved - sum(self.used_tokens) - sum(self.future_tokens)) / reserved

    def external_fragmentation(self) -> float:
        """Σ stranded free slots / Σ capacity, over the steps where some request was waiting
        (0.0 if none ever waited)."""
        steps = sum(1 for w in self.waiting if w)
        return sum(self.stranded_tokens) / (steps * self.capacity_tokens) if steps else 0.0

    def token_share_of_capacity(self) -> float:
        """Σ used / (capacity × makespan): the share of the whole KV pool holding real tokens."""
        return sum(self.used_tokens) / (self.capacity_tokens * self.makespan)

    def mean_running(self) -> float:
        """Requests in the batch, averaged over all steps."""
        return sum(self.running) / self.makespan

    def max_running(self) -> int:
        return max(self.running)

    def throughput(self) -> float:
        """Output tokens of all requests per step (recomputation after preemption not counted)."""
        return sum(r.output_len for r in self.requests) / self.makespan

    def memory_map(self, index: int) -> dict:
        """Snapshot `index` as per-unit lists: `owner` (rid, or -1 when free) and `filled` (real
        tokens in the unit: 0/1 for token slots, 0..b for blocks); also `step` and `unit`."""
        require_int("index", index, minimum=0)
        if index >= len(self.snapshots):
            raise ValueError(f"index must be < {len(self.snapshots)} (the number of snapshots), got {index}")
        step, layout = self.snapshots[index]
        owner, filled = [-1] * self.num_units, [0] * self.num_units
        if self.policy == "contiguous":
            for rid, start, size, used in layout:
                owner[start:start + size] = [rid] * size
                filled[start:start + used] = [1] * used
        else:
            b = self.block_size
            for rid, blocks, used in layout:
                for block in blocks:
                    owner[block], filled[block] = rid, b
                filled[blocks[-1]] = used - (len(blocks) - 1) * b  # only the last block may have slack
        return {"step": step, "unit": self.unit, "owner": owner, "filled": filled}

    def label(self) -> str:
        if self.policy == "paged":
            return f"paged, {self.block_size}-token blocks"
        return f"contiguous, reserve {self.reserve}" + (f"={self.max_len}" if self.reserve == "max_len" else "")

    def summary(self) -> dict:
        """The headline numbers, rounded (shares to 4 decimals, means to 2)."""
        return {
            "policy": self.policy, "block_size": self.block_size, "reserve": self.reserve,
            "capacity_tokens": self.capacity_tokens, "max_len": self.max_len,
            "token_share": round(self.token_share(), 4),
            "future_share": round(self.future_share(), 4),
            "internal_fragmentation": round(self.internal_fragmentation(), 4),
            "external_fragmentation": round(self.external_fragmentation(), 4),
            "token_share_of_capacity": round(self.token_share_of_capacity(), 4),
            "mean_running": round(self.mean_running(), 2), "max_running": self.max_running(),
            "preemptions": self.preemptions, "makespan": self.makespan, "throughput": round(self.throughput(), 2),
        }

    def __repr__(self) -> str:
        return (f"SimResult({self.label()}, {len(self.requests)} requests, capacity {self.capacity_tokens} tokens, "
                f"makespan {self.makespan} steps, token share {self.token_share():.1%})")


class _Live:
    """A request inside the server: progress and where its memory is."""

    __slots__ = ("req", "generated", "start", "size", "blocks")

    def __init__(self, req: Request):
        self.req, self.generated, self.start, self.size, self.blocks = req, 0, 0, 0, []


def _reservation(req: Request, reserve: str, max_len: int) -> int:
    """Contiguous slots reserved at admission (the three Orca baselines of the paper's §6.1)."""
    if reserve == "max_len":
        return max_len
    if reserve == "pow2":  # output over-reserved by at most 2x: the next power of two
        return min(max_len, req.prompt_len + (1 << (req.output_len - 1).bit_length()))
    return req.prompt_len + req.output_len  # "oracle": knows the output length


def _check_sim_args(requests, policy, capacity_tokens, max_len, block_size, reserve, max_snapshots, max_steps):
    if not isinstance(requests, (list, tuple)) or not requests:
        raise TypeError(f"requests must be a non-empty list of Request, got {type(requests).__name__}")
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"requests[{i}] must be a Request, got {type(r).__name__}")
    if len({r.rid for r in requests}) != len(requests):
        raise ValueError("requests must have distinct rids")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if reserve not in RESERVE_RULES:
        raise ValueError(f"reserve must be one of {RESERVE_RULES}, got {reserve!r}")
    require_int("capacity_tokens", capacity_tokens, minimum=1)
    require_int("max_len", max_len, minimum=2)
    require_int("block_size", block_size, minimum=1)
    require_int("max_snapshots", max_snapshots, minimum=1)
    require_int("max_steps", max_steps, minimum=1)
    longest = max(requests, key=lambda r: r.prompt_len + r.output_len)
    if longest.prompt_len + longest.output_len > max_len:
        raise ValueError(f"request {longest.rid} has prompt_len + output_len = {longest.prompt_len + longest.output_len}"
                         f" > max_len={max_len}")
    if policy == "contiguous":
        need = max(_reservation(r, reserve, max_len) for r in requests)
        if need > capacity_tokens:
            raise ValueError(f"capacity_tokens={capacity_tokens} is smaller than one request's reservation ({need} "
                             f"slots under reserve={reserve!r}): that request could never run")
    else:
        blocks = capacity_tokens // block_size
        need = -(-(longest.prompt_len + longest.output_len) // block_size)
        if need > blocks:
            raise ValueError(f"capacity_tokens={capacity_tokens} holds {blocks} blocks of {block_size}, but request "
                             f"{longest.rid} needs {need}: it could never run")


def simulate_serving(requests, *, policy: str, capacity_tokens: int, max_len: int = 1024, block_size: int = 16,
                     reserve: str = "max_len", watermark: float = 0.0, max_snapshots: int = 60,
                     max_steps: int = 1_000_000) -> SimResult:
    """Serve `requests` step by step with `capacity_tokens` KV slots; measure the memory.

    The model of a server (one slot holds one token's K/V for every layer; all slots equal):
    - Step t: (1) requests with arrival <= t join the back of the waiting queue; (2) decode: every
      running request admitted before step t generates one token, oldest admission first;
      (3) admission: the head of the queue is admitted while its memory fits, strictly first come
      first served (no skipping ahead); admission prefills the prompt (plus any tokens generated
      before a preemption: recomputation) and yields one new token in the same step;
      (4) measure; (5) requests that have generated output_len tokens finish and free memory.
    - A request holds prompt_len + generated slots of real tokens (the newest token's slot counts
      from the step it is sampled). Compute time is not modelled: every step costs the same
      whatever the batch size; there is no batch-size cap, only the memory limit.
    - policy="contiguous": at admission the request reserves one contiguous range of slots in a
      line of capacity_tokens, placed first-fit (lowest free address). Its size under
      `reserve`: "max_len" (the model's maximum length, Orca (Max) in the paper's §6.1), "pow2"
      (prompt + the output length rounded up to a power of two, capped at max_len: Orca (Pow2)),
      "oracle" (prompt + the true output length: Orca (Oracle)). A reservation never grows, so
      nothing is ever preempted.
    - policy="paged": capacity_tokens // block_size blocks, any block for any request (lowest
      free id first). Admission needs ceil((prompt + generated + 1) / b) free blocks; a running
      request takes one more block when its new token starts one. If none is free, the most
      recently admitted running request is preempted (possibly the one asking): its blocks are
      freed and it goes to the front of the waiting queue, to be recomputed on readmission
      (vLLM's recompute preemption, §4.5). `watermark` > 0 makes admission leave that fraction
      of the blocks free while anything runs (vLLM's scheduler keeps int(0.01 * blocks) by
      default), trading a little concurrency for fewer preemptions; the default 0 here admits
      whenever the blocks fit.
    `block_size` and `watermark` are ignored for contiguous, `reserve` for paged. Snapshots of the
    memory layout are taken every k-th step, k doubling as needed to keep at most `max_snapshots`.
    Raises ValueError if some request could never fit, RuntimeError past `max_steps` steps.
    """
    _check_sim_args(requests, policy, capacity_tokens, max_len, block_size, reserve, max_snapshots, max_steps)
    watermark = require_real("watermark", watermark, at_least=0)
    if watermark >= 1.0:
        raise ValueError(f"watermark must be a fraction of the blocks in [0, 1), got {watermark}")
    paged = policy == "paged"
    b = block_size
    res = SimResult(policy=policy, capacity_tokens=capacity_tokens, max_len=max_len,
                    block_size=b if paged else None, reserve=None if paged else reserve, requests=tuple(requests))
    arrivals = deque(sorted(requests, key=lambda r: r.arrival))  # stable: ties keep the given order
    waiting: deque[_Live] = deque()
    running: list[_Live] = []  # admission order: the last one is the preemption victim
    allocator = BlockAllocator(capacity_tokens // b) if paged else None
    keep_free = int(watermark * (capacity_tokens // b)) if paged else 0  # blocks admission leaves free
    ranges: list[tuple[int, int, int]] = []  # contiguous: (start, end, rid), sorted by start
    stride, n_done, t = 1, 0, 0

    while n_done < len(requests):
        if t >= max_steps:
            raise RuntimeError(f"simulation passed max_steps={max_steps} with {len(requests) - n_done} requests "
                               f"unfinished; raise max_steps")
        while arrivals and arrivals[0].arrival <= t:  # (1) arrivals
            waiting.append(_Live(arrivals.popleft()))

        if paged:  # (2) decode
            i = 0
            while i < len(running):
                r = running[i]
                if r.req.prompt_len + r.generated + 1 > len(r.blocks) * b:  # the new token opens a block
                    victim = None
                    while allocator.num_free == 0 and victim is not r:
                        victim = running.pop()
                        allocator.free_many(victim.blocks)
                        victim.blocks = []
                        waiting.appendleft(victim)  # older victims end up ahead of newer ones
                        res.preemptions += 1
                    if victim is r:
                        break  # r preempted itself: it was the last running request
                    r.blocks.append(allocator.allocate())
                r.generated += 1
                i += 1
        else:
            for r in running:
                r.generated += 1

        while waiting:  # (3) admission, first come first served
            r = waiting[0]
            held = r.req.prompt_len + r.generated  # tokens to prefill (recompute after preemption)
            if paged:
                need = -(-(held + 1) // b)
                if need > allocator.num_free or (running and need + keep_free > allocator.num_free):
                    break
                r.blocks = [allocator.allocate() for _ in range(need)]
            else:
                size = _reservation(r.req, reserve, max_len)
                start, at = _first_fit(ranges, size, capacity_tokens)
                if start is None:
                    break
                ranges.insert(at, (start, start + size, r.req.rid))
                r.start, r.size = start, size
            if r.generated:  # readmitted after a preemption: its prompt and output are prefilled again
                res.recomputed_tokens += held
            waiting.popleft()
            r.generated += 1
            running.append(r)

        used = reserved = future = 0  # (4) measure
        for r in running:
            u = r.req.prompt_len + r.generated
            size = len(r.blocks) * b if paged else r.size
            used, reserved = used + u, reserved + size
            future += min(size, r.req.prompt_len + r.req.output_len) - u
        stranded = 0
        if waiting and not paged:
            need = _reservation(waiting[0].req, reserve, max_len)
            stranded = sum(h for h in _holes(ranges, capacity_tokens) if h < need)
        res.used_tokens.append(used)
        res.reserved_tokens.append(reserved)
        res.future_tokens.append(future)
        res.stranded_tokens.append(stranded)
        res.running.append(len(running))
        res.waiting.append(len(waiting))
        if t % stride == 0:
            if paged:
                layout = tuple((r.req.rid, tuple(r.blocks), r.req.prompt_len + r.generated) for r in running)
            else:
                layout = tuple((r.req.rid, r.start, r.size, r.req.prompt_len + r.generated) for r in running)
            res.snapshots.append((t, layout))
            if len(res.snapshots) > max_snapshots:
                stride *= 2
                res.snapshots = [s for s in res.snapshots if s[0] % stride == 0]

        done = [r for r in running if r.generated >= r.req.output_len]  # (5) finish
        if done:
            running = [r for r in running if r.generated < r.req.output_len]
            for r in done:
                res.finished_steps[r.req.rid] = t
                if paged:
                    allocator.free_many(r.blocks)
                else:
                    ranges = [x for x in ranges if x[2] != r.req.rid]
            n_done += len(done)
        t += 1
    return res


def _first_fit(ranges, size: int, capacity: int) -> tuple[int | None, int]:
    """Lowest start where `size` slots are free, and the index to insert the range at."""
    prev_end = 0
    for i, (start, end, _) in enumerate(ranges):
        if start - prev_end >= size:
            return prev_end, i
        prev_end = end
    return (prev_end, len(ranges)) if capacity - prev_end >= size else (None, len(ranges))


def _holes(ranges, capacity: int) -> list[int]:
    """Sizes of the free gaps between contiguous ranges, the tail included."""
    holes, prev_end = [], 0
    for start, end, _ in ranges:
        holes.append(start - prev_end)
        prev_end = end
    holes.append(capacity - prev_end)
    return [h for h in holes if h > 0]


def sweep_block_sizes(requests, *, capacity_tokens: int, max_len: int = 1024, block_sizes=(1, 2, 4, 8, 16, 32, 64),
                      max_snapshots: int = 1, watermark: float = 0.0) -> list[dict]:
    """`simulate_serving(policy="paged")` once per block size; one `summary()` dict each."""
    if not isinstance(block_sizes, (list, tuple)) or not block_sizes:
        raise TypeError(f"block_sizes must be a non-empty list of ints, got {block_sizes!r}")
    return [simulate_serving(requests, policy="paged", capacity_tokens=capacity_tokens, max_len=max_len,
                             block_size=b, max_snapshots=max_snapshots, watermark=watermark).summary()
            for b in block_sizes]
