"""The one timer every course benchmark uses.

    seconds(fn, repeats=5, warmup=1)     seconds of each of `repeats` calls of fn(), after `warmup`
                                         calls not timed
    median_seconds(fn, repeats=5)        their median: one number for a table
    side_by_side(runs, repeats=5)        several functions timed alternately (A, B, A, B, ...), so
                                         a machine that slows down for a while slows them all
    with stopwatch() as watch: ...       one block of code, timed once (a training run):
                                         watch.seconds afterwards
    clock()                              the clock itself, in seconds: for stamping events
                                         inside a loop (each token of a generation)

Each call is timed with the clock of `torch.utils.benchmark` (`utils.timer.timer`), which first
waits for the GPU (any accelerator) to finish its queued work, so what a call launched is
counted. One call per measurement: `Timer.timeit` itself would run two warm-up calls before
every measurement, which triples a benchmark of seconds-long calls and breaks a stateful one
(a decoding step that advances its cache). `triton.testing.do_bench`, the Triton tutorials'
timer, repeats a call for ~100 ms and clears the L2 cache between calls: better for one short
kernel, too slow for a per-step reference scan at 4,096 positions within a GPU session's limit.
"""

from __future__ import annotations

import statistics
from typing import Callable

from torch.utils.benchmark.utils.timer import timer as clock  # synchronises the accelerator, then reads the clock

from lib._checks import require_int

__all__ = ["clock", "median_seconds", "seconds", "side_by_side", "stopwatch"]


def seconds(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of fn() (after `warmup` untimed calls)."""
    if not callable(fn):
        raise TypeError(f"fn must be callable with no arguments, got {type(fn).__name__}")
    require_int("repeats", repeats, minimum=1)
    require_int("warmup", warmup, minimum=0)
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = clock()
        fn()
        out.append(clock() - start)
    return out


def median_seconds(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """The median of `seconds(fn, repeats=repeats, warmup=warmup)`: one number for a table."""
    return statistics.median(seconds(fn, repeats=repeats, warmup=warmup))


def side_by_side(runs: dict[str, Callable[[], object]], *, repeats: int = 5, warmup: int = 1) -> dict[str, list[float]]:
    """Each run's seconds per call, measured alternately: `warmup` untimed rounds, then `repeats`
    rounds calling every run once in turn. Compare their medians (or minima: other jobs on a
    shared machine slow some calls, never speed one up)."""
    if not isinstance(runs, dict) or not runs or not all(callable(f) for f in runs.values()):
        raise TypeError("runs must be a non-empty dict of name -> callable with no arguments")
    require_int("repeats", repeats, minimum=1)
    require_int("warmup", warmup, minimum=0)
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    out = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            out[name] += seconds(fn, repeats=1, warmup=0)
    return out


class stopwatch:
    """Time one block, once, with the same clock:

        with stopwatch() as watch:
            train(...)
        print(f"trained in {watch.seconds:.0f} s")

    `watch.seconds` is None inside the block and the block's seconds after it (also after an
    exception, which the block still raises)."""

    def __init__(self) -> None:
        self.seconds: float | None = None
        self._start: float | None = None

    def __enter__(self) -> "stopwatch":
        self.seconds, self._start = None, clock()
        return self

    def __exit__(self, *exc) -> bool:
        self.seconds = clock() - self._start
        return False
