"""lib.serving: the serving simulator keeps its memory invariants, follows its stated rules step
by step on crafted cases, is deterministic, and refuses bad input clearly."""

import pytest

from lib.serving import simulate_serving, sweep_block_sizes
from lib.workload import Request, make_workload

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
RESULTS = {
    name: simulate_serving(WORKLOAD, capacity_tokens=CAPACITY, max_len=256, max_snapshots=40, **cfg)
    for name, cfg in CONFIGS.items()
}


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


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"policy": "buddy"}, ValueError, "policy must be one of"),
        ({"block_size": 0}, ValueError, "block_size must be >= 1"),
        ({"reserve": "half"}, ValueError, "reserve must be one of"),
        ({"capacity_tokens": 255}, ValueError, "capacity_tokens=255 is smaller than one request"),
        ({"policy": "paged", "capacity_tokens": 100, "block_size": 16}, ValueError, "could never run"),
        ({"max_len": 50}, ValueError, "> max_len=50"),
        ({"watermark": 1.0, "policy": "paged"}, ValueError, "watermark"),
        ({"max_steps": 10}, RuntimeError, "max_steps=10"),
        ({"capacity_tokens": 1000.0}, TypeError, "capacity_tokens must be an int"),
    ],
)
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
    for policy, kwargs, reserved in (
        ("contiguous", {"reserve": "oracle"}, [5, 8]),
        ("paged", {"block_size": 2}, [4, 10]),
    ):
        result = simulate_serving(reqs, policy=policy, capacity_tokens=10, max_len=8, **kwargs)
        assert result.used_tokens == [4, 8] and result.reserved_tokens == reserved and result.makespan == 2
        assert result.token_share_of_capacity() == pytest.approx(12 / 20)
        assert result.token_share() == pytest.approx(12 / sum(reserved))
    late = simulate_serving(
        (Request(0, 0, 3, 2), Request(1, 4, 2, 1)), policy="contiguous", capacity_tokens=10, max_len=8, reserve="oracle"
    )
    assert late.used_tokens == [4, 5, 0, 0, 3] and late.makespan == 5
    assert late.token_share_of_capacity() == pytest.approx(12 / 50)
