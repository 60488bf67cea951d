"""lib.course.bench.moe_balance: one run summarised at the lesson's length (losses, per-layer f and P, drops
at the capacity factor) equals a run trained that long,
the collapse rule, the command's record, bad input."""

import json

import pytest
import torch

import lib.course.bench.moe_balance as mb
from lib.course.bench.moe_balance import CAPACITY_FACTOR, COLLAPSE_BUSIEST, collapsed, run, train_one
from lib.course.precision import default_dtype
from lib.moe_lm import drop_rate, train_moe_lm

TINY = dict(n_layer=1, n_embd=16, n_head=2, d_ff=16, num_experts=4, batch_size=2, seq_len=8)


def test_the_summary_at_the_lessons_length_is_that_of_a_run_trained_that_long():
    one = train_one(0.01, seed=1, steps=20, lesson_steps=10, **TINY)
    with default_dtype(torch.float64):
        short_run = train_moe_lm(0.01, steps=10, seed=1, **TINY)
        full_run = train_moe_lm(0.01, steps=20, seed=1, **TINY)
        # the drop rate at the lesson's length is measured mid-training, on the model as it stood then
        short_drops = drop_rate(short_run.model, short_run.data, CAPACITY_FACTOR, seq_len=8)
        full_drops = drop_rate(full_run.model, full_run.data, CAPACITY_FACTOR, seq_len=8)
    short, full = short_run.summary(), full_run.summary()
    for key in ("main", "aux", "aux_per_layer", "aux_pooled", "busiest", "busiest_prob", "dead"):
        assert one["at_lesson_steps"][key] == round(short[key], 4)
        assert one["at_end"][key] == round(full[key], 4)
    assert one["at_lesson_steps"]["drop_rate_at_capacity"] == round(short_drops, 6)
    assert one["at_end"]["drop_rate_at_capacity"] == round(full_drops, 6)
    # each layer's f and P, the last 10 steps averaged: one layer of 4 experts, shares summing to 1
    for part in ("load", "prob"):
        assert one["at_end"][part] == [
            [round(float(v), 4) for v in row] for row in getattr(full_run, f"final_{part}")()
        ]
        assert len(one["at_end"][part]) == 1 and abs(sum(one["at_end"][part][0]) - 1) < 1e-3
    assert one["at_lesson_steps"] != one["at_end"]  # ten more steps moved the router
    assert one["curve_steps"] == [0, 10, 19] and len(one["busiest_curve"]) == len(one["busiest_prob_curve"]) == 3
    assert all(v >= 1.0 for v in one["busiest_curve"] + one["busiest_prob_curve"])  # max of E shares >= 1/E
    again = train_one(0.01, seed=1, steps=20, lesson_steps=10, **TINY)
    assert {k: v for k, v in one.items() if k != "seconds"} == {k: v for k, v in again.items() if k != "seconds"}


def test_collapse_is_a_dead_expert_or_one_expert_at_three_even_shares():
    base = dict(main=1.0, aux=2.0, busiest_prob=1.0)
    assert not collapsed({**base, "busiest": COLLAPSE_BUSIEST - 0.01, "dead": 0.0})
    assert collapsed({**base, "busiest": COLLAPSE_BUSIEST, "dead": 0.0})
    assert collapsed({**base, "busiest": 1.2, "dead": 0.1})


def test_the_command_writes_a_record(tmp_path, monkeypatch):
    lines = []
    record = run((0.0, 1.0), (0,), 12, pooled_alphas=(1.0,), threads=1, progress=lines.append, **TINY)
    assert [(r["alpha"], r["seed"]) for r in record["results"]] == [(0.0, 0), (1.0, 0)] and len(lines) == 3
    assert not any(r["pooled"] for r in record["results"])
    pooled = record["pooled_results"]  # the same α = 1 run, trained on the pooled loss
    assert [(r["alpha"], r["seed"], r["pooled"]) for r in pooled] == [(1.0, 0, True)]
    # one layer: the pooled loss is the per-layer one, and so is the run
    assert pooled[0]["at_end"] == record["results"][1]["at_end"]
    assert record["steps"] == 12 and record["lesson_steps"] == 12 and record["machine"]["torch_threads"] == 1
    assert record["generated_by"] == "python -m lib.course.bench.moe_balance"
    monkeypatch.setattr(mb, "ALPHAS", (0.01,))
    monkeypatch.setattr(mb, "POOLED_ALPHAS", ())
    monkeypatch.setattr(
        mb,
        "train_one",
        lambda alpha, seed, steps, **kw: {
            "alpha": alpha,
            "seed": seed,
            "at_end": record["results"][0]["at_end"],
            "seconds": 0.0,
        },
    )
    out = tmp_path / "record.json"
    mb.main(["--seeds", "3", "--steps", "12", "--out", str(out)])
    written = json.loads(out.read_text())
    assert [(r["alpha"], r["seed"]) for r in written["results"]] == [(0.01, 3)]


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="lesson_steps must be <= steps=20"):
        train_one(0.01, 0, 20, lesson_steps=30, **TINY)
    with pytest.raises(ValueError, match="steps must be >= 10"):
        train_one(0.01, 0, 5, **TINY)
    with pytest.raises(ValueError, match="alphas and seeds must each name at least one value"):
        run((), (0,))
    with pytest.raises(ValueError, match="seed must be >= 0"):
        run((0.0,), (-1,))
