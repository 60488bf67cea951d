"""Paged KV memory: PagedAttention's block table in plain PyTorch.

Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP 2023 (arXiv 2309.06180). A server that keeps each request's KV cache in one contiguous range
must reserve it at admission, before it knows the output's length, and wastes memory three ways
(§3 of the paper; `lib.serving` lists them and measures them step by step).

PagedAttention stores K/V in fixed-size blocks of b tokens anywhere in a pool, and a per-sequence
block table maps logical block i to its physical block (the OS page table idea). A request takes
one block at a time as it grows, so the only waste is the unfilled tail of its last block.

    BlockAllocator, OutOfBlocks   a pool of physical block ids, lowest free id first
    PagedKVCache                  one layer's K/V blocks (N, H_kv, b, D) and a block table per sequence
    PAD_BLOCK                     -1: what pads a shorter sequence's row of a batched block table (no
                                  block has that id, so a padded entry can never be taken for a real one)
    paged_attention               attention over K/V gathered through block tables (the paper's §4.1
                                  kernel, here as gather + mask + lib.attention.attention)
    paged_attention_ref           the same per sequence on its own contiguous K/V: the truth

Glossary: B batch (sequences), H query heads, H_kv key/value heads (H_kv divides H), D head dim,
T new query tokens per sequence (1 while decoding), S tokens of a sequence, N physical blocks in
the pool, b block size (tokens per block), M blocks in the longest block table.
"""

from __future__ import annotations

import heapq

import torch

from lib._checks import require_int, require_rank, require_same, require_tensor
from lib._door import door
from lib.attention import attention, attention_ref
from lib.masks import additive_from_bool

__all__ = ["PAD_BLOCK", "BlockAllocator", "OutOfBlocks", "PagedKVCache", "paged_attention", "paged_attention_ref"]

PAD_BLOCK = -1  # pads block-table rows past a sequence's last block; physical ids are 0..N-1


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

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
        ):
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
        """(B, M) int64 physical block ids, one row per sequence; a row shorter than the longest is
        padded with PAD_BLOCK (-1), which is no block's id (paged_attention refuses it where the
        sequence has tokens and masks every key past the sequence's length)."""
        ids = self._check_ids(seq_ids)
        M = max(len(self.tables[s]) for s in ids)
        rows = [self.tables[s] + [PAD_BLOCK] * (M - len(self.tables[s])) for s in ids]
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
# A block holding some of a sequence's tokens must be a real id; past its last one, PAD_BLOCK may pad.
_REAL_IDS = (
    "bool((((block_table >= 0) & (block_table < N)) | ((block_table == PAD_BLOCK) & "
    "(torch.arange(M, device=seq_lens.device)[None, :] * b >= seq_lens[:, None]))).all())"
)


@door(
    q="float (B, H, T, D)",
    k_blocks="float (N, H_kv, b, D)",
    v_blocks="float (N, H_kv, b, D_v)",
    block_table="int (B, M)",
    seq_lens="int (B,)",
    same_dtype="q k_blocks v_blocks",
    where={
        "H % H_kv == 0": "the query heads H must be a multiple of the key/value heads H_kv",
        "bool(((seq_lens >= T) & (seq_lens <= M * b)).all())": "seq_lens must lie in [T={T}, M*b={M * b}] (the "
        "queries are each sequence's last T tokens; its table holds M={M} blocks of b={b}), got {seq_lens.tolist()}",
        _REAL_IDS: "block_table holds physical block ids, which must be in [0, N={N}) (PAD_BLOCK={PAD_BLOCK} only "
        "after a sequence's last block); got values in [{int(block_table.min())}, {int(block_table.max())}]",
    },
)
def paged_attention(
    q, k_blocks, v_blocks, block_table, seq_lens, *, scale: float | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Causal attention for B sequences whose keys and values live in blocks.

    q (B, H, T, D): the newest T tokens of each sequence (T = 1 for a decode step);
    k_blocks (N, H_kv, b, D), v_blocks (N, H_kv, b, D_v): the block pool;
    block_table (B, M) int64 (or int32): physical block of each sequence's logical block; after a
    sequence's last block, PAD_BLOCK (or any id: those keys are masked);
    seq_lens (B,) int64 (or int32): tokens of each sequence, its queries included.
    Returns (B, H, T, D_v). Query i of sequence β sits at position seq_lens[β] - T + i and sees
    keys j <= that position (bottom-right causal alignment per sequence).
    """
    B, H, T, D = q.shape
    N, H_kv, b, _ = k_blocks.shape
    M = block_table.shape[1]
    S = M * b  # padded key length
    ids = block_table.clamp(min=0)  # PAD_BLOCK -> block 0: fetched, then masked out below with the stale slots
    k = k_blocks[ids]  # (B, M) ids -> (B, M, H_kv, b, D)
    v = v_blocks[ids]  # (B, M, H_kv, b, D_v)
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
            raise TypeError(
                f"{name} must be a list of B={B} tensors (H_kv, S_b, D), got {type(xs).__name__}"
                + (f" of length {len(xs)}" if isinstance(xs, (list, tuple)) else "")
            )
        for i, x in enumerate(xs):
            require_tensor(f"{name}[{i}]", x, floating=True)
            require_rank(f"{name}[{i}]", x, 3, "(H_kv, S_b, D)")
    outs = [
        attention_ref(q[i : i + 1], ks[i][None], vs[i][None], causal=True, scale=scale)  # (1, H, T, D_v)
        for i in range(B)
    ]
    return torch.cat(outs, dim=0)
