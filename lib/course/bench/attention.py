"""Attention benchmark: naive vs PyTorch SDPA vs our Triton flash kernel, side by side.

    python -m lib.course.bench.attention                 # GPU: the full table; CPU: a scaled-down one
    python -m lib.course.bench.attention --out results.json --seq 512 2048

The shape follows the profiling table lesson 05 discusses: the attention of a decoder-sized stack
(d_model 768 = 12 heads x 64, 12 layers, batch 1), causal, fp16, at S in {512, 2048, 4096, 8192}.
For each backend: milliseconds per forward and per forward+backward over the whole stack,
achieved TFLOP/s (forward 4·B·H·S²·D per layer, halved for causal; backward counted as 2.5x the
forward, the FlashAttention papers' convention), and peak memory (torch.cuda.max_memory_allocated).
An out-of-memory error is caught and reported as "OOM". It prints a markdown table and writes a
JSON file naming the device, versions and date.

On a CPU it runs a scaled-down version (fp32, 2 layers, S in {256, 512, 1024}; naive vs SDPA vs
the chunked PyTorch attention) and says so: the Triton kernel runs there only in the
interpreter, which checks correctness, not speed, so it is left out of the timings.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from lib.attention import attention
from lib.course.bench import device_name, load_average, machine_record, today, write_record
from lib.course.bench.timer import seconds

GPU_SEQ = (512, 2048, 4096, 8192)
CPU_SEQ = (256, 512, 1024)


def attention_flops(B: int, H: int, S: int, D: int, causal: bool, backward: bool) -> float:
    """FLOPs of one attention layer: 4·B·H·S²·D forward (QKᵀ and PV), halved when causal;
    forward + backward = 3.5x the forward."""
    fwd = 4 * B * H * S * S * D / (2 if causal else 1)
    return fwd * (3.5 if backward else 1.0)


# Dense FP16/BF16 tensor-core peaks (FLOP/s, fp32 accumulate) and memory bandwidths (bytes/s), from
# the vendors' datasheets (NVIDIA H100 and H200 Tensor Core GPU datasheets, NVIDIA Ada GPU
# architecture whitepaper for the RTX 4090). Quoted, not measured here.
PUBLISHED_PEAKS = {
    "H100 SXM": {"flops": 989e12, "bandwidth": 3.35e12},
    "H200 SXM": {"flops": 989e12, "bandwidth": 4.8e12},
    "RTX 4090": {"flops": 165e12, "bandwidth": 1.008e12},
}


def published_card(device_name: str) -> str | None:
    """The PUBLISHED_PEAKS key for a device name as torch reports it ("NVIDIA H200" -> "H200 SXM",
    "NVIDIA GeForce RTX 4090" -> "RTX 4090"), matched on the card's model number; None if none."""
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str like 'NVIDIA H200', got {type(device_name).__name__}")
    words = set(device_name.replace("-", " ").split())
    for card in PUBLISHED_PEAKS:
        model = next(w for w in card.split() if any(ch.isdigit() for ch in w))  # "H100", "4090"
        if model in words:
            return card
    return None


# Forward TFLOP/s (non-causal, causal) on an H100 SXM, head dim 128, FP16, as read from the
# FlashAttention-3 repository's figure assets/flash3_fp16_fwd.png (Shah et al. 2024, arXiv
# 2407.08608). A source's claim, not measured here.
PUBLISHED_H100_FWD_TFLOPS = {
    "source": "FlashAttention-3 repo, assets/flash3_fp16_fwd.png: H100 SXM, head dim 128, forward, FP16",
    "card": "H100 SXM",
    "rows": {
        "FlashAttention-3": (648, 616),
        "FlashAttention-2": (370, 335),
        "Triton (tutorial kernel)": (395, 378),
        "standard PyTorch attention": (139, 35),
    },
}


# The attention-profiling table of the article "Transformer Architectures Compared: BERT, GPT,
# Mamba, and Mixture of Experts" (31 May 2024): a 12-layer decoder (d_model 768, 12 heads) in FP16
# on an RTX 4090 (24 GB). Milliseconds, and peak memory in MB; None where the article reports
# out of memory. The article states neither the batch size nor what one timing covers (one layer
# or all twelve, attention alone or the whole forward). A source's claim, not measured here.
PUBLISHED_RTX4090_TABLE = {
    "source": "Transformer Architectures Compared (31 May 2024), attention profiling: RTX 4090, "
    "12-layer decoder, d_model 768, 12 heads, FP16",
    "card": "RTX 4090",
    "layers": 12,
    "heads": 12,
    "head_dim": 64,
    "columns": ("naive ms", "SDPA ms", "Triton ms", "naive peak MB", "flash peak MB"),
    "rows": {
        512: (1.42, 0.38, 0.36, 312, 180),
        2048: (18.90, 1.65, 1.58, 1420, 390),
        4096: (74.20, 4.12, 3.95, 4890, 720),
        8192: (None, 12.80, 12.10, None, 1410),
    },
}


def naive_traffic(B: int, H: int, S: int, D: int, bytes_per_elem: int, causal: bool) -> dict:
    """Bytes an unfused attention moves to and from main memory, pass by pass, for one layer.

    Each eager PyTorch op reads its inputs from memory and writes its output back: QKᵀ writes the
    (S, S) scores, the causal mask reads and rewrites them, softmax reads them and writes P, and
    P·V reads P. Q, K, V are read once and O written once. Returns {pass: bytes}.
    """
    e, mat, vec = bytes_per_elem, B * H * S * S, B * H * S * D
    passes = {"QKᵀ: read Q, K; write scores": e * (2 * vec + mat)}
    if causal:
        passes["mask: read scores, write masked scores"] = e * 2 * mat
    passes["softmax: read scores, write P"] = e * 2 * mat
    passes["P·V: read P, V; write O"] = e * (mat + 2 * vec)
    return passes


def flash_traffic(B: int, H: int, S: int, D: int, bytes_per_elem: int, causal: bool, block_m: int = 64) -> float:
    """Bytes a fused (flash) forward moves to and from main memory for one layer, with no cache reuse.

    Each query-block program reads its Q block once and writes its O block and log-sum-exp once,
    and streams the K and V blocks it visits (all of them, or those on and below the diagonal when
    causal). An upper bound: programs of one head running side by side share K and V through the
    GPU's L2 cache, so the DRAM traffic of a real run is lower.
    """
    from lib.kernels.flash import visited_blocks  # pure Python: imports triton lazily, launches nothing

    e = bytes_per_elem
    tiles = visited_blocks(S, block_m, block_m, causal)  # (query block, key block) pairs per head
    kv_rows = tiles * block_m  # key rows streamed per head (a ragged last block counted whole)
    return B * H * (e * (2 * S * D + 2 * kv_rows * D) + 4 * S)  # Q in, O out, K and V streamed, fp32 LSE


def roofline_ms(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> float:
    """The least time the work can take on a machine: max(FLOPs / peak, bytes / bandwidth), in ms."""
    return 1e3 * max(flops / peak_flops, bytes_moved / bandwidth)


def _run_stack(fn, qkv, backward: bool):
    """One pass over the stack: every layer's attention, then (optionally) one backward."""
    outs = [fn(q, k, v) for q, k, v in qkv]
    if backward:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return outs


def _time(fn, qkv, backward: bool, repeats: int) -> float:
    """Median milliseconds of `repeats` passes after one warm-up pass (lib.course.bench.timer)."""

    def one_pass() -> None:
        for t in (x for layer in qkv for x in layer):
            t.grad = None
        _run_stack(fn, qkv, backward)

    return 1e3 * statistics.median(seconds(one_pass, repeats=repeats, warmup=1))


def _backends(device: torch.device, causal: bool) -> dict:
    def naive(q, k, v):
        return attention(q, k, v, causal=causal, backend="naive")

    def sdpa(q, k, v):
        if device.type == "cuda":  # force the flash backend where PyTorch has it
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    backends = {"naive": naive, "sdpa": sdpa}
    if device.type == "cuda":
        try:
            from lib.kernels import flash_attention, kernel_mode

            if kernel_mode() == "compiled":
                backends["triton (ours)"] = lambda q, k, v: flash_attention(q, k, v, causal=causal)
        except ImportError:
            pass
    else:
        backends["chunked"] = lambda q, k, v: attention(q, k, v, causal=causal, backend="chunked")
    return backends


def run(
    seqs=None,
    *,
    layers: int | None = None,
    heads: int = 12,
    head_dim: int = 64,
    batch: int = 1,
    causal: bool = True,
    dtype: torch.dtype | None = None,
    repeats: int = 3,
    device=None,
) -> dict:
    """Measure every backend at every sequence length; returns the results dict."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    seqs = tuple(seqs or (GPU_SEQ if gpu else CPU_SEQ))
    layers = layers or (12 if gpu else 2)
    dtype = dtype or (torch.float16 if gpu else torch.float32)
    load = load_average()
    rows = []
    for S in seqs:
        for name, fn in _backends(device, causal).items():
            row = {"backend": name, "seq_len": S}
            try:
                g = torch.Generator(device=device).manual_seed(S)
                qkv = [
                    tuple(
                        torch.randn(batch, heads, S, head_dim, generator=g, device=device, dtype=dtype).requires_grad_()
                        for _ in range(3)
                    )
                    for _ in range(layers)
                ]
                for backward in (False, True):
                    if gpu:
                        torch.cuda.reset_peak_memory_stats(device)
                    ms = _time(fn, qkv, backward, repeats)
                    key = "fwd_bwd" if backward else "fwd"
                    flops = layers * attention_flops(batch, heads, S, head_dim, causal, backward)
                    row[f"{key}_ms"] = round(ms, 3)
                    row[f"{key}_tflops"] = float(f"{flops / (ms / 1e3) / 1e12:.4g}")  # 4 significant digits
                    row[f"{key}_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if gpu else None
            except torch.OutOfMemoryError:
                row["error"] = "OOM"
            except RuntimeError as err:  # e.g. an SDPA backend unavailable for this dtype/device
                row["error"] = f"{type(err).__name__}: {str(err)[:120]}"
            finally:
                qkv = None
                if gpu:
                    torch.cuda.empty_cache()
            rows.append(row)
    return {
        "benchmark": f"attention of a {layers}-layer stack, {heads} heads x {head_dim}, batch {batch}, "
        f"{'causal' if causal else 'full'}, {str(dtype).replace('torch.', '')}",
        "scaled_down": not gpu,
        "note": (
            "CPU run: scaled down (fewer layers, shorter sequences, fp32); the Triton kernel is left out "
            "because the interpreter measures correctness, not speed"
        )
        if not gpu
        else "",
        "device": device_name(device),
        "triton": _triton_version(),
        "machine": machine_record(
            device_name(device), torch.get_num_threads(), load + load_average(), "load_average_1min_at_start_and_end"
        ),
        "date": today(),
        "rows": rows,
        "generated_by": "python -m lib.course.bench.attention",
    }


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def markdown(results: dict) -> str:
    """The results as a markdown table."""
    lines = [
        f"{results['benchmark']} on {results['device']} ({results['date']})",
        "",
        "| backend | S | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['seq_len']} | {r['error']} | | | | |")
            continue
        peak = r.get("fwd_bwd_peak_mib")
        lines.append(
            f"| {r['backend']} | {r['seq_len']} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.3g} | "
            f"{r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_tflops']:.3g} | {'' if peak is None else peak} |"
        )
    if results.get("note"):
        lines += ["", results["note"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = parser.parse_args(argv)
    results = run(args.seq, layers=args.layers, repeats=args.repeats)
    print(markdown(results))
    out = args.out or Path("benchmarks") / f"attention_{'cpu' if results['scaled_down'] else 'gpu'}.json"
    write_record(results, out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
