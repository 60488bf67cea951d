"""Lesson 08's records: the four architectures trained and measured, seed by seed.

    python -m lib.course.bench.compare           both records lesson 08 reads (about 85 minutes on 2 cores):
                                          --setting full, the run, to benchmarks/compare_full.json;
                                          --setting state, the state sweep, to compare_state.json
    run(setting)                          every measurement of lib.course.compare, once per seed, as a
                                          JSON-able dict (and recall by Mamba at each of
                                          setting.state_sizes)
    state_sweep(setting)                  recall alone, trained on every pair count it is asked: the
                                          GPT against the Mamba at each of setting.state_sizes
    load_results(setting)                 the committed record, or None
    decode_seconds_per_token(model, S)    wall time of one cached decoding step after S tokens
    decode_time_ratio(model, baseline, S) the same for two models, measured side by side: a ratio

The models, tasks, recipes and the judging of several seeds are `lib.course.compare`; this module runs
them and times them (with lib.course.bench.timer). Records made before it existed name its former
command, `python -m lib.course.compare`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from lib._checks import require_int
from lib.course.bench import BENCHMARKS, cpu_name, load_average, load_record, machine_record, today, write_record
from lib.course.bench.timer import seconds
from lib.course.compare import (
    ARCHITECTURES,
    DECODE_TOKENS,
    SETTINGS,
    SWEEPS,
    MixedTask,
    Setting,
    accuracy_grid,
    build_model,
    build_models,
    copy_task,
    expert_scaling,
    forward_flops,
    get_setting,
    parameter_table,
    recall_task,
    train_all,
)
from lib.course.precision import default_dtype
from lib.decode import decode_state_bytes

__all__ = [
    "decode_seconds_per_token",
    "decode_time_ratio",
    "explorer_results",
    "load_results",
    "main",
    "run",
    "state_label",
    "state_sweep",
]


# --------------------------------------------------------------------------- decoding time
@torch.no_grad()
def decode_seconds_per_token(
    model: torch.nn.Module, context: int, *, new_tokens: int = DECODE_TOKENS, repeats: int = 3
) -> float:
    """Median wall time of one decoding step (batch 1, after a prefill of `context` tokens),
    with the model's own cache: KV caches for attention layers, the recurrent state for Mamba.
    One untimed run first, so that first-call costs (allocation, dispatch caches) stay out."""
    require_int("context", context, minimum=1)
    require_int("new_tokens", new_tokens, minimum=1)
    require_int("repeats", repeats, minimum=1)
    prompt = _decode_prompt(model, context)
    _decode_seconds(model, prompt, new_tokens)  # warm-up
    return statistics.median(_decode_seconds(model, prompt, new_tokens) for _ in range(repeats))


def decode_time_ratio(
    model: torch.nn.Module, baseline: torch.nn.Module, context: int, *, new_tokens: int = DECODE_TOKENS, rounds: int = 9
) -> float:
    """How many times longer a decoding step of `model` takes than one of `baseline` (batch 1, after
    `context` tokens), measured side by side: each round times both, in alternating order, and the
    result is the median over rounds of the two times' ratio, so a change in the machine's load
    during the run touches both alike. Both are warmed up first."""
    require_int("context", context, minimum=1)
    require_int("new_tokens", new_tokens, minimum=1)
    require_int("rounds", rounds, minimum=1)
    prompts = [_decode_prompt(m, context) for m in (model, baseline)]
    for m, prompt in zip((model, baseline), prompts):
        _decode_seconds(m, prompt, new_tokens)  # warm-up
    ratios = []
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        t = {i: _decode_seconds((model, baseline)[i], prompts[i], new_tokens) for i in order}
        ratios.append(t[0] / t[1])
    return statistics.median(ratios)


def _decode_prompt(model: torch.nn.Module, context: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(model.vocab_size, (1, context), generator=g)


def _decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    """Seconds per step of `new_tokens` greedy decoding steps after a prefill of `prompt` (not timed),
    with the model's own caches (lib.decode's protocol)."""
    context = prompt.shape[1]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            caches = model.new_caches(1, context + new_tokens)
            logits = model(prompt, caches=caches)

            def decode() -> None:
                nxt = logits[:, -1:].argmax(-1)
                for t in range(new_tokens):
                    nxt = model(nxt, caches=caches, start=context + t)[:, -1:].argmax(-1)

            return seconds(decode, repeats=1, warmup=0)[0] / new_tokens
    finally:
        model.train(was_training)


# --------------------------------------------------------------------------- the whole run
LOSS_EVERY = 50  # a run's loss curves are kept as means over this many steps


def run(setting: Setting | str = "default", *, jobs: int = 1, timing: bool = True) -> dict:
    """Train the four models on both tasks once per seed of the setting, and measure everything
    lesson 08 reports. JSON-able: accuracies as {model: {P or T: [one per seed]}}, loss curves as
    means over LOSS_EVERY steps, one list per seed. `jobs` > 1 trains the models in that many
    processes (one thread each). Models are built and trained in setting.dtype; memory is reported for float32,
    as the models would be deployed; FLOPs, bytes and times are measured on fresh (untrained) models
    of the first seed."""
    s = get_setting(setting)
    require_int("jobs", jobs, minimum=1)
    units = [
        (s, seed, task, name, s.d_state) for seed in s.seeds for task in ("recall", "copy") for name in ARCHITECTURES
    ]
    units += [(s, seed, "recall", "Mamba", n) for seed in s.seeds for n in s.state_sizes if n != s.d_state]
    cost = {
        task: {name: r.steps * r.batch_size for name, r in recipes.items()}
        for task, recipes in (("recall", s.recall), ("copy", s.copy))
    }
    units.sort(key=lambda u: -cost[u[2]][u[3]])  # the longest first, so that the processes finish together
    results = _train_units(units, jobs)
    done = {unit[1:]: r for unit, r in zip(units, results)}
    main_ = {(seed, task, name): done[seed, task, name, s.d_state] for seed, task, name, _ in done}
    out: dict = dict(setting=asdict(s), architectures=list(ARCHITECTURES), seeds=list(s.seeds), loss_every=LOSS_EVERY)
    for task in ("recall", "copy"):
        keys = list(main_[s.seed, task, "GPT"]["accuracy"])
        out[f"{task}_accuracy"] = {
            name: {k: [main_[seed, task, name]["accuracy"][k] for seed in s.seeds] for k in keys}
            for name in ARCHITECTURES
        }
        out[f"{task}_loss"] = {name: [main_[seed, task, name]["loss"] for seed in s.seeds] for name in ARCHITECTURES}
    if s.state_sizes:  # Mamba with each state size on recall (the main Mamba's d_state among them)
        sizes = sorted(set(s.state_sizes) | {s.d_state})
        keys = list(out["recall_accuracy"]["Mamba"])
        out["state_accuracy"] = {
            str(n): {k: [done[seed, "recall", "Mamba", n]["accuracy"][k] for seed in s.seeds] for k in keys}
            for n in sizes
        }
        out["state_loss"] = {str(n): [done[seed, "recall", "Mamba", n]["loss"] for seed in s.seeds] for n in sizes}
    out.update(_costs(s, timing=timing))
    return out


def state_label(d_state: int) -> str:
    """The name a Mamba with state size `d_state` goes by in a state sweep: "Mamba (d_state 4)"."""
    return f"Mamba (d_state {require_int('d_state', d_state, minimum=1)})"


def state_sweep(setting: Setting | str = "state", *, jobs: int = 1) -> dict:
    """Recall alone: the GPT, and the Mamba at each of setting.state_sizes, once per seed, each
    trained on setting.recall_train_pairs with its recipe and asked setting.recall_eval_pairs.
    JSON-able: {"recall_accuracy": {label: {P: [one per seed]}}, "recall_loss": {label: [per seed]}},
    labels "GPT" and state_label(n); the same numbers as the recall runs of `run` with that setting."""
    s = get_setting(setting)
    require_int("jobs", jobs, minimum=1)
    if not s.state_sizes:
        raise ValueError("setting.state_sizes must name at least one Mamba state size for a state sweep")
    members = [("GPT", s.d_state, "GPT")] + [("Mamba", n, state_label(n)) for n in dict.fromkeys(s.state_sizes)]
    units = [(s, seed, "recall", name, n) for name, n, _ in members for seed in s.seeds]
    results = {unit[1:]: r for unit, r in zip(units, _train_units(units, jobs))}
    out: dict = dict(setting=asdict(s), seeds=list(s.seeds), loss_every=LOSS_EVERY, recall_accuracy={}, recall_loss={})
    for name, n, label in members:
        runs = [results[seed, "recall", name, n] for seed in s.seeds]
        out["recall_accuracy"][label] = {k: [r["accuracy"][k] for r in runs] for k in runs[0]["accuracy"]}
        out["recall_loss"][label] = [r["loss"] for r in runs]
    return out


def _train_units(units: list, jobs: int) -> list[dict]:
    """_train_one(*unit) for each unit, in `jobs` processes of one thread each if jobs > 1."""
    if jobs == 1:
        return [_train_one(*unit) for unit in units]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=torch.set_num_threads, initargs=(1,)
    ) as pool:
        return list(pool.map(_train_one, *zip(*units)))


def _train_one(s: Setting, seed: int, task: str, name: str, d_state: int | None = None) -> dict:
    """One model's training and accuracy on one task for one seed: {"accuracy": {P or T: a}, "loss": thinned}.
    The same as training the four together: each model's weights and batches depend on the seed alone.
    `d_state` (default the setting's) sets the state size of the Mamba layers."""
    if d_state is not None:
        s = replace(s, d_state=d_state)
    with default_dtype(getattr(torch, s.dtype)):
        if task == "recall":
            mix = MixedTask([recall_task(s, p) for p in s.recall_train_pairs])
            evals = {str(p): recall_task(s, p) for p in s.recall_eval_pairs}
        else:
            mix = MixedTask([copy_task(s, b) for b in s.copy_train_blanks])
            evals = {str(copy_task(s, b).seq_len): copy_task(s, b) for b in s.copy_eval_blanks}
        model = build_model(s, name, mix.vocab_size, seed=seed)
        loss = train_all({name: model}, mix, s.recall if task == "recall" else s.copy, seed=seed)[name]
        accuracy = accuracy_grid({name: model}, evals, batches=s.eval_batches)[name]
    return dict(accuracy=accuracy, loss=_thin(loss))


def _thin(losses: list[float]) -> list[float]:
    """Means over consecutive LOSS_EVERY steps (the last group may be shorter), to 4 digits."""
    return [round(sum(c) / len(c), 4) for c in (losses[i : i + LOSS_EVERY] for i in range(0, len(losses), LOSS_EVERY))]


def _costs(s: Setting, *, timing: bool) -> dict:
    """FLOPs, decoding-state bytes, expert scaling and (if timing) seconds per decoded token."""
    vocab = MixedTask([recall_task(s, p) for p in s.recall_train_pairs]).vocab_size
    with default_dtype(torch.float64):
        models = build_models(s, vocab)
        out = dict(
            parameters=parameter_table(models),
            flops={name: [forward_flops(m, T) for T in s.flop_lengths] for name, m in models.items()},
            state_bytes={
                name: [decode_state_bytes(m, 1, S, dtype=torch.float32) for S in s.memory_contexts]
                for name, m in models.items()
            },
            experts=expert_scaling(s, vocab),
        )
    if timing:
        models = build_models(s, vocab)
        out["seconds_per_token"] = {
            name: [decode_seconds_per_token(m, S) for S in s.decode_contexts] for name, m in models.items()
        }
    return out


def load_results(setting: str = "full") -> dict | None:
    """The committed record of `python -m lib.course.bench.compare --setting <setting>`, or None if absent."""
    get_setting(setting)
    return load_record(f"compare_{setting}")


def explorer_results(record: dict) -> dict:
    """What lesson 08's explorer (`widgets.CompareView`) draws from a record of `run`: {metric:
    {architecture: (xs, ys)}}, the accuracies with one value per seed at each P or T (the explorer
    draws their mean and the lowest-highest range), FLOPs and decoding-state bytes as counted."""
    s = record["setting"]
    out = {
        task: {
            name: ([int(k) for k in row], [list(v) for v in row.values()])
            for name, row in record[f"{task}_accuracy"].items()
        }
        for task in ("recall", "copy")
    }
    out["flops"] = {name: (list(s["flop_lengths"]), list(f)) for name, f in record["flops"].items()}
    out["memory"] = {name: (list(s["memory_contexts"]), list(b)) for name, b in record["state_bytes"].items()}
    return out


def main(argv=None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description="Lesson 08's records: each setting's run, written to "
        "benchmarks/compare_<setting>.json (by default both records)"
    )
    parser.add_argument(
        "--setting",
        nargs="+",
        default=["full", "state"],
        choices=sorted(SETTINGS),
        help="the settings to run, in order (state: the state sweep)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="models trained at once, one process and thread each")
    parser.add_argument(
        "--no-timing", action="store_true", help="skip the decoding-time measurement (machine-dependent)"
    )
    parser.add_argument("--out", type=Path, default=None, help="where to write the record (one setting only)")
    args = parser.parse_args(argv)
    if args.out is not None and len(args.setting) != 1:
        parser.error("--out takes one setting")
    torch.set_num_threads(1)
    return [_write_record(name, args.jobs, not args.no_timing, args.out) for name in args.setting]


def _write_record(name: str, jobs: int, timing: bool, out: Path | None) -> Path:
    start = time.perf_counter()
    if name in SWEEPS:
        result = state_sweep(name, jobs=jobs)
        result["command"] = f"python -m lib.course.bench.compare --setting {name} --jobs {jobs}"
    else:
        result = run(name, jobs=jobs, timing=timing)
        result["command"] = f"python -m lib.course.bench.compare --setting {name} --jobs {jobs}" + (
            "" if timing else " --no-timing"
        )
    result["generated_by"] = "python -m lib.course.bench.compare"
    result["machine"] = machine_record(
        cpu_name(), 1, load_average(), f"load_average_1min_at_end ({jobs} processes of 1 thread)"
    )
    result["date"] = today()
    result["note"] = (
        "generated file: rerun the command to update it, do not edit by hand. float32 training "
        "in separate processes: the same machine gives the same numbers; another CPU's rounding can "
        "change a seed's path (a later or earlier end of recall's first phase)"
    )
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    out = out or BENCHMARKS / f"compare_{name}.json"
    write_record(result, out, indent=1)
    print(f"wrote {out} in {result['wall_seconds']} s")
    return out


if __name__ == "__main__":
    main()
