"""Selective copying at a scale that decides (lesson 06): the selective Mamba against the same block
with fixed Δ, B, C (time-invariant), over several seeds, sequence lengths and training lengths.

    python -m lib.course.bench.selective_copying          # writes benchmarks/selective_copying_cpu.json

Lesson 06 trains each model once, on one seed, for as many steps as its budget allows. How far
one run decides the claim (Gu & Dao 2023, §4.1.1: a selective SSM solves the task, a
time-invariant one does not) depends on two things one run cannot show: the seed (the selective
model learns the task in a sudden drop of the loss whose timing differs from seed to seed) and
the length of the sequences (a gated time-invariant block can still learn to copy from short
sequences, given enough steps; the longer the sequence, the further behind it stays). This
command trains every model the lesson trains, built and trained as the lesson does
(`lib.tasks.train_on_task`, float64), for each seed in `SEEDS`:

    at the lesson's task (4 symbols among 60 blanks)   the lesson's steps, and LONG_STEPS
    at shorter sequences (12 and 28 blanks)            LONG_STEPS

and records each run's answer accuracy (`lib.tasks.task_accuracy`, held-out batches), final loss
and seconds, with the machine. Tens of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
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
from lib.course.bench.timer import seconds as timed

__all__ = ["LESSON", "LONG_STEPS", "SEEDS", "SHORTER_BLANKS", "CopyRun", "build", "run", "runs", "train_one"]


@dataclass(frozen=True)
class CopyRun:
    """One training run: the task's size, the model's kind, the steps and the seed."""

    n_blank: int
    selective: bool
    steps: int
    seed: int
    n_data: int = 4
    n_symbols: int = 8
    d_model: int = 32
    n_layers: int = 2
    batch_size: int = 32
    lr: float = 5e-3


LESSON = dict(n_data=4, n_blank=60, n_symbols=8, d_model=32, n_layers=2, steps=1200, batch_size=32, lr=5e-3)
LONG_STEPS = 3000  # 2.5x the lesson's steps
SHORTER_BLANKS = (12, 28)
SEEDS = (0, 1, 2)


def runs(seeds=SEEDS) -> list[CopyRun]:
    """Every run of the record, in the order they are trained."""
    out = []
    for seed in seeds:
        for selective in (True, False):
            for steps in (LESSON["steps"], LONG_STEPS):
                out.append(CopyRun(LESSON["n_blank"], selective, steps, seed))
            for n_blank in SHORTER_BLANKS:
                out.append(CopyRun(n_blank, selective, LONG_STEPS, seed))
    return out


def build(r: CopyRun):
    """(task, model) as lesson 06 builds them: seeded by r.seed, float64."""
    from lib.course.precision import default_dtype
    from lib.mamba import MambaConfig
    from lib.mamba_lm import MambaLM
    from lib.tasks import SelectiveCopying

    task = SelectiveCopying(n_data=r.n_data, n_blank=r.n_blank, n_symbols=r.n_symbols)
    with default_dtype(torch.float64):
        torch.manual_seed(r.seed)
        model = MambaLM(
            MambaConfig(vocab_size=task.vocab_size, d_model=r.d_model, n_layers=r.n_layers, selective=r.selective)
        )
    return task, model


def train_one(r: CopyRun) -> dict:
    """Train one run and measure it: accuracy, the mean loss of its last 50 steps, seconds."""
    from lib.course.precision import default_dtype
    from lib.tasks import task_accuracy, train_on_task

    if not isinstance(r, CopyRun):
        raise TypeError(f"r must be a CopyRun, got {type(r).__name__}")
    task, model = build(r)
    losses = []

    def train() -> None:
        with default_dtype(torch.float64):
            losses.extend(train_on_task(model, task, steps=r.steps, batch_size=r.batch_size, lr=r.lr, seed=r.seed))

    [seconds] = timed(train, repeats=1, warmup=0)
    tail = losses[-50:]
    return {
        **asdict(r),
        "seq_len": task.seq_len,
        "accuracy": task_accuracy(model, task),
        "final_loss": sum(tail) / len(tail),
        "seconds": round(seconds, 1),
    }


def run(seeds=SEEDS, *, threads: int | None = 2, progress=print) -> dict:
    """Every run of `runs(seeds)`, as a JSON-able record with the machine."""
    from lib.kernels.scan_cpu import cpu_kernel_status

    seeds = tuple(seeds)
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    for s in seeds:
        require_int("seed", s, minimum=0)
    results = []
    with torch_threads(threads) as used:
        load = load_average()
        for r in runs(seeds):
            results.append(train_one(r))
            load += load_average()
            if progress:
                res = results[-1]
                progress(
                    f"{'selective' if r.selective else 'fixed':9s} L={res['seq_len']:3d} steps={r.steps:5d} "
                    f"seed={r.seed}: accuracy {res['accuracy']:.1%} ({res['seconds']:.0f} s)"
                )
    return {
        "benchmark": "selective copying, selective Mamba vs fixed Δ, B, C: answer accuracy per run (lesson 06's "
        "models and training, float64)",
        "lesson": LESSON,
        "long_steps": LONG_STEPS,
        "seeds": list(seeds),
        "results": results,
        "scan_kernel": cpu_kernel_status(),
        "machine": machine_record(cpu_name(), used, load, "load_average_1min_at_start_and_after_each_run"),
        "busy_machine": busy_machine(load),
        "date": today(),
        "generated_by": "python -m lib.course.bench.selective_copying",
        "note": "generated file: rerun python -m lib.course.bench.selective_copying to update it, do not edit by hand. "
        "Accuracies come from float64 training: a rerun on the same machine gives the same ones, another "
        "CPU's rounding can move a run caught in the middle of its sudden drop of the loss; the seconds "
        "depend on the machine and its load.",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    record = run(args.seeds, threads=args.threads)
    out = args.out or BENCHMARKS / "selective_copying_cpu.json"
    write_record(record, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
