"""Router balance at the length the claims are about (lesson 07): the lesson's α sweep of small
MoE language models, trained for the 500 steps *Transformer Architectures Compared* (31 May 2024)
speaks of, over several seeds.

    python -m lib.bench.moe_balance          # writes benchmarks/moe_balance_cpu.json

Lesson 07 trains one run per α, on one seed, for as many steps as its budget allows (`LESSON`).
The article's claims are about 500 steps ("α < 1e-3 collapses within 500 steps"; "α > 1e-1 forces
uniform routing"), and a router's balance differs from seed to seed. This command trains every
run the lesson trains, built and trained as the lesson does (`lib.moe_lm.train_moe_lm`, float64, one
thread), for each α in `ALPHAS` and each seed in `SEEDS`, for `STEPS` steps, and records for each
run what the lesson's tables show (`MoETrainRecord.summary`, the last 10 steps averaged) at the
lesson's length and at the end, with the busiest expert's load f and the largest mean router
probability P over training (every 10 steps), and the machine. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lib._checks import require_int
from lib.bench import (BENCHMARKS, busy_machine, cpu_name, load_average, machine_record, today, torch_threads,
                       write_record)

__all__ = ["ALPHAS", "COLLAPSE_BUSIEST", "CURVE_EVERY", "LESSON_STEPS", "SEEDS", "STEPS", "collapsed", "run",
           "train_one"]

ALPHAS = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
LESSON_STEPS = 150  # lesson 07's default run
STEPS = 500  # the article's "within 500 steps"
SEEDS = (0, 1, 2)
CURVE_EVERY = 10
# Collapse, as lesson 07 judges it: an expert left with no tokens, or one expert taking 3x its even
# share (with top-2 of 8 experts, 37.5% of the assignments: 3 experts' worth).
COLLAPSE_BUSIEST = 3.0


def collapsed(summary: dict) -> bool:
    """Whether a run's `MoETrainRecord.summary()` shows a collapsed router (see COLLAPSE_BUSIEST)."""
    return summary["dead"] > 0 or summary["busiest"] >= COLLAPSE_BUSIEST


def train_one(alpha: float, seed: int, steps: int = STEPS, *, lesson_steps: int = LESSON_STEPS, **kwargs) -> dict:
    """One run, trained as lesson 07 trains it (float64), summarised at `lesson_steps` and at the end."""
    from lib.moe_lm import train_moe_lm
    from lib.precision import default_dtype

    require_int("steps", steps, minimum=10)
    require_int("lesson_steps", lesson_steps, minimum=10)
    if lesson_steps > steps:
        raise ValueError(f"lesson_steps must be <= steps={steps}, got {lesson_steps}")
    with default_dtype(torch.float64):
        rec = train_moe_lm(alpha, steps=steps, seed=seed, **kwargs)
    at_lesson = _truncated(rec, lesson_steps).summary()
    end = rec.summary()
    xs = list(range(0, steps, CURVE_EVERY)) + ([steps - 1] if (steps - 1) % CURVE_EVERY else [])
    return {"alpha": float(alpha), "seed": seed, "steps": steps,
            "at_lesson_steps": {**_rounded(at_lesson), "collapsed": collapsed(at_lesson)},
            "at_end": {**_rounded(end), "collapsed": collapsed(end)},
            "curve_steps": xs,
            "busiest_curve": [round(rec.imbalance[i], 4) for i in xs],
            "busiest_prob_curve": [round(rec.prob_imbalance[i], 4) for i in xs],
            "seconds": round(rec.seconds, 1)}


def _truncated(rec, steps: int):
    """The record as it stood after `steps` steps (the training is the same up to there)."""
    from dataclasses import replace

    return replace(rec, loss=rec.loss[:steps], aux_loss=rec.aux_loss[:steps], z_loss=rec.z_loss[:steps],
                   dead_experts=rec.dead_experts[:steps], drop_rate=rec.drop_rate[:steps], load=rec.load[:steps],
                   prob=rec.prob[:steps])


def _rounded(summary: dict) -> dict:
    return {k: round(v, 4) for k, v in summary.items()}


def run(alphas=ALPHAS, seeds=SEEDS, steps: int = STEPS, *, threads: int | None = 1, progress=print,
        **kwargs) -> dict:
    """Every (α, seed) run, as a JSON-able record with the machine. `kwargs` go to train_moe_lm
    (the tests shrink the model; the record uses the lesson's defaults)."""
    alphas, seeds = tuple(alphas), tuple(seeds)
    if not alphas or not seeds:
        raise ValueError(f"alphas and seeds must each name at least one value, got {alphas} and {seeds}")
    for s in seeds:
        require_int("seed", s, minimum=0)
    results = []
    with torch_threads(threads) as used:  # the lesson's tiny matrices: one thread
        load = load_average()
        for seed in seeds:
            for alpha in alphas:
                results.append(train_one(alpha, seed, steps, lesson_steps=min(LESSON_STEPS, steps), **kwargs))
                load += load_average()
                if progress:
                    end = results[-1]["at_end"]
                    progress(f"α = {alpha:g}, seed {seed}: busiest f {end['busiest']:.2f}x even, largest P "
                             f"{end['busiest_prob']:.2f}x, dead {end['dead']:.1f} ({results[-1]['seconds']:.0f} s)")
    return {
        "benchmark": "router balance of lesson 07's MoE language models over α and seeds (lib.moe_lm.train_moe_lm, "
                     "float64): the last 10 steps averaged at the lesson's length and at the end",
        "alphas": list(alphas),
        "seeds": list(seeds),
        "steps": steps,
        "lesson_steps": min(LESSON_STEPS, steps),
        "collapse": f"dead experts > 0 or busiest >= {COLLAPSE_BUSIEST}x the even share",
        "results": results,
        "machine": machine_record(cpu_name(), used, load, "load_average_1min_at_start_and_after_each_run"),
        "busy_machine": busy_machine(load),
        "date": today(),
        "generated_by": "python -m lib.bench.moe_balance",
        "note": "generated file: rerun python -m lib.bench.moe_balance to update it, do not edit by hand. "
                "float64 training: a rerun on the same machine gives the same numbers, and other CPUs agree except "
                "for α = 1, whose router is chaotic (near-ties between experts flip with the last digit); the "
                "seconds depend on the machine and its load.",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    record = run(ALPHAS, args.seeds, args.steps, threads=args.threads)
    out = args.out or BENCHMARKS / "moe_balance_cpu.json"
    write_record(record, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
