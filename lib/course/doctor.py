"""Capability check: what this machine has, and what each lesson will do on it.

    python -m lib.course.doctor

Every lesson opens by calling `report()`, so a student knows before running anything whether
kernels will be compiled for a GPU or interpreted on the CPU, and which figures are CPU timings.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

import torch

from lib.course.hosted import MIN_TORCH, TESTED_TORCH
from lib.course.lessons import LESSONS, measured

__all__ = ["Capabilities", "capabilities", "memory_limit_gib", "report", "smollm2_status", "torch_note", "triton_mode"]


@dataclass(frozen=True)
class Capabilities:
    python: str
    torch: str
    numpy: str
    triton: str | None
    cpu_cores: int
    torch_threads: int
    cuda: str | None  # device name and compute capability, or None
    cuda_memory_gib: float | None
    mps: bool
    triton_mode: str  # "compiled", "interpreter", "unavailable"
    cpu_scan: str = "not checked"  # lib.kernels.scan_cpu.cpu_kernel_status(): lesson 06's fused C loop
    smollm2: str = "not checked"  # lib.smollm2.status(): the real pretrained decoder, installed and converted?
    memory_gib: float | None = None  # what this machine or its container lets the kernel use

    @property
    def gpu(self) -> bool:
        return self.cuda is not None


def _version(module: str) -> str | None:
    """The installed version, read from the package metadata: importing triton here would fix its
    interpreter mode before lib.kernels could choose it."""
    from importlib import metadata

    try:
        return metadata.version(module)
    except Exception:  # not installed, or broken: the report says so instead of failing
        return None


def triton_mode() -> str:
    """ "compiled" on a CUDA GPU, "interpreter" where TRITON_INTERPRET=1 runs kernels on the CPU
    (the lessons set it themselves when there is no GPU), "unavailable" without triton."""
    if _version("triton") is None:
        return "unavailable"
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "compiled"
    return "interpreter"


def torch_note(version: str) -> str:
    """How this torch relates to the tested one (2.13.0) and the supported range (2.11 or newer)."""
    release = version.split("+")[0]
    if release == TESTED_TORCH:
        return "the tested version"
    major_minor = tuple(int(part) for part in release.split(".")[:2])
    if major_minor < tuple(int(part) for part in MIN_TORCH.split(".")):
        return f"WARNING: older than {MIN_TORCH}, the oldest supported: lessons may fail; install torch {TESTED_TORCH}"
    return (
        f"WARNING: not the tested {TESTED_TORCH} (supported: {MIN_TORCH} or newer; every lesson also runs on 2.14.1): "
        "a printed number may differ slightly from the one stored in the notebook"
    )


def memory_limit_gib() -> float | None:
    """The memory this kernel may use, in GiB: a container's limit (cgroup v2 or v1) where one is
    set, else the machine's physical memory; None where neither can be read."""
    limits = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            limits.append(int(text))
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # not on every platform
        pass
    return round(min(limits) / 2**30, 1) if limits else None


def capabilities() -> Capabilities:
    cuda = mem = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cuda = f"{props.name} (compute capability {props.major}.{props.minor})"
        mem = round(props.total_memory / 2**30, 1)
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return Capabilities(
        python=platform.python_version(),
        torch=torch.__version__,
        numpy=_version("numpy") or "missing",
        triton=_version("triton"),
        cpu_cores=os.cpu_count() or 1,
        torch_threads=torch.get_num_threads(),
        cuda=cuda,
        cuda_memory_gib=mem,
        mps=mps,
        triton_mode=triton_mode(),
        cpu_scan=_cpu_scan_status(),
        smollm2=smollm2_status(),
        memory_gib=memory_limit_gib(),
    )


def _cpu_scan_status() -> str:
    """Whether lesson 06's fused C scan compiled here (the first call builds it, ~1 s, then it is cached)."""
    from lib.kernels.scan_cpu import cpu_kernel_status

    return cpu_kernel_status()


def smollm2_status() -> str:
    """Whether SmolLM2-135M-Instruct's file is installed and converted; reads no weights."""
    from lib import smollm2

    return smollm2.status()


def report(caps: Capabilities | None = None, file=None) -> Capabilities:
    """Print what this machine has and what each lesson will do here; returns the facts."""
    caps = caps or capabilities()
    out = file or sys.stdout
    gpu = f"{caps.cuda}, {caps.cuda_memory_gib} GiB" if caps.cuda else "none (CPU only)"
    triton = {
        "compiled": "kernels compile for the GPU",
        "interpreter": "kernels run in the interpreter on the CPU (TRITON_INTERPRET=1): correct but slow, small sizes",
        "unavailable": "not installed: the Triton parts of lesson 05 are skipped",
    }[caps.triton_mode]
    lines = [
        "One Mask capability check",
        f"  python {caps.python} | torch {caps.torch} | numpy {caps.numpy} | triton {caps.triton or 'missing'}",
        f"  torch {caps.torch}: {torch_note(caps.torch)}",
        f"  CPU: {caps.cpu_cores} cores, torch uses {caps.torch_threads} threads",
        f"  CUDA GPU: {gpu}",
        f"  Apple MPS: {'available (the lessons still use the CPU)' if caps.mps else 'no'}",
        f"  Triton: {triton}",
        f"  C scan loop (lesson 06): {caps.cpu_scan}",
        f"  SmolLM2-135M (lessons 01, 03, 04, 05): {caps.smollm2}",
        "  memory this kernel may use: " + (f"{caps.memory_gib} GiB" if caps.memory_gib is not None else "unknown"),
        "What each lesson does here:",
    ]
    runs = measured()
    for lesson in LESSONS:
        does = lesson.gpu if caps.gpu else lesson.cpu
        if not caps.gpu and lesson.gpu != "nothing needed":
            does += f"; a GPU adds: {lesson.gpu}"
        peak = runs.get(lesson.stem, {}).get("peak_rss_mib")
        if peak and caps.memory_gib is not None and peak / 1024 > caps.memory_gib:
            does += (
                f"; NEEDS MORE MEMORY: its kernel peaked at {peak:,} MiB when measured, "
                f"more than the {caps.memory_gib} GiB here (ask for a larger server)"
            )
        status = "" if lesson.landed() else " (not written yet)"
        lines.append(f"  {lesson.number:02d} {lesson.title}{status}: {does}")
    print("\n".join(lines), file=out)
    return caps


if __name__ == "__main__":
    report()
