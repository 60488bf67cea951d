"""Router balance at the length the claims are about (lesson 07): the lesson's α sweep of small
MoE language models, trained for the 500 steps *Transformer Architectures Compared* (31 May 2024)
speaks of, over several seeds.

    python -m lib.course.bench.moe_balance          # writes benchmarks/moe_balance_cpu.json

Lesson 07 trains one run per α, on one seed, for as many steps as its budget allows (`LESSON`).
The article's claims are about 500 steps ("α < 1e-3 collapses within 500 steps"; "α > 1e-1 forces
uniform routing"), and a router's balance differs from seed to seed. This command trains every
run the lesson trains, built and trained as the lesson does (`lib.moe_lm.train_moe_lm`, float64, one
thread, the Switch balance loss per layer), for each α in `ALPHAS` and each seed in `SEEDS`, for
`STEPS` steps, and records for each run what the lesson's tables show (`MoETrainRecord.summary`, the
last 10 steps averaged; "busiest" is the worst layer's busiest expert) at the lesson's length and
at the end, each layer's load f and mean router probability P there, the share of assignments
dropped at capacity factor `CAPACITY_FACTOR` on fresh batches (`lib.moe_lm.drop_rate`), the
busiest f and largest P over training (every 10 steps), and the machine. About ten minutes on one
thread.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lib._checks import require_int
from lib.course.bench import (
    BENCHMARKS,
    busy_machine,
    cpu_name,
    load_average,
    machine_record,
    today,
    torch_threads,
    write_record,
)

__all__ = [
    "ALPHAS",
    "CAPACITY_FACTOR",
    "COLLAPSE_BUSIEST",
    "CURVE_EVERY",
    "LESSON_STEPS",
    "POOLED_ALPHAS",
    "SEEDS",
    "STEPS",
    "collapsed",
    "run",
    "train_one",
]

ALPHAS = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
LESSON_STEPS = 150  # lesson 07's default run
STEPS = 500  # the article's "within 500 steps"
SEEDS = (0, 1, 2, 3, 4)
CURVE_EVERY = 10
POOLED_ALPHAS = (1e-2, 1.0)  # also trained on Hugging Face's pooled balance loss, to set beside the per-layer runs
CAPACITY_FACTOR = 1.25  # the article's "α = 0.01 with capacity factor 1.25 drops < 0.1% of tokens"
# Collapse, as lesson 07 judges it: an expert left with no tokens, or one expert taking 3x its even
# share in some layer (with top-2 of 8 experts, 37.5% of the assignments: 3 experts' worth).
COLLAPSE_BUSIEST = 3.0


def collapsed(summary: dict) -> bool:
    """Whether a run's `MoETrainRecord.summary()` shows a collapsed router (see COLLAPSE_BUSIEST)."""
    return summary["dead"] > 0 or summary["busiest"] >= COLLAPSE_BUSIEST


def train_one(alpha: float, seed: int, steps: int = STEPS, *, lesson_steps: int = LESSON_STEPS, **kwargs) -> dict:
    """One run, trained as lesson 07 trains it (float64), summarised at `lesson_steps` and at the end:
    the summary, each layer's f and P (last 10 steps), the drop rate at CAPACITY_FACTOR."""
    from lib.course.precision import default_dtype
    from lib.moe_lm import drop_rate, train_moe_lm

    require_int("steps", steps, minimum=10)
    require_int("lesson_steps", lesson_steps, minimum=10)
    if lesson_steps > steps:
        raise ValueError(f"lesson_steps must be <= steps={steps}, got {lesson_steps}")
    drops, seq_len = {}, kwargs.get("seq_len", 32)  # fresh windows as long as the model's

    def at_lesson_length(step, record):  # the model as it stands after `lesson_steps` steps
        if step == lesson_steps - 1:
            drops["at_lesson_steps"] = drop_rate(record.model, record.data, CAPACITY_FACTOR, seq_len=seq_len)

    with default_dtype(torch.float64):
        rec = train_moe_lm(alpha, steps=steps, seed=seed, on_step=at_lesson_length, **kwargs)
        drops["at_end"] = drop_rate(rec.model, rec.data, CAPACITY_FACTOR, seq_len=seq_len)
    short = _truncated(rec, lesson_steps)
    at_lesson = short.summary()
    end = rec.summary()

    def per_layer(r):
        return {"load": _rounded_rows(r.final_load()), "prob": _rounded_rows(r.final_prob())}

    xs = list(range(0, steps, CURVE_EVERY)) + ([steps - 1] if (steps - 1) % CURVE_EVERY else [])
    return {
        "alpha": float(alpha),
        "seed": seed,
        "steps": steps,
        "pooled": rec.pooled,
        "at_lesson_steps": {
            **_rounded(at_lesson),
            "collapsed": collapsed(at_lesson),
            "drop_rate_at_capacity": round(drops["at_lesson_steps"], 6),
            **per_layer(short),
        },
        "at_end": {
            **_rounded(end),
            "collapsed": collapsed(end),
            "drop_rate_at_capacity": round(drops["at_end"], 6),
            **per_layer(rec),
        },
        "curve_steps": xs,
        "busiest_curve": [round(rec.imbalance[i], 4) for i in xs],
        "busiest_prob_curve": [round(rec.prob_imbalance[i], 4) for i in xs],
        "seconds": round(rec.seconds, 1),
    }


def _truncated(rec, steps: int):
    """The record as it stood after `steps` steps (the training is the same up to there)."""
    from dataclasses import replace

    return replace(
        rec,
        loss=rec.loss[:steps],
        aux_loss=rec.aux_loss[:steps],
        z_loss=rec.z_loss[:steps],
        aux_loss_per_layer=rec.aux_loss_per_layer[:steps],
        aux_loss_pooled=rec.aux_loss_pooled[:steps],
        dead_experts=rec.dead_experts[:steps],
        drop_rate=rec.drop_rate[:steps],
        load=rec.load[:steps],
        prob=rec.prob[:steps],
    )


def _rounded(summary: dict) -> dict:
    return {k: round(v, 4) for k, v in summary.items()}


def _rounded_rows(t: torch.Tensor) -> list[list[float]]:
    """(L, E) -> L lists of E shares, 4 decimals."""
    return [[round(float(v), 4) for v in row] for row in t]


def run(
    alphas=ALPHAS,
    seeds=SEEDS,
    steps: int = STEPS,
    *,
    pooled_alphas=POOLED_ALPHAS,
    threads: int | None = 1,
    progress=print,
    **kwargs,
) -> dict:
    """Every (α, seed) run, as a JSON-able record with the machine; and for each α in `pooled_alphas`
    and each seed, the same run trained on the pooled balance loss ("pooled_results"). `kwargs` go to
    train_moe_lm (the tests shrink the model; the record uses the lesson's defaults)."""
    alphas, seeds = tuple(alphas), tuple(seeds)
    if not alphas or not seeds:
        raise ValueError(f"alphas and seeds must each name at least one value, got {alphas} and {seeds}")
    for s in seeds:
        require_int("seed", s, minimum=0)
    pooled_alphas = tuple(pooled_alphas)
    results, pooled_results = [], []
    with torch_threads(threads) as used:  # the lesson's tiny matrices: one thread
        load = load_average()
        for seed in seeds:
            for alpha, pooled in [(a, False) for a in alphas] + [(a, True) for a in pooled_alphas]:
                out = pooled_results if pooled else results
                out.append(
                    train_one(
                        alpha, seed, steps, lesson_steps=min(LESSON_STEPS, steps), pooled_balance=pooled, **kwargs
                    )
                )
                load += load_average()
                if progress:
                    end = out[-1]["at_end"]
                    progress(
                        f"α = {alpha:g}{' (pooled)' if pooled else ''}, seed {seed}: busiest f "
                        f"{end['busiest']:.2f}x even, largest P {end['busiest_prob']:.2f}x, dead "
                        f"{end['dead']:.1f}, drops at C = {CAPACITY_FACTOR} "
                        f"{end['drop_rate_at_capacity']:.2%} ({out[-1]['seconds']:.0f} s)"
                    )
    return {
        "benchmark": "router balance of lesson 07's MoE language models over α and seeds (lib.moe_lm.train_moe_lm, "
        "float64, the Switch balance loss per layer): the last 10 steps averaged at the lesson's "
        "length and at the end",
        "balance_loss": "per layer, averaged over layers (lib.moe.load_balancing_loss); aux_pooled: Hugging Face's "
        "pooled form, recorded beside it, not trained on",
        "busiest": "the worst layer's busiest expert: its load f over the even share 1/E (busiest_prob: P likewise)",
        "per_layer": "load and prob: each layer's f (shares of its assignments) and mean router probability P per "
        "expert, the last 10 steps averaged",
        "capacity_factor": CAPACITY_FACTOR,
        "drop_rate_at_capacity": "share of the assignments dropped at capacity_factor over all layers, on 4 fresh "
        "batches of 16 x 32 characters (lib.moe_lm.drop_rate), the trained model",
        "alphas": list(alphas),
        "seeds": list(seeds),
        "steps": steps,
        "lesson_steps": min(LESSON_STEPS, steps),
        "collapse": f"dead experts > 0 or busiest >= {COLLAPSE_BUSIEST}x the even share",
        "results": results,
        "pooled_alphas": list(pooled_alphas),
        "pooled_results": pooled_results,
        "machine": machine_record(cpu_name(), used, load, "load_average_1min_at_start_and_after_each_run"),
        "busy_machine": busy_machine(load),
        "date": today(),
        "generated_by": "python -m lib.course.bench.moe_balance",
        "note": "generated file: rerun python -m lib.course.bench.moe_balance to update it, do not edit by hand. "
        "float64 training: a rerun on the same machine gives the same numbers; other CPUs may differ for "
        "the strongest α, whose loss holds the router near ties between experts (a tie that flips with "
        "the last digit changes the run from there on); the seconds depend on the machine and its load.",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    record = run(ALPHAS, args.seeds, args.steps, pooled_alphas=POOLED_ALPHAS, threads=args.threads)
    out = args.out or BENCHMARKS / "moe_balance_cpu.json"
    write_record(record, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
