"""The course's benchmarks: every one is `python -m lib.course.bench.<name>` and writes a record,
benchmarks/<name>_<device>.json, with the machine described beside its numbers (`machine_record`).
Records, not tests: timings depend on the machine and on whatever else runs on it.

    attention           naive vs SDPA vs our Triton flash kernel, by sequence length (lesson 05)
    kv_cache            generation with and without the KV cache (lesson 04)
    decode              SmolLM2-135M decoding: ours against transformers', and against memory (lesson 04)
    ssm                 the selective scans against the per-step reference (lesson 06)
    selective_copying   lesson 06's two models over seeds, lengths and training lengths
    moe                 the MoE layer's two dispatches (lesson 07)
    moe_balance         the balance loss's six runs, 500 steps (lesson 07)
    compare             lesson 08's four architectures, trained and measured seed by seed
    training            tokens per second of a training step, for every model the course trains
    memory              a peak-memory measure (a helper, not a command)

Every timing goes through one timer, `lib.course.bench.timer` (torch.utils.benchmark.Timer on a CPU,
triton.testing.do_bench on a CUDA GPU).
"""

import json
import os
import platform
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "BENCHMARKS",
    "busy_machine",
    "cpu_name",
    "device_name",
    "load_average",
    "load_record",
    "machine_record",
    "today",
    "torch_threads",
    "write_record",
]

# The committed benchmark records (generated JSON files; tools/gpu_checks.sh writes the GPU ones).
BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def load_record(name: str) -> dict | None:
    """The committed record benchmarks/<name>.json (e.g. "attention_gpu"), or None if absent.

    Lessons read records through this, so a notebook finds them from any folder it runs in."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"name must be a record's file name without .json, like 'attention_gpu', got {name!r}")
    path = BENCHMARKS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_record(record: dict, path: Path, *, indent: int = 2) -> Path:
    """Write a benchmark record as JSON to `path` (its folder made if missing); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=indent) + "\n")
    return path


def today() -> str:
    """The UTC date a record was made, as YYYY-MM-DD."""
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform reports: for benchmark records."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def device_name(device) -> str:
    """What a record calls the device its work ran on: the GPU's name, or the CPU's."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def machine_record(device: str, torch_threads, load: list[float], load_key: str) -> dict:
    """A benchmark record's "machine" entry: the device, cores, torch threads, versions, platform,
    and the 1-minute load averages sampled during the run under `load_key`."""
    import torch

    return {
        "device": device,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch_threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        load_key: load,
    }


def busy_machine(load: list[float]) -> bool:
    """Whether a sampled load average exceeded the core count: other processes shared the CPU."""
    return bool(load) and max(load) > (os.cpu_count() or 1)


def load_average() -> list[float]:
    """[the 1-minute load average now] where the OS reports one (POSIX), else []: a record appends
    these samples as it goes, for `machine_record` and `busy_machine`."""
    return [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []


@contextmanager
def torch_threads(threads: int | None):
    """torch's thread count set to `threads` inside the block (None: left as it is), restored after;
    yields the count in use."""
    import torch

    from lib._checks import require_int

    if threads is not None:
        require_int("threads", threads, minimum=1)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
