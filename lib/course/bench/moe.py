"""Benchmark: the MoE layer's two dispatch paths, "loop" and "grouped", side by side.

    python -m lib.course.bench.moe                  # writes benchmarks/moe_<device>.json
    python -m lib.course.bench.moe --repeats 9 --threads 2     # one thread count only

One lib.moe.MoE per setting (random weights: time does not depend on their values, and a random
router spreads tokens about evenly), timed forward (under no_grad) and forward + backward, both
dispatches in the same process, alternating, after a warm-up (lib.course.bench.timer.side_by_side); the
result is the ratio of the
medians (and of the minima: other jobs on a shared machine slow some repeats, never speed one up).
Settings: the lesson's target (4096 tokens, d_model 256, d_ff 1024, 8 experts, top-2), the same at
1024 tokens, and many small experts (64 experts of d_ff 128 at d_model 64), where finding and
moving tokens weighs more against the expert matmuls. Beside them, the expert matmuls alone on
segments of the same sizes: no dispatch can beat that, so loop / experts-alone bounds what any
dispatch can gain. Run with 2 torch threads, then 1 (on a shared 2-core machine, 2 threads
contend with other jobs at every parallel region). A record, not a test: timings depend on the
machine and on whatever else runs on it (the 1-minute load average is stored). (Records made
before this module existed name its former path, tools/bench_moe.py; their forward + backward
times include a second forward, a slip this module no longer makes.)
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from lib.course.bench import BENCHMARKS, device_name, load_average, machine_record, today, torch_threads, write_record
from lib.course.bench.timer import side_by_side
from lib.moe import MoE

SETTINGS = {
    "target": dict(tokens=4096, d_model=256, d_ff=1024, num_experts=8, top_k=2),
    "target_1024_tokens": dict(tokens=1024, d_model=256, d_ff=1024, num_experts=8, top_k=2),
    "many_small_experts": dict(tokens=4096, d_model=64, d_ff=128, num_experts=64, top_k=2),
}


def time_setting(s: dict, repeats: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    moe = MoE(s["d_model"], s["d_ff"], s["num_experts"], s["top_k"]).to(device)
    x = torch.randn(1, s["tokens"], s["d_model"], device=device)

    def forward() -> None:
        with torch.no_grad():
            moe(x)

    def forward_backward() -> None:
        xg = x.detach().requires_grad_(True)
        y, _ = moe(xg)
        y.sum().backward()
        moe.zero_grad(set_to_none=True)

    # the expert matmuls alone, on segments of the sizes this router produces: what no dispatch avoids
    forward()
    sizes = moe.last_stats.kept.tolist()
    segments = [torch.randn(n, s["d_model"], device=device) for n in sizes]

    def experts_only() -> None:
        with torch.no_grad():
            for seg, w in zip(segments, moe._weights()):
                moe.expert(seg, *w)

    def dispatched(fn, dispatch):
        def run() -> None:
            moe.dispatch = dispatch
            fn()

        return run

    runs = {
        f"{p}_{d}": dispatched(fn, d)
        for d in ("loop", "grouped")
        for p, fn in (("forward", forward), ("forward_backward", forward_backward))
    }
    runs["forward_experts_only"] = experts_only
    seconds = side_by_side(runs, repeats=repeats)  # one warm-up round, then alternating
    median = {k: statistics.median(v) for k, v in seconds.items()}
    fastest = {k: min(v) for k, v in seconds.items()}
    return {
        "setting": s,
        "seconds": {k: [round(t, 5) for t in v] for k, v in seconds.items()},
        "median_ms": {k: round(1000 * v, 2) for k, v in median.items()},
        "min_ms": {k: round(1000 * v, 2) for k, v in fastest.items()},
        "speedup_grouped_over_loop": {
            p: round(median[f"{p}_loop"] / median[f"{p}_grouped"], 2) for p in ("forward", "forward_backward")
        },
        "speedup_grouped_over_loop_of_min": {
            p: round(fastest[f"{p}_loop"] / fastest[f"{p}_grouped"], 2) for p in ("forward", "forward_backward")
        },
        # loop forward / expert matmuls alone: the most any dispatch could gain over the loop
        "forward_ceiling_loop_over_experts_only": round(median["forward_loop"] / median["forward_experts_only"], 2),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[2, 1],
        help="torch thread counts to run, in turn (default: 2, then 1)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results, load = {}, load_average()
    for n in args.threads:
        with torch_threads(n):
            results[f"threads_{n}"] = {name: time_setting(s, args.repeats, device) for name, s in SETTINGS.items()}
        load += load_average()
    result = {
        "benchmark": "lib.moe.MoE forward and forward+backward, dispatch='loop' vs 'grouped', fp32, batch 1",
        "results": results,
        "machine": machine_record(
            device_name(device), args.threads, load, "load_average_1min_at_start_and_after_each_thread_count"
        ),
        "date": today(),
        "generated_by": "python -m lib.course.bench.moe",
    }
    out = args.out or BENCHMARKS / f"moe_{device.type}.json"
    write_record(result, out)

    print(
        "| threads | setting | tokens | E | K | d_model | d_ff | pass | loop ms | grouped ms | experts alone ms "
        "| loop / grouped | loop / grouped (min) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for threads, settings in results.items():
        for name, r in settings.items():
            s, m = r["setting"], r["median_ms"]
            for p in ("forward", "forward_backward"):
                alone = m["forward_experts_only"] if p == "forward" else ""
                print(
                    f"| {threads.split('_')[1]} | {name} | {s['tokens']} | {s['num_experts']} | {s['top_k']} | "
                    f"{s['d_model']} | {s['d_ff']} | {p.replace('_', '+')} | {m[f'{p}_loop']} | {m[f'{p}_grouped']} "
                    f"| {alone} | {r['speedup_grouped_over_loop'][p]}x | {r['speedup_grouped_over_loop_of_min'][p]}x |"
                )
    print(
        f"\nMedians of {args.repeats} repeats (ms). {result['machine']['device']}, torch {result['machine']['torch']}, "
        f"load average {load}; written to {out}"
    )


if __name__ == "__main__":
    main()
