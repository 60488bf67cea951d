"""Benchmark: greedy generation of 256 new tokens with and without the KV cache, side by side.

    python tools/bench_kv_cache.py                 # writes benchmarks/kv_cache_<device>.json
    python tools/bench_kv_cache.py --repeats 5

The model is lesson 04's small decoder (`GPTConfig.decode_bench()`, untrained: time does not
depend on the weights' values). Both paths run in the same process, alternating, `repeats` times;
the result is the ratio of the medians, with the machine described beside it. A record, not a
test: timings depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from lib.gpt import GPT, GPTConfig, generate
from lib.bench import cpu_name

ROOT = Path(__file__).resolve().parent.parent




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = GPTConfig.decode_bench()
    model = GPT(config).to(device).eval()
    idx = torch.randint(config.vocab_size, (1, args.prompt), device=device)
    generate(model, idx, 8)  # warm-up

    def run(use_cache: bool) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        generate(model, idx, args.new_tokens, temperature=0.0, use_cache=use_cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    seconds = {"cached": [], "uncached": []}
    for _ in range(args.repeats):
        seconds["cached"].append(run(True))
        seconds["uncached"].append(run(False))
    median = {k: statistics.median(v) for k, v in seconds.items()}
    result = {
        "benchmark": f"greedy generation of {args.new_tokens} new tokens after a {args.prompt}-token prompt, batch 1",
        "model": {"config": "GPTConfig.decode_bench()", "n_layer": config.n_layer, "n_embd": config.n_embd,
                  "n_head": config.n_head, "block_size": config.block_size, "parameters": model.num_parameters()},
        "seconds": {k: [round(s, 4) for s in v] for k, v in seconds.items()},
        "median_seconds": {k: round(v, 4) for k, v in median.items()},
        "speedup_cached_over_uncached": round(median["uncached"] / median["cached"], 2),
        "machine": {"device": torch.cuda.get_device_name() if device.type == "cuda" else cpu_name(),
                    "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform()},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "generated_by": "tools/bench_kv_cache.py",
    }
    out = args.out or ROOT / "benchmarks" / f"kv_cache_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
