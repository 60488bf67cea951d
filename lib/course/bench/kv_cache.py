"""Benchmark: greedy generation of 256 new tokens with and without the KV cache, side by side.

    python -m lib.course.bench.kv_cache                 # writes benchmarks/kv_cache_<device>.json
    python -m lib.course.bench.kv_cache --repeats 5

The model is lesson 04's small decoder (`GPTConfig.decode_bench()`, untrained: time does not
depend on the weights' values). Both paths run in the same process, alternating, `repeats` times
(lib.course.bench.timer.side_by_side); the result is the ratio of the medians, with the machine
described beside it. A record, not a test: timings depend on the machine and on whatever else
runs on it. (Records made before this module existed name its former path, tools/bench_kv_cache.py.)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from lib.course.bench import BENCHMARKS, device_name, load_average, machine_record, today, write_record
from lib.course.bench.timer import side_by_side
from lib.decode import generate
from lib.gpt import GPT, GPTConfig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = GPTConfig.decode_bench()
    model = GPT(config).to(device).eval()
    idx = torch.randint(config.vocab_size, (1, args.prompt), device=device)
    generate(model, idx, 8)  # warm-up
    load = load_average()
    seconds = side_by_side(
        {
            "cached": lambda: generate(model, idx, args.new_tokens, temperature=0.0, use_cache=True),
            "uncached": lambda: generate(model, idx, args.new_tokens, temperature=0.0, use_cache=False),
        },
        repeats=args.repeats,
        warmup=0,
    )
    load += load_average()
    median = {k: statistics.median(v) for k, v in seconds.items()}
    result = {
        "benchmark": f"greedy generation of {args.new_tokens} new tokens after a {args.prompt}-token prompt, batch 1",
        "model": {
            "config": "GPTConfig.decode_bench()",
            "n_layer": config.n_layer,
            "n_embd": config.n_embd,
            "n_head": config.n_head,
            "block_size": config.block_size,
            "parameters": model.num_parameters(),
        },
        "seconds": {k: [round(s, 4) for s in v] for k, v in seconds.items()},
        "median_seconds": {k: round(v, 4) for k, v in median.items()},
        "speedup_cached_over_uncached": round(median["uncached"] / median["cached"], 2),
        "machine": machine_record(
            device_name(device), torch.get_num_threads(), load, "load_average_1min_at_start_and_end"
        ),
        "date": today(),
        "generated_by": "python -m lib.course.bench.kv_cache",
    }
    out = args.out or BENCHMARKS / f"kv_cache_{device.type}.json"
    write_record(result, out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
