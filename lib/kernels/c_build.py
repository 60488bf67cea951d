"""Building the course's C kernels: compile, cache, load, self-check (lib.kernels.scan_cpu's loops).

A C kernel here is one source file beside its launcher module, compiled on first use with the
machine's C compiler (`$CC`, else cc, gcc or clang) into a shared library cached under
~/.cache/onemask (or $ONEMASK_CACHE), keyed by the source, the compiler and the flags, loaded
with ctypes, and kept only if it passes the launcher's self-check. Flags are tried best first:
with gcc on x86-64 Linux and an AVX2 CPU, glibc's vector exp and log (libmvec); with PyTorch's
GNU OpenMP, OpenMP threads; each option that fails to compile, load or self-check falls back to
the next, and where none works the reason is kept for the launcher to report.

    build              the best library that compiles and passes its check, or why none did
    compile, load      one attempt: the cached shared library for some flags, its entry points typed
    compiler, compiler_version, wants_vector_exp, torch_uses_gomp   what the machine offers

This module knows nothing of what the kernels compute; lib.kernels.scan_cpu holds the launchers.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

__all__ = [
    "BASE_FLAGS",
    "Build",
    "OPENMP_FLAGS",
    "VECTOR_EXP_FLAGS",
    "build",
    "compile",
    "compiler",
    "compiler_version",
    "load",
    "torch_uses_gomp",
    "wants_vector_exp",
]

BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd")
VECTOR_EXP_FLAGS = ("-mavx2", "-mfma", "-DONEMASK_LIBMVEC")  # gcc, x86-64 Linux, an AVX2 CPU: glibc's vector exp
OPENMP_FLAGS = ("-fopenmp",)  # threads from PyTorch's own OpenMP pool; else the launcher uses Python threads


def compiler() -> str | None:
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def compiler_version(cc: str) -> str:
    """What `cc --version` prints (all of it; "" if it fails)."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def wants_vector_exp(version: str) -> bool:
    """glibc's libmvec has AVX2 expf/exp on x86-64 Linux; gcc calls them from the simd loop.
    (gcc installed as `cc` names itself "cc" but keeps the FSF's copyright line.)"""
    text = version.lower()
    is_gcc = ("gcc" in text or "free software foundation" in text) and "clang" not in text
    return (
        sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64") and is_gcc and cpu_has_avx2_fma()
    )


def cpu_has_avx2_fma() -> bool:
    """The CPU itself runs AVX2 and FMA instructions (its flags in /proc/cpuinfo). Not ATen's
    capability, which ATEN_CPU_CAPABILITY lowers on purpose (the course's perturbed test runs) while
    the CPU, and this loop's code, stay the same; where cpuinfo is unreadable, ATen's detection."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cache_dir() -> Path:
    chosen = os.environ.get("ONEMASK_CACHE")
    base = Path(chosen) if chosen else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onemask"
    for candidate in (base, Path(tempfile.gettempdir()) / f"onemask-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise OSError(f"no writable cache directory (tried {base} and the temporary directory)")


def compile(source_file: Path, cc: str, version: str, flags: tuple[str, ...]) -> Path:
    """The shared library of `source_file` for these flags: from the cache, or compiled into it
    (atomically). The cache key covers the source, the compiler and its version, the flags and
    the platform."""
    source = source_file.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                cc.encode(),
                version.encode(),
                " ".join(flags).encode(),
                platform.machine().encode(),
                sys.platform.encode(),
            ]
        )
    ).hexdigest()[:16]
    target = cache_dir() / f"{source_file.stem}-{key}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        out = subprocess.run(
            [cc, *flags, str(source_file), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120
        )
        if out.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed: {(out.stderr or out.stdout).strip()[-400:]}")
        os.replace(tmp, target)  # atomic: a concurrent build writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def torch_uses_gomp() -> bool:
    """PyTorch parallelises with GNU OpenMP (libgomp.so.1, which an -fopenmp library from gcc shares)."""
    return "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux")


def load(path: Path, entry_points: dict[str, tuple[int, tuple]]):
    """The library at `path`, each entry point typed: name -> (how many pointers, the sizes' C
    types), for `onemask_<name>_f32` and `_f64` (range form: pointers, sizes, begin, end) and, where
    built with OpenMP, their `_omp` forms (pointers, sizes, total, threads)."""
    library = ctypes.CDLL(str(path))  # ctypes.CDLL releases the GIL during calls: threads run in parallel
    for kernel, (pointers, sizes) in entry_points.items():
        for suffix in ("f32", "f64"):
            name = f"onemask_{kernel}_{suffix}"
            for fn_name in (name, name + "_omp"):
                if fn_name.endswith("_omp") and not hasattr(library, fn_name):
                    continue  # built without OpenMP
                fn = getattr(library, fn_name)
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p] * pointers + list(sizes) + [ctypes.c_int64, ctypes.c_int64]
    return library


@dataclass(frozen=True)
class Build:
    """The outcome of `build`: the loaded library (None if none worked), its flags, and a status,
    "compiled: <compiler>, <-O level>, <exp>, <threads>" or "unavailable: <why>"."""

    library: object | None
    flags: tuple[str, ...]
    status: str

    @property
    def vector_exp(self) -> bool:
        """Built with vector exponentials (glibc libmvec)."""
        return "-DONEMASK_LIBMVEC" in self.flags


def build(
    source_file: Path,
    entry_points: dict,
    self_check: Callable[[object], str | None],
    *,
    switch: str = "ONEMASK_CPU_KERNEL",
    fallback: str = "",
) -> Build:
    """The best library of `source_file` this machine builds: flags tried best first, each kept
    only if `self_check(library)` returns None (else its complaint). The environment variable
    `switch`=0 turns the build off. `fallback` ("; ... is used instead") ends an unavailable status."""
    if os.environ.get(switch, "1") == "0":
        return Build(None, (), f"unavailable: switched off ({switch}=0)")
    cc = compiler()
    if cc is None:
        why = (
            "no C compiler found (set CC, or install gcc or clang)"
            if os.environ.get("CC") is None
            else f"CC={os.environ['CC']!r} is not an executable"
        )
        return Build(None, (), f"unavailable: {why}{fallback}")
    version = compiler_version(cc)
    vector_options = [VECTOR_EXP_FLAGS, ()] if wants_vector_exp(version) else [()]
    attempts = [
        BASE_FLAGS + v + o for v in vector_options for o in ((OPENMP_FLAGS, ()) if torch_uses_gomp() else ((),))
    ]
    problems = []
    for flags in attempts:
        try:
            library = load(compile(source_file, cc, version, flags), entry_points)
            problem = self_check(library)
        except Exception as err:  # any failure to build, load or run it means: not here (the reason is kept)
            problem = f"{type(err).__name__}: {err}"
        if problem is None:
            vector = "vector exp (glibc libmvec, AVX2)" if "-DONEMASK_LIBMVEC" in flags else "scalar exp"
            threads = "PyTorch's OpenMP threads" if "-fopenmp" in flags else "Python threads"
            name = version.splitlines()[0] if version else Path(cc).name
            level = " ".join(f for f in flags if f.startswith("-O"))
            return Build(library, flags, f"compiled: {name}, {level}, {vector}, {threads}")
        problems.append(problem)
    return Build(None, (), "unavailable: " + "; then ".join(problems) + fallback)
