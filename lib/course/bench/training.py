"""Training throughput: tokens per second of one training step, for every model the course trains.

    python -m lib.course.bench.training                  # writes benchmarks/training_cpu.json
    python -m lib.course.bench.training --repeats 30 --threads 1

Each model is built as its lesson builds it, at the lesson's default size, batch and dtype:

    lesson 03  the character GPT (2 layers, width 96, context 64), batch 24, float64
    lesson 06  the selective-copying Mamba (2 layers, width 32, 68-token sequences), batch 32, float64
    lesson 07  the MoE GPT of `lib.moe_lm.train_moe_lm` (8 experts, top-2), batch 16 x 32, float32
    lesson 08  the four models of `lib.course.compare.build_models("default")` (GPT, Mamba, MoE GPT,
               hybrid) on its recall mix, batch 16, float64

A step is what the lessons' training loops do: forward with the loss, backward, gradient
clipping, an AdamW step. The models of one lesson are timed in turn on the same batches,
interleaved (model 1, model 2, ..., then again), after one warm-up step each, so a change in the
machine's load touches all of them alike; each model's figure is the median. Within a lesson the
step time is also given relative to that lesson's GPT (lesson 08's ratios are the comparison its
FLOPs table leaves out: what each architecture costs to train on this CPU): `relative_step_times`,
the median over rounds of the two models' step times on the same batch. Lesson 08 mixes sequence
lengths, so a ratio of the two medians could set a short batch against a long one; a paired ratio
never does. A record, not a test: timings depend on the machine and on whatever else runs on it
(the load average is recorded).

`training_throughput(models, batches)` is the measurement itself, for lessons to call on their
own models (it trains copies, so the models passed in are left as they were).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from functools import partial
from pathlib import Path
from typing import Callable

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

__all__ = ["LESSONS", "lesson_cases", "relative_step_times", "run", "training_throughput"]

LESSONS = ("03", "06", "07", "08")


def _loss(model, idx, targets):
    out = model(idx, targets)
    return out[1] if isinstance(out, tuple) else out


def training_throughput(
    models: dict[str, torch.nn.Module], batches: list, *, repeats: int = 10, lr: float = 1e-3
) -> dict[str, dict]:
    """Seconds per training step and tokens per second for each model, timed side by side.

    models: {name: a model whose forward(idx, targets) returns (logits, loss)}; batches: a list of
    (idx (B, T), targets (B, T)) pairs, all models given the same ones in the same order. Each
    model trains a deep copy in its own dtype (AdamW at `lr`, gradients clipped to norm 1, as
    lib.tasks.train_on_task). One warm-up step each, then `repeats` rounds, each
    round one step of every model in turn. Returns {name: {"median_seconds", "tokens_per_step",
    "tokens_per_second", "seconds"}}, tokens counted over the batch (B·T, padding included).
    """
    if not isinstance(models, dict) or not models or not all(isinstance(m, torch.nn.Module) for m in models.values()):
        raise TypeError("models must be a non-empty dict of name -> torch.nn.Module")
    if not isinstance(batches, (list, tuple)) or not batches:
        raise ValueError("batches must be a non-empty list of (idx, targets) pairs")
    for i, batch in enumerate(batches):
        if not (
            isinstance(batch, (list, tuple))
            and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)
            and batch[0].dim() == 2
            and batch[0].shape == batch[1].shape
        ):
            raise ValueError(f"batches[{i}] must be a pair (idx, targets) of (B, T) tensors of one shape")
    require_int("repeats", repeats, minimum=1)
    steps: dict[str, Callable[[tuple], None]] = {}
    for name, model in models.items():
        twin = copy.deepcopy(model).train()
        params = [p for p in twin.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), foreach=True)  # as the lessons' training loops

        def step(batch, twin=twin, params=params, opt=opt) -> None:
            loss = _loss(twin, *batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        steps[name] = step
    seconds = {name: [] for name in models}
    for step in steps.values():
        step(batches[0])  # warm-up: first-call costs (allocations, a kernel's build) stay out
    for r in range(repeats):
        batch = batches[r % len(batches)]
        for name, step in steps.items():
            seconds[name] += timed(partial(step, batch), repeats=1, warmup=0)
    tokens = statistics.mean(batches[r % len(batches)][0].numel() for r in range(repeats))  # those timed
    out = {}
    for name, s in seconds.items():
        median = statistics.median(s)
        out[name] = {
            "median_seconds": median,
            "tokens_per_step": tokens,
            "tokens_per_second": tokens / median,
            "seconds": s,
        }
    return out


def relative_step_times(timed: dict[str, dict], base: str) -> dict[str, float]:
    """Each model's step time relative to `base`'s: for every round, the two steps on the same
    batch divided, then the median over rounds. `timed` is what `training_throughput` returns."""
    if not isinstance(timed, dict) or base not in timed:
        raise ValueError(
            f"base must name one of the timed models {sorted(timed) if isinstance(timed, dict) else []}, got {base!r}"
        )
    reference = timed[base]["seconds"]
    return {
        name: statistics.median(s / r for s, r in zip(t["seconds"], reference, strict=True))
        for name, t in timed.items()
    }


# --------------------------------------------------------------------------- the lessons' models
def _char_batches(batch_size: int, seq_len: int, count: int, seed: int):
    from lib.corpus import CharVocab, facts_corpus
    from lib.train import get_batch

    text = "\n".join(facts_corpus(1000, seed=0)) + "\n"
    vocab = CharVocab.build(text)
    data = vocab.encode(text)
    g = torch.Generator().manual_seed(seed)
    return len(vocab), [get_batch(data, batch_size, seq_len, g) for _ in range(count)]


def _task_batches(task, batch_size: int, count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [task(batch_size, g) for _ in range(count)]


def lesson_cases(lesson: str, *, batches: int = 8, seed: int = 0) -> tuple[dict, list]:
    """(models, batches) of one lesson's training, built in its dtype, as `training_throughput` takes them."""
    from lib.course.precision import default_dtype

    if lesson not in LESSONS:
        raise ValueError(f"lesson must be one of {LESSONS}, got {lesson!r}")
    require_int("batches", batches, minimum=1)
    torch.manual_seed(seed)
    if lesson == "03":
        from lib.gpt import GPT, GPTConfig

        vocab_size, data = _char_batches(24, 64, batches, seed)
        with default_dtype(torch.float64):
            models = {"GPT": GPT(GPTConfig.tiny(vocab_size=vocab_size, n_layer=2, n_embd=96))}
        return models, data
    if lesson == "06":
        from lib.course.bench.selective_copying import LESSON, CopyRun, build

        task, model = build(CopyRun(LESSON["n_blank"], True, LESSON["steps"], seed))  # float64, as the lesson
        return {"Mamba": model}, _task_batches(task, LESSON["batch_size"], batches, seed)
    if lesson == "07":
        from lib.gpt import GPTConfig
        from lib.moe_lm import moe_gpt

        vocab_size, data = _char_batches(16, 32, batches, seed)
        config = GPTConfig(vocab_size=vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64)
        return {"MoE GPT": moe_gpt(config, 8, 2, 128)}, data
    from lib.course.compare import SETTINGS, MixedTask, build_models, recall_task

    setting = SETTINGS["default"]
    mix = MixedTask([recall_task(setting, p) for p in setting.recall_train_pairs])
    with default_dtype(torch.float64):
        models = build_models(setting, mix.vocab_size)
    return models, _task_batches(mix, 16, batches, seed)  # one batch size for all four, as the lesson times them


def run(lessons=LESSONS, *, repeats: int = 20, threads: int | None = None) -> dict:
    """Every lesson's models timed (lesson by lesson), as a JSON-able record."""
    from lib.kernels.scan_cpu import cpu_kernel_status

    require_int("repeats", repeats, minimum=1)
    rows = []
    with torch_threads(threads) as used:
        load = load_average()
        for lesson in lessons:
            models, batches = lesson_cases(lesson)
            timed = training_throughput(models, batches, repeats=repeats)
            relative = relative_step_times(timed, "GPT") if "GPT" in timed else None
            for name, t in timed.items():
                dtype = next(models[name].parameters()).dtype
                rows.append(
                    {
                        "lesson": lesson,
                        "model": name,
                        "dtype": str(dtype).replace("torch.", ""),
                        "parameters": sum(p.numel() for p in models[name].parameters()),
                        "batch_size": batches[0][0].shape[0],
                        "mean_length": round(t["tokens_per_step"] / batches[0][0].shape[0], 2),
                        "median_seconds_per_step": round(t["median_seconds"], 6),
                        "tokens_per_step": t["tokens_per_step"],
                        "tokens_per_second": round(t["tokens_per_second"], 1),
                        "step_time_vs_lesson_gpt": None if relative is None else round(relative[name], 2),
                        "seconds": [round(s, 6) for s in t["seconds"]],
                    }
                )
            load += load_average()
    return {
        "benchmark": "training throughput: one step (forward with loss, backward, clipping, AdamW) of each model "
        "the course trains, at its lesson's default size, batch and dtype; models of one lesson "
        "interleaved on the same batches; median over repeats; the step time relative to the "
        "lesson's GPT is the median over rounds of the two steps on the same batch",
        "repeats": repeats,
        "results": rows,
        "scan_kernel": cpu_kernel_status(),
        "machine": machine_record(cpu_name(), used, load, "load_average_1min_at_start_and_after_each_lesson"),
        "busy_machine": busy_machine(load),
        "date": today(),
        "generated_by": "python -m lib.course.bench.training",
        "note": "generated file: rerun python -m lib.course.bench.training to update it, do not edit by hand. A load "
        "average above the core count means other processes shared the CPU.",
    }


def markdown(record: dict) -> str:
    lines = [
        "| lesson | model | dtype | parameters | batch x mean T | ms per step | tokens/s | step vs lesson's GPT |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for r in record["results"]:
        ratio = "" if r["step_time_vs_lesson_gpt"] is None else f"{r['step_time_vs_lesson_gpt']:.2f}x"
        lines.append(
            f"| {r['lesson']} | {r['model']} | {r['dtype']} | {r['parameters']:,} | "
            f"{r['batch_size']} x {r['mean_length']:g} | {1e3 * r['median_seconds_per_step']:.1f} | "
            f"{r['tokens_per_second']:,.0f} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lessons", nargs="+", default=list(LESSONS), choices=LESSONS)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2: a laptop's least)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    record = run(args.lessons, repeats=args.repeats, threads=args.threads)
    print(f"{record['machine']['device']}, {args.threads} threads, torch {torch.__version__}")
    print(markdown(record))
    if record["busy_machine"]:
        print("\nwarning: the load average exceeded the core count: other processes shared the CPU")
    out = args.out or BENCHMARKS / "training_cpu.json"
    write_record(record, out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
