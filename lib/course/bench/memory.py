"""Peak memory of one attention call on the CPU, measured honestly in a fresh process.

    peak_rss_mib("naive", 2048)      # MiB the call added to the process's peak resident memory
    peak_rss_table(["naive", "chunked"], [1024, 2048, 4096])   # several, one child process
    python -m lib.course.bench.memory --backend naive chunked --seq 1024 4096

PyTorch tracks peak memory on CUDA (`torch.cuda.max_memory_allocated`) but not on the CPU. The
operating system does: `getrusage(RUSAGE_SELF).ru_maxrss` is the process's peak resident set
size, a high-water mark that never goes down. So measurements run in a new Python process:
build q, k, v, run the backend once on a short sequence (loading its code and warming the
allocator), read the high-water mark, run the one call we measure, read it again. The difference
is what that call needed at its peak above everything already resident (its inputs included).
On Linux the mark can be reset (writing 5 to /proc/self/clear_refs resets VmHWM), so one child
measures a whole table; elsewhere each measurement gets its own process. Large tensors come from
`mmap` and go back to the OS when freed, so a freed buffer does not count towards a later peak.
Where `resource` does not exist (Windows) the measurement returns None.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["peak_rss_mib", "peak_rss_table"]

_ROOT = Path(__file__).resolve().parents[3]  # the repository root, so the child imports this lib


def _check(backends, seq_lens, heads, head_dim, batch, causal) -> None:
    from lib._checks import require_int
    from lib.attention import BACKENDS

    for backend in backends:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    for seq_len in seq_lens:
        require_int("seq_len", seq_len, minimum=1)
    for name, value in (("heads", heads), ("head_dim", head_dim), ("batch", batch)):
        require_int(name, value, minimum=1)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")


def _run_child(backends, seq_lens, heads, head_dim, batch, causal, timeout) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "lib.course.bench.memory",
        "--backend",
        *backends,
        "--seq",
        *map(str, seq_lens),
        "--heads",
        str(heads),
        "--head-dim",
        str(head_dim),
        "--batch",
        str(batch),
    ]
    if not causal:
        cmd.append("--full")
    # glibc raises its mmap threshold after big frees, so later buffers would reuse heap pages already
    # resident and go uncounted; a fixed threshold gives every buffer over 64 KiB its own mapping.
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
        MALLOC_MMAP_THRESHOLD_="65536",
    )
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=_ROOT, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed ({' '.join(cmd[1:])}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_rss_mib(
    backend: str,
    seq_len: int,
    *,
    heads: int = 4,
    head_dim: int = 64,
    batch: int = 1,
    causal: bool = True,
    timeout: float = 300.0,
) -> float | None:
    """MiB one `lib.attention.attention(..., backend=backend)` call at (batch, heads, seq_len, head_dim)
    float32 adds to the peak resident memory of a fresh process; None where the OS gives no measure."""
    return peak_rss_table(
        [backend], [seq_len], heads=heads, head_dim=head_dim, batch=batch, causal=causal, timeout=timeout
    )[0]["added_mib"]


def peak_rss_table(
    backends,
    seq_lens,
    *,
    heads: int = 4,
    head_dim: int = 64,
    batch: int = 1,
    causal: bool = True,
    timeout: float = 600.0,
) -> list[dict]:
    """`peak_rss_mib` for every (backend, seq_len): a list of dicts with "backend", "seq_len" and
    "added_mib" (None where the OS gives no measure). One child process on Linux, one per call elsewhere."""
    backends, seq_lens = list(backends), list(seq_lens)
    _check(backends, seq_lens, heads, head_dim, batch, causal)
    try:
        import resource  # noqa: F401  (POSIX only)
    except ImportError:
        return [{"backend": b, "seq_len": t, "added_mib": None} for b in backends for t in seq_lens]
    if _can_reset():
        return _run_child(backends, seq_lens, heads, head_dim, batch, causal, timeout)
    return [
        row for b in backends for t in seq_lens for row in _run_child([b], [t], heads, head_dim, batch, causal, timeout)
    ]


def _can_reset() -> bool:
    """Whether this OS lets a process reset its peak-memory mark (Linux's /proc/self/clear_refs)."""
    return os.access("/proc/self/clear_refs", os.W_OK) and os.path.exists("/proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the last reset) from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _max_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _measure(backends, seq_lens, heads: int, head_dim: int, batch: int, causal: bool) -> list[dict]:
    import torch

    from lib.attention import attention

    torch.set_num_threads(1)  # one thread: the same peak on every machine (threads add scratch buffers)
    resettable = _can_reset()
    if not resettable and len(backends) * len(seq_lens) > 1:
        raise RuntimeError("this OS cannot reset the peak-memory mark: measure one (backend, seq_len) per process")
    rows = []
    for backend in backends:
        for seq_len in seq_lens:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(batch, heads, seq_len, head_dim, generator=g) for _ in range(3))
            with torch.no_grad():
                attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], causal=causal, backend=backend)  # warm-up
                if resettable:
                    _reset_peak()
                    before = _rss_bytes("VmRSS")
                else:
                    before = _max_rss_bytes()
                out = attention(q, k, v, causal=causal, backend=backend)
                after = _rss_bytes("VmHWM") if resettable else _max_rss_bytes()
            assert out.shape == q.shape
            del q, k, v, out
            rows.append(
                {
                    "backend": backend,
                    "seq_len": seq_len,
                    "heads": heads,
                    "head_dim": head_dim,
                    "batch": batch,
                    "causal": causal,
                    "added_mib": round(max(after - before, 0) / 2**20, 1),
                }
            )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", nargs="+", default=["naive"])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--full", action="store_true", help="no causal mask")
    args = parser.parse_args(argv)
    print(json.dumps(_measure(args.backend, args.seq, args.heads, args.head_dim, args.batch, not args.full)))


if __name__ == "__main__":
    main()
