"""lib.paging: attention through a block table equals attention on each sequence's own contiguous
K/V, and the table really matters; the cache returns what was written; the allocator never hands
a block out twice. (The serving simulator is tests/lib/test_serving.py.)"""

import pytest
import torch
from refusals import assert_refuses, not_float, refusal_test, rows

from lib.paging import PAD_BLOCK, BlockAllocator, OutOfBlocks, PagedKVCache, paged_attention, paged_attention_ref


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- allocator
def test_allocator_hands_out_lowest_free_block_and_never_twice():
    alloc = BlockAllocator(5)
    got = [alloc.allocate() for _ in range(5)]
    assert got == [0, 1, 2, 3, 4] and alloc.num_free == 0
    with pytest.raises(OutOfBlocks, match="all 5 blocks"):
        alloc.allocate()
    alloc.free(3)
    alloc.free(1)
    assert alloc.num_free == 2
    assert [alloc.allocate(), alloc.allocate()] == [1, 3]  # lowest free id first
    assert issubclass(OutOfBlocks, RuntimeError)


def test_free_many_returns_every_block_to_the_pool():
    alloc = BlockAllocator(3)
    taken = [alloc.allocate() for _ in range(3)]
    alloc.free_many(taken)
    assert alloc.num_free == 3 and [alloc.allocate() for _ in range(3)] == [0, 1, 2]


BLOCK_ALLOCATOR_REFUSALS = [
    ("num_blocks", 2.0, TypeError, "num_blocks must be an int, got float"),
    ("num_blocks", 0, ValueError, "num_blocks must be >= 1, got 0"),
]
test_block_allocator_refusals = refusal_test(BlockAllocator, dict(num_blocks=3), BLOCK_ALLOCATOR_REFUSALS)


FREE_REFUSALS = [  # blocks 0 and 1 of 3 were allocated, then 0 freed
    ("block_id", 0, ValueError, "block 0 is not allocated (double free?)"),
    ("block_id", 3, ValueError, "block_id must be < num_blocks=3, got 3"),
    ("block_id", -1, ValueError, "block_id must be >= 0, got -1"),
    ("block_id", 1.0, TypeError, "block_id must be an int, got float"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(FREE_REFUSALS))
def test_allocator_free_refusals(argument, bad, error, message):
    alloc = BlockAllocator(3)
    for _ in range(2):
        alloc.allocate()
    alloc.free(0)
    assert_refuses(alloc.free, dict(block_id=1), argument, bad, error, message)
    assert alloc.num_free == 2  # a refused free frees nothing


FREE_MANY_REFUSALS = [  # all 3 blocks allocated
    ("block_ids", [0, 1, 1], ValueError, "blocks [1] are not allocated or are listed twice (double free?)"),
    ("block_ids", [2, 7], ValueError, "blocks [7] are not allocated or are listed twice (double free?)"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(FREE_MANY_REFUSALS))
def test_allocator_free_many_refusals(argument, bad, error, message):
    alloc = BlockAllocator(3)
    for _ in range(3):
        alloc.allocate()
    assert_refuses(alloc.free_many, dict(block_ids=[0, 1, 2]), argument, bad, error, message)
    assert alloc.num_free == 0  # a refused free_many frees nothing (all or none)


# --------------------------------------------------------------------------- cache
B_SIZE, H_KV, D = 4, 2, 8


def interleaved_cache(lengths, *, num_blocks=40, seed=0):
    """Fill a cache with one sequence per length, appending chunks of 1-3 tokens round-robin, so
    every sequence's blocks are scattered and most writes start mid-block. Returns the cache and
    the per-sequence k, v that were written."""
    cache = PagedKVCache(num_blocks, B_SIZE, H_KV, D)
    ks = [rand(H_KV, S, D, seed=seed + 2 * i) for i, S in enumerate(lengths)]
    vs = [rand(H_KV, S, D, seed=seed + 2 * i + 1) for i, S in enumerate(lengths)]
    written = [0] * len(lengths)
    chunk = 0
    while any(w < S for w, S in zip(written, lengths)):
        for i, S in enumerate(lengths):
            if written[i] < S:
                n = min(1 + chunk % 3, S - written[i])
                cache.append(i, ks[i][:, written[i] : written[i] + n], vs[i][:, written[i] : written[i] + n])
                written[i] += n
                chunk += 1
    return cache, ks, vs


def test_gather_returns_exactly_what_was_appended_across_mid_block_writes():
    lengths = [1, 4, 7, 8, 13]
    cache, ks, vs = interleaved_cache(lengths)
    scattered = [t for t in cache.tables.values() if t != list(range(t[0], t[0] + len(t)))]
    assert scattered, "the interleaving should scatter some sequence's blocks"
    for i, S in enumerate(lengths):
        k, v = cache.gather(i)
        assert torch.equal(k, ks[i]) and torch.equal(v, vs[i])
        assert len(cache.tables[i]) == -(-S // B_SIZE)  # ceil(S / b) blocks, no more
    assert cache.seq_lens(list(range(5))).tolist() == lengths
    table = cache.block_table([4, 0])
    assert table.dtype == torch.long and table.shape == (2, 4)
    assert table[0].tolist() == cache.tables[4] and table[1].tolist() == cache.tables[0] + [PAD_BLOCK] * 3


def test_freed_blocks_are_reused_and_other_sequences_are_untouched():
    cache, ks, vs = interleaved_cache([5, 9, 6])
    free_before = cache.allocator.num_free
    cache.free(1)
    assert cache.allocator.num_free == free_before + 3
    new_k, new_v = rand(H_KV, 11, D, seed=50), rand(H_KV, 11, D, seed=51)
    cache.append(7, new_k, new_v)  # takes sequence 1's old blocks (lowest ids first)
    assert torch.equal(cache.gather(7)[0], new_k) and torch.equal(cache.gather(7)[1], new_v)
    for i in (0, 2):
        assert torch.equal(cache.gather(i)[0], ks[i]) and torch.equal(cache.gather(i)[1], vs[i])
    assert 1 not in cache.tables  # a freed sequence is forgotten: gather(1) is refused (SEQ_ID_REFUSALS)


def test_an_append_that_does_not_fit_changes_nothing():
    cache = PagedKVCache(3, B_SIZE, H_KV, D)
    k = rand(H_KV, 6, D)
    cache.append(0, k, k)
    with pytest.raises(OutOfBlocks, match="needs 2 more blocks, only 1"):
        cache.append(0, rand(H_KV, 7, D), rand(H_KV, 7, D))
    assert cache.lengths[0] == 6 and cache.tables[0] == [0, 1] and cache.allocator.num_free == 1
    assert torch.equal(cache.gather(0)[0], k)


PAGED_KV_CACHE_REFUSALS = [
    ("num_blocks", 0, ValueError, "num_blocks must be >= 1, got 0"),
    ("block_size", 1.5, TypeError, "block_size must be an int, got float"),
    ("n_kv_heads", -1, ValueError, "n_kv_heads must be >= 1, got -1"),
    ("head_dim", "8", TypeError, "head_dim must be an int, got str"),
    ("dtype", torch.long, TypeError, "dtype must be a floating torch.dtype, got torch.int64"),
    ("dtype", "fp16", TypeError, "dtype must be a floating torch.dtype, got fp16"),
]
test_paged_kv_cache_refusals = refusal_test(
    PagedKVCache,
    dict(num_blocks=4, block_size=B_SIZE, n_kv_heads=H_KV, head_dim=D, dtype=torch.float32),
    PAGED_KV_CACHE_REFUSALS,
)


def _kv(*shape, **kw):
    return torch.zeros(shape, **kw), torch.zeros(shape, **kw)


_APPEND_SHAPE = f"k must have shape (H_kv, T, D) = ({H_KV}, T>=1, {D}), got"
# fmt: off
APPEND_REFUSALS = [  # into an empty pool of 4 blocks of 4 tokens, H_kv = 2, D = 8
    ("k, v", _kv(H_KV, 3), ValueError, "k must have shape (H_kv, T, D) (3 dims), got (2, 3)"),
    ("k, v", _kv(H_KV + 1, 3, D), ValueError, f"{_APPEND_SHAPE} (3, 3, 8)"),
    ("k, v", _kv(H_KV, 0, D), ValueError, f"{_APPEND_SHAPE} (2, 0, 8)"),
    ("k, v", _kv(H_KV, 3, D + 1), ValueError, f"{_APPEND_SHAPE} (2, 3, 9)"),
    ("k", torch.zeros(H_KV, 2, D, dtype=torch.long), TypeError, not_float("k")),
    ("v", [1.0], TypeError, "v must be a torch.Tensor, got list"),
    ("v", torch.zeros(H_KV, 3, D), ValueError, "k and v must hold the same number of tokens, got 2 and 3"),
    ("k, v", _kv(H_KV, 2, D, device="meta"), ValueError,
     "k, v, k_blocks must share one device, got k: meta, v: meta, k_blocks: cpu"),
    ("k, v", _kv(H_KV, 17, D), OutOfBlocks, "seq_id 0 needs 5 more blocks, only 4 are free"),
    ("seq_id", "a", TypeError, "seq_id must be an int, got str"),
    ("seq_id", -1, ValueError, "seq_id must be >= 0, got -1"),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message", rows(APPEND_REFUSALS))
def test_append_refusals(argument, bad, error, message):
    cache = PagedKVCache(4, B_SIZE, H_KV, D)
    k, v = _kv(H_KV, 2, D)
    assert_refuses(cache.append, dict(seq_id=0, k=k, v=v), argument, bad, error, message)
    assert cache.tables == {} and cache.allocator.num_free == 4  # a refused append writes nothing


def freed_cache():
    """Sequences 0, 1, 2 written, then 1 freed."""
    cache, _, _ = interleaved_cache([5, 9, 6])
    cache.free(1)
    return cache


SEQ_IDS_REFUSALS = [  # sequences 0 and 2 held, 1 freed
    ("seq_ids", [], TypeError, "seq_ids must be a non-empty list of sequence ids, got []"),
    ("seq_ids", 0, TypeError, "seq_ids must be a non-empty list of sequence ids, got 0"),
    ("seq_ids", [1], ValueError, "seq_id 1 is not in the cache (known: [0, 2])"),
    ("seq_ids", [0, "a"], TypeError, "seq_id must be an int, got str"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(SEQ_IDS_REFUSALS))
@pytest.mark.parametrize("method", ["block_table", "seq_lens"])
def test_block_table_and_seq_lens_refusals(method, argument, bad, error, message):
    assert_refuses(getattr(freed_cache(), method), dict(seq_ids=[0, 2]), argument, bad, error, message)


SEQ_ID_REFUSALS = [  # sequences 0 and 2 held, 1 freed
    ("seq_id", 1, ValueError, "seq_id 1 is not in the cache (known: [0, 2])"),
    ("seq_id", -1, ValueError, "seq_id must be >= 0, got -1"),
    ("seq_id", "a", TypeError, "seq_id must be an int, got str"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(SEQ_ID_REFUSALS))
@pytest.mark.parametrize("method", ["gather", "free"])
def test_gather_and_free_refusals(method, argument, bad, error, message):
    cache = freed_cache()
    assert_refuses(getattr(cache, method), dict(seq_id=0), argument, bad, error, message)
    assert sorted(cache.tables) == [0, 2]  # a refused free forgets nothing


# --------------------------------------------------------------------------- paged attention
H = 4  # query heads; H_KV = 2: grouped-query attention


def batch(T, lengths, seed=0):
    cache, ks, vs = interleaved_cache(lengths, seed=seed)
    ids = list(range(len(lengths)))
    q = rand(len(lengths), H, T, D, seed=seed + 100)
    return q, cache, ks, vs, cache.block_table(ids), cache.seq_lens(ids)


# Lengths: 1 (T=1 only), not multiples of b=4 (7, 13, 3), exact multiples (4, 8).
CASES = {"decode T=1": (1, [1, 4, 7, 8, 13]), "T=3": (3, [3, 4, 7, 8, 13])}


@pytest.mark.parametrize("backend", ["naive", "sdpa", "chunked", "auto"])
@pytest.mark.parametrize("case", CASES)
def test_paged_attention_equals_contiguous_attention_per_sequence(case, backend):
    T, lengths = CASES[case]
    q, cache, ks, vs, table, seq_lens = batch(T, lengths)
    out = paged_attention(q, cache.k_blocks, cache.v_blocks, table, seq_lens, backend=backend)
    ref = paged_attention_ref(q, ks, vs)
    truth = paged_attention_ref(q.double(), [k.double() for k in ks], [v.double() for v in vs])
    assert out.shape == (len(lengths), H, T, D) and out.dtype == torch.float32
    # Both are fp32 computations of the same sums in different orders (padded keys add exact
    # zeros). Outputs are convex combinations of values, |out| < 2.5 here, where one fp32 ulp is
    # 2.4e-7; both sit about 1 ulp from the fp64 truth (measured). 2e-6 allows 8 ulps.
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)
    assert (out.double() - truth).abs().max() <= 2e-6


def test_paged_attention_of_one_sequence_is_its_causal_attention():
    """A single sequence whose table holds exactly its blocks: the whole causal matrix."""
    q, cache, ks, vs, table, seq_lens = batch(7, [7])
    out = paged_attention(q, cache.k_blocks, cache.v_blocks, table, seq_lens, backend="naive")
    torch.testing.assert_close(out, paged_attention_ref(q, ks, vs), atol=2e-6, rtol=0)  # fp32 reorderings, as above


def test_the_block_table_matters():
    q, cache, ks, vs, table, seq_lens = batch(1, [1, 4, 7, 8, 13])
    out = paged_attention(q, cache.k_blocks, cache.v_blocks, table, seq_lens)
    # Move every physical block to a new place and rewrite the table to match: same result, bit for bit,
    # because the gathered (B, H_kv, M*b, D) keys and values are the same tensors.
    N = cache.k_blocks.shape[0]
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))  # new block p holds old block perm[p]
    where = torch.argsort(perm)  # old block o now lives at where[o]
    moved = paged_attention(q, cache.k_blocks[perm], cache.v_blocks[perm], where[table], seq_lens)
    assert torch.equal(moved, out)
    # The moved pool read through the old table is wrong.
    stale = paged_attention(q, cache.k_blocks[perm], cache.v_blocks[perm], table, seq_lens)
    assert not torch.allclose(stale, out, atol=1e-3)
    # Pointing one entry of sequence 4's table at sequence 3's block changes sequence 4 only.
    foreign = table.clone()
    foreign[4, 0] = table[3, 0]
    wrong = paged_attention(q, cache.k_blocks, cache.v_blocks, foreign, seq_lens)
    assert not torch.allclose(wrong[4], out[4], atol=1e-3) and torch.equal(wrong[:4], out[:4])
    # Swapping two full blocks of one sequence is invisible to a decode query, which sees every
    # key: attention weighs a set of (key, value) pairs, and order enters only through positions
    # already inside k (RoPE). The fp32 sums are reordered, hence the tolerance.
    swapped = table.clone()
    swapped[4, [0, 2]] = swapped[4, [2, 0]]
    same = paged_attention(q, cache.k_blocks, cache.v_blocks, swapped, seq_lens)
    torch.testing.assert_close(same, out, atol=2e-6, rtol=0)
    # With T = 3 queries the causal mask sees the order: the same swap is wrong.
    q3, cache3, _, _, table3, seq_lens3 = batch(3, [3, 4, 7, 8, 13])
    out3 = paged_attention(q3, cache3.k_blocks, cache3.v_blocks, table3, seq_lens3)
    swapped3 = table3.clone()
    swapped3[4, [0, 3]] = swapped3[4, [3, 0]]  # the last block holds the queries' own keys
    wrong3 = paged_attention(q3, cache3.k_blocks, cache3.v_blocks, swapped3, seq_lens3)
    assert not torch.allclose(wrong3[4], out3[4], atol=1e-3)


def test_keys_past_a_sequence_length_are_never_read():
    q, cache, ks, vs, table, seq_lens = batch(3, [3, 4, 7, 8, 13])
    poisoned_k, poisoned_v = cache.k_blocks.clone(), cache.v_blocks.clone()
    used = torch.zeros(poisoned_k.shape[0], B_SIZE, dtype=torch.bool)  # (N, b): slots holding a real token
    for i, S in enumerate(seq_lens.tolist()):
        for p in range(S):
            used[table[i, p // B_SIZE], p % B_SIZE] = True
    for poison in (float("nan"), float("inf"), 1e30):  # every unused slot, and all unallocated blocks
        poisoned_k.permute(0, 2, 1, 3)[~used] = poison  # (N, H_kv, b, D) viewed as (N, b, H_kv, D)
        poisoned_v.permute(0, 2, 1, 3)[~used] = poison
        for backend in ("naive", "sdpa", "chunked"):
            assert torch.equal(
                paged_attention(q, poisoned_k, poisoned_v, table, seq_lens, backend=backend),
                paged_attention(q, cache.k_blocks, cache.v_blocks, table, seq_lens, backend=backend),
            )


def test_a_padded_block_table_entry_is_no_block_id_and_only_pads():
    """Block 0 is a real block (the lowest id, handed out first): padding with it would make a short
    row look as if it owned block 0. PAD_BLOCK is outside [0, N) and allowed only after a
    sequence's last block."""
    q, cache, ks, vs, table, seq_lens = batch(1, [1, 4, 7, 8, 13])
    N = cache.k_blocks.shape[0]
    assert PAD_BLOCK not in range(N) and 0 in cache.tables[0] + cache.tables[1]
    blocks_held = [len(cache.tables[i]) for i in range(5)]
    for i, n in enumerate(blocks_held):
        assert table[i, :n].tolist() == cache.tables[i] and (table[i, n:] == PAD_BLOCK).all()
    assert (table == PAD_BLOCK).sum() == sum(max(blocks_held) - n for n in blocks_held) > 0
    out = paged_attention(q, cache.k_blocks, cache.v_blocks, table, seq_lens)
    torch.testing.assert_close(out, paged_attention_ref(q, ks, vs), atol=2e-6, rtol=0)  # fp32 reorderings
    inside = table.clone()
    inside[4, 0] = PAD_BLOCK  # sequence 4's first block holds tokens: a pad there is an error
    with pytest.raises(ValueError, match="only after a sequence's last block"):
        paged_attention(q, cache.k_blocks, cache.v_blocks, inside, seq_lens)


def good_inputs():
    q, cache, _, _, table, seq_lens = batch(3, [3, 4, 7, 8, 13])
    return {"q": q, "k_blocks": cache.k_blocks, "v_blocks": cache.v_blocks, "block_table": table, "seq_lens": seq_lens}


_IDS = (
    "block_table holds physical block ids, which must be in [0, N=40) (PAD_BLOCK=-1 only after a sequence's last block)"
)
_LENS = (
    "seq_lens must lie in [T=3, M*b=16] (the queries are each sequence's last T tokens; its table holds M=4 "
    "blocks of b=4)"
)
# fmt: off
PAGED_REFUSALS = [  # good_inputs: q (5, 4, 3, 8), blocks (40, 2, 4, 8), table (5, 4), seq_lens [3, 4, 7, 8, 13]
    ("block_table", lambda a: a.float(), TypeError,
     "block_table must be an int64 (or int32) tensor, got torch.float32"),
    ("seq_lens", lambda a: a.float(), TypeError, "seq_lens must be an int64 (or int32) tensor, got torch.float32"),
    ("block_table", lambda a: a + 1000, ValueError, f"{_IDS}; got values in [999, 1009]"),
    ("block_table", lambda a: a - 1, ValueError, f"{_IDS}; got values in [-2, 8]"),
    ("seq_lens", lambda a: a + 4, ValueError, f"{_LENS}, got [7, 8, 11, 12, 17]"),
    ("seq_lens", lambda a: a - 3, ValueError, f"{_LENS}, got [0, 1, 4, 5, 10]"),
    ("seq_lens", lambda a: a.to("meta"), ValueError, "seq_lens must be on q's device cpu, got meta"),
    ("q", lambda a: a[:, :3], ValueError,
     "the query heads H must be a multiple of the key/value heads H_kv, got H=3, H_kv=2"),
    ("q", lambda a: a[..., :5], ValueError,
     "k_blocks must have shape (N, H_kv, b, D) with D = 5 as in q, got (40, 2, 4, 8)"),
    ("q", lambda a: a[:4], ValueError, "block_table must have shape (B, M) with B = 4 as in q, got (5, 4)"),
    (
        "q",
        lambda a: a.double(),
        ValueError,
        "q, k_blocks, v_blocks must share one dtype, got q: torch.float64, k_blocks: torch.float32, v_blocks: "
        "torch.float32",
    ),
    ("q", lambda a: a[0], ValueError, "q must have shape (B, H, T, D) (4 dims), got (4, 3, 8)"),
    ("v_blocks", lambda a: a[:, :1], ValueError,
     "v_blocks must have shape (N, H_kv, b, D_v) with H_kv = 2 as in k_blocks, got (40, 1, 4, 8)"),
    ("block_table", lambda a: a[:, :0], ValueError,
     "block_table must have shape (B, M) with every size >= 1, got (5, 0)"),
    ("k_blocks", lambda a: a.long(), TypeError, not_float("k_blocks")),
]
# fmt: on


@pytest.mark.parametrize("argument, change, error, message", rows(PAGED_REFUSALS))
def test_paged_attention_refusals(argument, change, error, message):
    good = good_inputs()
    assert_refuses(paged_attention, good, argument, change(good[argument]), error, message)


def test_block_tables_and_lengths_may_be_int32():
    args = good_inputs()
    want = paged_attention(**args)
    args.update(block_table=args["block_table"].int(), seq_lens=args["seq_lens"].int())
    assert torch.equal(paged_attention(**args), want)


_Q, _KV3 = rand(2, H, 1, D), rand(H_KV, 3, D)
# fmt: off
PAGED_ATTENTION_REF_REFUSALS = [  # q (2, 4, 1, 8); ks, vs: two (2, 3, 8) each
    ("ks", [_KV3], TypeError, "ks must be a list of B=2 tensors (H_kv, S_b, D), got list of length 1"),
    ("ks", [_KV3, _KV3[0]], ValueError, "ks[1] must have shape (H_kv, S_b, D) (3 dims), got (3, 8)"),
    ("vs", _KV3, TypeError, "vs must be a list of B=2 tensors (H_kv, S_b, D), got Tensor"),
    ("vs", [_KV3, None], TypeError, "vs[1] must be a torch.Tensor, got NoneType"),
    ("q", _Q[0], ValueError, "q must have shape (B, H, T, D) (4 dims), got (4, 1, 8)"),
    ("q", _Q.long(), TypeError, not_float("q")),
]
# fmt: on
test_paged_attention_ref_refusals = refusal_test(
    paged_attention_ref, dict(q=_Q, ks=[_KV3] * 2, vs=[_KV3] * 2), PAGED_ATTENTION_REF_REFUSALS
)
