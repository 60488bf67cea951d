"""Benchmark commands (`python -m lib.bench.attention`). Records, not tests: timings depend on the machine."""

import platform
from pathlib import Path

__all__ = ["cpu_name"]


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform reports: for benchmark records."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
