"""Benchmark: the selective scans against the per-step reference, side by side.

    python -m lib.course.bench.ssm                 # writes benchmarks/ssm_cpu.json
    python -m lib.course.bench.ssm --repeats 7 --lengths 256 2048

Sizes as the issue fixed them: batch 2, D = 64 channels, N = 16 state entries, fp32, L in
(256, 1024, 2048, 4096), torch.set_num_threads(2); then the same with 1 thread, which a busy
machine disturbs less. Inputs look like a Mamba layer's: Δ = softplus
of a normal shifted by −4 (mostly 0.005–0.1), A = −(1..N) (S4D-real), x, B, C standard normal.
For each L, the reference, the chunked PyTorch scan (`selective_scan(impl="chunked")`, default
chunk size) and, where it compiled, the fused C loop (`lib.scan.selective_scan_cpu`,
which `selective_scan` runs by default on a CPU, forward and backward) run alternately, forward only
(no_grad) and forward + backward, after one warm-up each (lib.course.bench.timer.side_by_side); the
result is the ratio of the medians. A chunk-size sweep at L = 2048 shows where `default_chunk_size` comes from.
A record, not a test: timings depend on the machine and on whatever else runs on it (the load
average is recorded beside them).

On a CUDA GPU (tools/gpu_checks.sh runs it there) it also times the fused Triton kernel
(`lib.scan.selective_scan_triton`) beside the two, at the issue's shape and at a Mamba-130m
layer's width (batch 8, D = 1536, N = 16), and writes benchmarks/ssm_cuda.json. (Records made
before this module existed name its former path, tools/bench_ssm.py.)
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from lib.course.bench import (
    BENCHMARKS,
    busy_machine,
    device_name,
    load_average,
    machine_record,
    today,
    torch_threads,
    write_record,
)
from lib.course.bench.timer import side_by_side
from lib.kernels.scan_cpu import cpu_kernel_available, cpu_kernel_status
from lib.scan import selective_scan, selective_scan_cpu, selective_scan_ref
from lib.scan_parallel import default_chunk_size

SHAPES = (2, 64, 16)  # batch, D channels, N state entries
GPU_MODEL_SHAPE = (8, 1536, 16)  # a Mamba-130m layer (d_inner = 2 x 768), batch 8: on a GPU only


def make_inputs(batch: int, L: int, D: int, N: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, L, D, generator=g)
    delta = F.softplus(torch.randn(batch, L, D, generator=g) - 4.0)
    A = -torch.arange(1, N + 1, dtype=torch.float32).repeat(D, 1)  # (D, N)
    B = torch.randn(batch, L, N, generator=g)
    C = torch.randn(batch, L, N, generator=g)
    return [t.to(device) for t in (x, delta, A, B, C)]


def call(fn, inputs, backward: bool):
    """One call of fn on inputs, forward only (no_grad) or forward + backward, as a function."""

    def once() -> None:
        if backward:
            y = fn(*[t.detach().requires_grad_() for t in inputs])
            y.backward(torch.ones_like(y))
        else:
            with torch.no_grad():
                fn(*inputs)

    return once


def cpu_scans() -> dict:
    """The scans timed on a CPU: the reference, the chunked scan and, where it compiled, the C loop."""
    scans = {"ref": selective_scan_ref, "chunked": partial(selective_scan, impl="chunked")}
    if cpu_kernel_available():
        scans["cpu"] = selective_scan_cpu
    return scans


def bench_lengths(lengths, repeats: int, device, shape=SHAPES, scans=None) -> list[dict]:
    batch, D, N = shape
    scans = scans or cpu_scans()
    rows = []
    for L in lengths:
        inputs = make_inputs(batch, L, D, N, device)
        with torch.no_grad():
            want = selective_scan_ref(*inputs)
            errs = {k: (fn(*inputs) - want).abs().max().item() for k, fn in scans.items() if k != "ref"}
        row = {
            "threads": torch.get_num_threads(),
            "batch": batch,
            "D": D,
            "N": N,
            "L": L,
            "chunk_size": default_chunk_size(L),
            "max_abs_diff_fwd": float(f"{errs['chunked']:.3g}"),
        }
        for k in ("triton", "cpu"):
            if k in errs:
                row[f"max_abs_diff_fwd_{k}"] = float(f"{errs[k]:.3g}")
        for mode, backward in (("forward", False), ("forward_backward", True)):
            seconds = side_by_side({k: call(fn, inputs, backward) for k, fn in scans.items()}, repeats=repeats)
            median = {k: statistics.median(v) for k, v in seconds.items()}
            row[mode] = {
                "seconds": {k: [round(s, 6) for s in v] for k, v in seconds.items()},
                "median_seconds": {k: round(v, 6) for k, v in median.items()},
            }
            for k in scans:
                if k != "ref":
                    row[mode][f"speedup_{k}_over_ref"] = round(median["ref"] / median[k], 2)
        rows.append(row)
        print(
            f"threads={row['threads']} shape={shape} L={L}: forward "
            + ", ".join(f"{k} {v}x" for k, v in row["forward"].items() if k.startswith("speedup"))
            + "; forward+backward "
            + ", ".join(f"{k} {v}x" for k, v in row["forward_backward"].items() if k.startswith("speedup")),
            flush=True,
        )
    return rows


def bench_chunk_sizes(chunk_sizes, repeats: int, device) -> dict[str, float]:
    batch, D, N = SHAPES
    inputs = make_inputs(batch, 2048, D, N, device)
    runs = {str(cs): call(partial(selective_scan, chunk_size=cs, impl="chunked"), inputs, False) for cs in chunk_sizes}
    return {cs: round(statistics.median(v), 5) for cs, v in side_by_side(runs, repeats=repeats).items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[2, 1],
        help="torch thread counts, each a full run (the first is the headline)",
    )
    parser.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=[8, 16, 32, 64, 128, 256],
        help="chunk sizes timed at L = 2048 (forward); none to skip",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    load = load_average()
    rows, sweep = [], {}
    shapes, scans = [SHAPES], None
    if device.type == "cuda":  # the fused kernel runs compiled only here; add a model-sized layer
        from lib.scan import selective_scan_triton

        shapes, scans = (
            [SHAPES, GPU_MODEL_SHAPE],
            {
                "ref": selective_scan_ref,
                "chunked": partial(selective_scan, impl="chunked"),
                "triton": selective_scan_triton,
            },
        )
    for threads in args.threads:
        with torch_threads(threads):
            for shape in shapes:
                rows += bench_lengths(args.lengths, args.repeats, device, shape, scans)
            if args.sweep:
                sweep[f"threads_{threads}"] = bench_chunk_sizes(args.sweep, args.repeats, device)
        load += load_average()

    timed = list(rows[0]["forward"]["median_seconds"])
    fused = {
        "cpu": "the fused C loop (lib.scan.selective_scan_cpu)",
        "triton": "the fused Triton kernel (lib.scan.selective_scan_triton)",
    }
    result = {
        "benchmark": "selective scan: per-step reference (lib.scan.selective_scan_ref) vs chunked "
        "(lib.scan.selective_scan, impl='chunked')"
        + "".join(f" vs {v}" for k, v in fused.items() if k in timed)
        + "; median seconds per call",
        "dtype": "float32",
        "lengths": args.lengths,
        "shapes_timed": [dict(zip(("batch", "D", "N"), shape)) for shape in shapes],
        "cpu_kernel": cpu_kernel_status(),
        "selective_scan_default": {
            "forward (no_grad)": "cpu" if "cpu" in timed else "chunked",
            "forward_backward": "cpu" if "cpu" in timed else "chunked",
        }
        if device.type == "cpu"
        else "chunked",
        "repeats": args.repeats,
        "results": rows,
        "chunk_size_sweep_forward_L2048_median_seconds": sweep,
        "default_chunk_size_L2048": default_chunk_size(2048),
        "machine": machine_record(
            device_name(device), args.threads, load, "load_average_1min_at_start_and_after_each_thread_count"
        ),
        "busy_machine": busy_machine(load),
        "date": today(),
        "generated_by": "python -m lib.course.bench.ssm",
        "note": "generated file: rerun python -m lib.course.bench.ssm to update it, do not edit by hand. "
        "A load average "
        "above the core count means other processes shared the CPU: multi-threaded timings then "
        "suffer most (each parallel region waits for a core).",
    }

    names = list(rows[0]["forward"]["median_seconds"])
    print(
        "\n| threads | B, D, N | L | chunk | "
        + " | ".join(f"{mode} {k} (s)" for mode in ("fwd", "fwd+bwd") for k in names)
        + " | "
        + " | ".join(f"{mode} {k}/ref" for mode in ("fwd", "fwd+bwd") for k in names if k != "ref")
        + " |"
    )
    print("|" + "---:|" * (4 + 2 * len(names) + 2 * (len(names) - 1)))
    for r in rows:
        f, b = r["forward"], r["forward_backward"]
        cells = [r["threads"], f"{r['batch']}, {r['D']}, {r['N']}", r["L"], r["chunk_size"]]
        cells += [f"{m['median_seconds'][k]:.5f}" for m in (f, b) for k in names]
        cells += [f"{m[f'speedup_{k}_over_ref']:.1f}x" for m in (f, b) for k in names if k != "ref"]
        print("| " + " | ".join(map(str, cells)) + " |")
    for key, times in sweep.items():
        print(
            f"\nchunk size sweep, L = 2048, forward median seconds ({key}):",
            ", ".join(f"{cs}: {s:.4f}" for cs, s in times.items()),
        )

    if result["busy_machine"]:
        print(
            f"\nwarning: the 1-minute load average reached {max(load):.1f} on {os.cpu_count()} cores: other "
            "processes shared the CPU, and multi-threaded timings are unreliable"
        )
    out = args.out or BENCHMARKS / f"ssm_{device.type}.json"
    write_record(result, out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
