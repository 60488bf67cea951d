"""lib.paging: attention through a block table equals attention on each sequence's own contiguous
K/V, and the table really matters; the cache returns what was written; the allocator never hands
a block out twice; the serving simulator keeps its memory invariants, follows its stated rules
step by step on crafted cases, is deterministic, and refuses bad input clearly."""

import pytest
import torch

from lib.paging import (
    BlockAllocator,
    OutOfBlocks,
    PagedKVCache,
    Request,
    make_workload,
    paged_attention,
    paged_attention_ref,
    simulate_serving,
    sweep_block_sizes,
)


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


def test_allocator_refuses_double_free_and_foreign_ids():
    alloc = BlockAllocator(3)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)
    with pytest.raises(ValueError, match="num_blocks=3"):
        alloc.free(3)
    with pytest.raises(ValueError, match="block_id"):
        alloc.free(-1)
    taken = [alloc.allocate() for _ in range(3)]
    with pytest.raises(ValueError, match=r"blocks \[1\] are not allocated or are listed twice"):
        alloc.free_many([0, 1, 1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free_many([2, 7])
    assert alloc.num_free == 0  # a refused free_many frees nothing
    alloc.free_many(taken)
    assert alloc.num_free == 3 and [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(TypeError, match="num_blocks"):
        BlockAllocator(2.0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


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
                cache.append(i, ks[i][:, written[i]:written[i] + n], vs[i][:, written[i]:written[i] + n])
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
    assert table[0].tolist() == cache.tables[4] and table[1].tolist() == cache.tables[0] + [0, 0, 0]


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
    with pytest.raises(ValueError, match="seq_id 1 is not in the cache"):
        cache.gather(1)


def test_an_append_that_does_not_fit_changes_nothing():
    cache = PagedKVCache(3, B_SIZE, H_KV, D)
    k = rand(H_KV, 6, D)
    cache.append(0, k, k)
    with pytest.raises(OutOfBlocks, match="needs 2 more blocks, only 1"):
        cache.append(0, rand(H_KV, 7, D), rand(H_KV, 7, D))
    assert cache.lengths[0] == 6 and cache.tables[0] == [0, 1] and cache.allocator.num_free == 1
    assert torch.equal(cache.gather(0)[0], k)


@pytest.mark.parametrize("k_shape, error, match", [
    ((H_KV, 3), ValueError, r"\(H_kv, T, D\)"),
    ((H_KV + 1, 3, D), ValueError, r"\(H_kv, T, D\)"),
    ((H_KV, 0, D), ValueError, "T>=1"),
    ((H_KV, 3, D + 1), ValueError, r"\(H_kv, T, D\)"),
])
def test_cache_refuses_bad_appends(k_shape, error, match):
    cache = PagedKVCache(4, B_SIZE, H_KV, D)
    with pytest.raises(error, match=match):
        cache.append(0, torch.zeros(k_shape), torch.zeros(k_shape))
    with pytest.raises(TypeError, match="floating"):
        cache.append(0, torch.zeros(H_KV, 2, D, dtype=torch.long), torch.zeros(H_KV, 2, D))
    with pytest.raises(TypeError, match="seq_id"):
        cache.append("a", torch.zeros(H_KV, 2, D), torch.zeros(H_KV, 2, D))
    with pytest.raises(TypeError, match="seq_ids"):
        cache.block_table([])


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
            assert torch.equal(paged_attention(q, poisoned_k, poisoned_v, table, seq_lens, backend=backend),
                               paged_attention(q, cache.k_blocks, cache.v_blocks, table, seq_lens, backend=backend))


def good_inputs():
    q, cache, _, _, table, seq_lens = batch(3, [3, 4, 7, 8, 13])
    return {"q": q, "k_blocks": cache.k_blocks, "v_blocks": cache.v_blocks, "block_table": table, "seq_lens": seq_lens}


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {"block_table": a["block_table"].int()}, TypeError, "block_table must be an int64"),
    (lambda a: {"seq_lens": a["seq_lens"].float()}, TypeError, "seq_lens must be an int64"),
    (lambda a: {"block_table": a["block_table"] + 1000}, ValueError, r"\[0, N=40\)"),
    (lambda a: {"block_table": a["block_table"] - 1}, ValueError, "physical block ids"),
    (lambda a: {"seq_lens": a["seq_lens"] + 4}, ValueError, r"M\*b=16"),
    (lambda a: {"seq_lens": a["seq_lens"] - 3}, ValueError, "T=3"),
    (lambda a: {"q": a["q"][:, :3]}, ValueError, "multiple of the key/value heads"),
    (lambda a: {"q": a["q"][..., :5]}, ValueError, "must share D"),
    (lambda a: {"q": a["q"][:4]}, ValueError, "B=4"),
    (lambda a: {"q": a["q"].double()}, ValueError, "dtype"),
    (lambda a: {"q": a["q"][0]}, ValueError, r"\(B, H, T, D\)"),
    (lambda a: {"v_blocks": a["v_blocks"][:, :1]}, ValueError, "agree on N, H_kv, b"),
    (lambda a: {"block_table": a["block_table"][:, :0]}, ValueError, "empty"),
    (lambda a: {"k_blocks": a["k_blocks"].long()}, TypeError, "floating"),
])
def test_paged_attention_refuses_bad_input_clearly(change, error, match):
    args = good_inputs()
    args.update(change(args))
    with pytest.raises(error, match=match):
        paged_attention(**args)


def test_reference_refuses_mismatched_lists():
    q = rand(2, H, 1, D)
    with pytest.raises(TypeError, match="ks must be a list of B=2"):
        paged_attention_ref(q, [rand(H_KV, 3, D)], [rand(H_KV, 3, D)] * 2)
    with pytest.raises(ValueError, match=r"ks\[1\]"):
        paged_attention_ref(q, [rand(H_KV, 3, D), rand(3, D)], [rand(H_KV, 3, D)] * 2)


# --------------------------------------------------------------------------- workload
def test_workload_is_seeded_and_respects_max_len():
    a = make_workload(300, seed=4, max_len=128, prompt_mean=60, output_mean=60)
    assert a == make_workload(300, seed=4, max_len=128, prompt_mean=60, output_mean=60)
    assert a != make_workload(300, seed=5, max_len=128, prompt_mean=60, output_mean=60)
    assert [r.rid for r in a] == list(range(300))
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= 128 for r in a)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)


def test_workload_follows_its_stated_distribution():
    n = 4000
    reqs = make_workload(n, seed=0, arrival_rate=0.5, prompt_mean=50, output_mean=120, max_len=10**6)  # no cut
    # Geometric with mean m has standard deviation sqrt(m(m-1)) < m, so the mean of 4000 draws is
    # within m/sqrt(4000) ~ 1.6% (one sigma) of m: 6% is beyond 3.5 sigma. The same holds for the
    # mean exponential gap 1/rate.
    for got, want in ((sum(r.prompt_len for r in reqs) / n, 50), (sum(r.output_len for r in reqs) / n, 120),
                      (reqs[-1].arrival / n, 1 / 0.5)):
        assert abs(got - want) / want < 0.06
    assert min(r.output_len for r in reqs) == 1 and sum(r.output_len == 1 for r in reqs) > n / 120 / 2  # P(1) = 1/m


@pytest.mark.parametrize("kwargs, error, match", [
    ({"n_requests": 0}, ValueError, "n_requests"),
    ({"arrival_rate": 0}, ValueError, "arrival_rate"),
    ({"arrival_rate": float("inf")}, ValueError, "arrival_rate"),
    ({"prompt_mean": 0.5}, ValueError, "prompt_mean"),
    ({"output_mean": "200"}, TypeError, "output_mean"),
    ({"max_len": 1}, ValueError, "max_len"),
    ({"seed": -1}, ValueError, "seed"),
])
def test_workload_refuses_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_workload(**{"n_requests": 5, **kwargs})
    with pytest.raises(ValueError, match="prompt_len"):
        Request(rid=0, arrival=0, prompt_len=0, output_len=3)


# --------------------------------------------------------------------------- simulator
WORKLOAD = make_workload(60, seed=1, arrival_rate=0.5, prompt_mean=40, output_mean=40, max_len=256)
CAPACITY = 1000  # not a multiple of 256: a 232-slot tail no max_len reservation can use
CONFIGS = {
    "contiguous max_len": dict(policy="contiguous", reserve="max_len"),
    "contiguous pow2": dict(policy="contiguous", reserve="pow2"),
    "contiguous oracle": dict(policy="contiguous", reserve="oracle"),
    "paged b=1": dict(policy="paged", block_size=1),
    "paged b=7": dict(policy="paged", block_size=7),
    "paged b=16": dict(policy="paged", block_size=16),
    "paged b=16 watermark": dict(policy="paged", block_size=16, watermark=0.1),
}
RESULTS = {name: simulate_serving(WORKLOAD, capacity_tokens=CAPACITY, max_len=256, max_snapshots=40, **cfg)
           for name, cfg in CONFIGS.items()}


@pytest.mark.parametrize("name", CONFIGS)
def test_simulator_keeps_its_memory_invariants(name):
    res = RESULTS[name]
    for step, (u, r, f, run) in enumerate(zip(res.used_tokens, res.reserved_tokens, res.future_tokens, res.running)):
        assert 0 <= u <= r <= CAPACITY, step
        assert 0 <= f <= r - u, step  # future slots are reserved slots without a token yet
        if res.policy == "paged":
            assert r - u <= (res.block_size - 1) * run, step  # only the last block of each request has slack
        elif res.reserve == "max_len":
            assert r == 256 * run, step
    # Every request finishes, no sooner than its output allows (the admission step makes 1 token).
    assert sorted(res.finished_steps) == [r.rid for r in WORKLOAD]
    assert all(res.finished_steps[r.rid] >= r.arrival + r.output_len - 1 for r in WORKLOAD)
    assert res.makespan == max(res.finished_steps.values()) + 1
    shares = res.token_share(), res.future_share(), res.internal_fragmentation()
    assert all(0 <= s <= 1 for s in shares) and abs(sum(shares) - 1) < 1e-12  # three parts of one sum
    assert res.waste_share() == pytest.approx(1 - res.token_share(), abs=1e-15)
    assert res.throughput() * res.makespan == pytest.approx(sum(r.output_len for r in WORKLOAD))
    if res.policy == "contiguous":
        assert res.preemptions == 0 and res.recomputed_tokens == 0
    else:
        assert res.external_fragmentation() == 0.0 and sum(res.stranded_tokens) == 0


@pytest.mark.parametrize("name", CONFIGS)
def test_memory_snapshots_agree_with_the_per_step_numbers(name):
    res = RESULTS[name]
    steps = [s for s, _ in res.snapshots]
    assert 20 <= len(steps) <= 40 and steps == sorted(steps) and len({b - a for a, b in zip(steps, steps[1:])}) == 1
    for i, step in enumerate(steps):
        m = res.memory_map(i)
        assert m["step"] == step and len(m["owner"]) == res.num_units == CAPACITY // res.unit
        assert sum(m["filled"]) == res.used_tokens[step]
        assert sum(o >= 0 for o in m["owner"]) * res.unit == res.reserved_tokens[step]
        assert len({o for o in m["owner"] if o >= 0}) == res.running[step]
        assert all(f == 0 for o, f in zip(m["owner"], m["filled"]) if o < 0)
        if res.policy == "contiguous":  # each request's slots form one range, tokens at its start
            for rid in {o for o in m["owner"] if o >= 0}:
                idx = [j for j, o in enumerate(m["owner"]) if o == rid]
                assert idx == list(range(idx[0], idx[-1] + 1))
                fills = [m["filled"][j] for j in idx]
                assert fills == sorted(fills, reverse=True)


def test_paged_holds_only_real_tokens_with_one_token_blocks():
    res = RESULTS["paged b=1"]
    assert res.token_share() == 1.0 and res.used_tokens == res.reserved_tokens


def test_oracle_reservation_has_no_internal_fragmentation_and_max_len_has_the_most():
    shares = {n: RESULTS[n].internal_fragmentation() for n in CONFIGS if n.startswith("contiguous")}
    assert shares["contiguous oracle"] == 0.0
    assert shares["contiguous max_len"] > shares["contiguous pow2"] > 0


def test_contiguous_allocation_strands_memory_between_and_after_ranges():
    assert RESULTS["contiguous max_len"].external_fragmentation() > 0  # the 232-slot tail while requests wait
    assert RESULTS["contiguous oracle"].external_fragmentation() > 0


def test_paged_serves_more_requests_at_once_than_contiguous():
    paged = [RESULTS[n] for n in CONFIGS if n.startswith("paged")]
    contiguous = [RESULTS[n] for n in CONFIGS if n.startswith("contiguous")]
    for p in paged:
        assert p.mean_running() >= max(c.mean_running() for c in contiguous)
        assert p.token_share() > max(c.token_share() for c in contiguous)
    assert RESULTS["paged b=16"].mean_running() > 2 * RESULTS["contiguous max_len"].mean_running()


def test_a_watermark_trades_concurrency_for_fewer_preemptions():
    plain, kept = RESULTS["paged b=16"], RESULTS["paged b=16 watermark"]
    assert plain.preemptions > kept.preemptions
    assert plain.mean_running() >= kept.mean_running()


def test_contiguous_trace_by_hand():
    """Two requests of 2 + 5 tokens, 8 slots, max_len 8: B waits for all of A's reservation."""
    reqs = [Request(0, 0, 2, 5), Request(1, 0, 2, 5)]
    res = simulate_serving(reqs, policy="contiguous", capacity_tokens=8, max_len=8)
    # A: admitted at step 0 with its first token, one more token at each of steps 1..4.
    assert res.finished_steps == {0: 4, 1: 9}
    assert res.used_tokens == [3, 4, 5, 6, 7, 3, 4, 5, 6, 7] and res.reserved_tokens == [8] * 10
    assert res.future_tokens == [4, 3, 2, 1, 0] * 2 and res.waiting == [1] * 5 + [0] * 5


def test_paged_trace_by_hand_with_preemption_and_recompute():
    """4 blocks of 2 tokens. A and B (2 + 5 tokens each) both fit at admission (2 blocks each); at
    step 2 A's 5th token needs a third block: B, the newest, is preempted and recomputed later."""
    reqs = [Request(0, 0, 2, 5), Request(1, 0, 2, 5)]
    res = simulate_serving(reqs, policy="paged", capacity_tokens=8, max_len=8, block_size=2)
    assert res.preemptions == 1 and res.recomputed_tokens == 4  # B's prompt + its 2 tokens
    assert res.finished_steps == {0: 4, 1: 7}
    assert res.running == [2, 2, 1, 1, 1, 1, 1, 1] and res.waiting == [0, 0, 1, 1, 1, 0, 0, 0]
    assert res.used_tokens == [6, 8, 5, 6, 7, 5, 6, 7]
    assert res.reserved_tokens == [8, 8, 6, 6, 8, 6, 6, 8]


def test_a_request_can_preempt_itself():
    """3 blocks of 2. A (2 + 4) takes 2 blocks, B (1 + 2) the last; at step 1 B, the newest, needs
    a block and none is free: B is its own victim. A alone then grows into B's old block."""
    reqs = [Request(0, 0, 2, 4), Request(1, 0, 1, 2)]
    res = simulate_serving(reqs, policy="paged", capacity_tokens=6, max_len=6, block_size=2)
    assert res.preemptions == 1 and res.recomputed_tokens == 2
    assert res.finished_steps == {0: 3, 1: 4}
    assert res.running == [2, 1, 1, 1, 1] and res.used_tokens == [5, 4, 5, 6, 3]


def test_simulation_is_deterministic():
    a = simulate_serving(WORKLOAD, policy="paged", capacity_tokens=CAPACITY, max_len=256, block_size=8)
    b = simulate_serving(list(WORKLOAD), policy="paged", capacity_tokens=CAPACITY, max_len=256, block_size=8)
    assert vars(a) == vars(b)
    other = make_workload(60, seed=2, arrival_rate=0.5, prompt_mean=40, output_mean=40, max_len=256)
    c = simulate_serving(other, policy="paged", capacity_tokens=CAPACITY, max_len=256, block_size=8)
    assert c.used_tokens != a.used_tokens


def test_summary_and_sweep_report_rounded_numbers():
    s = RESULTS["paged b=16"].summary()
    assert s["policy"] == "paged" and s["block_size"] == 16 and s["reserve"] is None
    assert s["token_share"] == round(RESULTS["paged b=16"].token_share(), 4)
    rows = sweep_block_sizes(WORKLOAD, capacity_tokens=CAPACITY, max_len=256, block_sizes=[1, 16])
    assert [r["block_size"] for r in rows] == [1, 16] and rows[1] == s
    assert rows[0]["token_share"] == 1.0
    assert "paged, 16-token blocks" in repr(RESULTS["paged b=16"]) and len(repr(RESULTS["paged b=16"])) < 200


@pytest.mark.parametrize("kwargs, error, match", [
    ({"policy": "buddy"}, ValueError, "policy must be one of"),
    ({"block_size": 0}, ValueError, "block_size must be >= 1"),
    ({"reserve": "half"}, ValueError, "reserve must be one of"),
    ({"capacity_tokens": 255}, ValueError, "capacity_tokens=255 is smaller than one request"),
    ({"policy": "paged", "capacity_tokens": 100, "block_size": 16}, ValueError, "could never run"),
    ({"max_len": 50}, ValueError, "> max_len=50"),
    ({"watermark": 1.0, "policy": "paged"}, ValueError, "watermark"),
    ({"max_steps": 10}, RuntimeError, "max_steps=10"),
    ({"capacity_tokens": 1000.0}, TypeError, "capacity_tokens must be an int"),
])
def test_simulator_refuses_bad_input_clearly(kwargs, error, match):
    args = {"policy": "contiguous", "capacity_tokens": CAPACITY, "max_len": 256, **kwargs}
    with pytest.raises(error, match=match):
        simulate_serving(WORKLOAD, **args)


def test_simulator_refuses_bad_request_lists():
    with pytest.raises(TypeError, match="non-empty list of Request"):
        simulate_serving([], policy="paged", capacity_tokens=100)
    with pytest.raises(TypeError, match=r"requests\[1\] must be a Request"):
        simulate_serving([Request(0, 0, 1, 1), (1, 0, 1, 1)], policy="paged", capacity_tokens=100)
    with pytest.raises(ValueError, match="distinct rids"):
        simulate_serving([Request(0, 0, 1, 1), Request(0, 1, 1, 1)], policy="paged", capacity_tokens=100)


def test_token_share_of_capacity_against_a_hand_trace():
    """Two requests traced by hand through the rules of simulate_serving's docstring, capacity 10:
    r0 (prompt 3, output 2) arrives at step 0: admitted, prefilled, its first token sampled: 4 slots;
    step 1: its second token (5 slots), then it finishes. r1 (prompt 2, output 1) arrives at step 1:
    3 slots, finishes. Used [4, 8] over a makespan of 2 steps: 12 / (10 x 2) = 0.6 whatever the policy;
    reserved: oracle ranges [5, 8] (prompt + true output), blocks of 2 [4, 10]. Arriving at step 4
    instead, r1 leaves two empty steps, which count against the pool: 12 / (10 x 5) = 0.24."""
    reqs = (Request(0, 0, 3, 2), Request(1, 1, 2, 1))
    for policy, kwargs, reserved in (("contiguous", {"reserve": "oracle"}, [5, 8]), ("paged", {"block_size": 2}, [4, 10])):
        result = simulate_serving(reqs, policy=policy, capacity_tokens=10, max_len=8, **kwargs)
        assert result.used_tokens == [4, 8] and result.reserved_tokens == reserved and result.makespan == 2
        assert result.token_share_of_capacity() == pytest.approx(12 / 20)
        assert result.token_share() == pytest.approx(12 / sum(reserved))
    late = simulate_serving((Request(0, 0, 3, 2), Request(1, 4, 2, 1)), policy="contiguous", capacity_tokens=10,
                            max_len=8, reserve="oracle")
    assert late.used_tokens == [4, 5, 0, 0, 3] and late.makespan == 5
    assert late.token_share_of_capacity() == pytest.approx(12 / 50)
