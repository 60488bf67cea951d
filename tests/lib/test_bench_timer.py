"""lib.course.bench.timer: each measurement is one call, runs are timed alternately, bad input is refused."""

import time

import pytest

from lib.course.bench.timer import seconds, side_by_side, stopwatch


def test_one_call_per_measurement_after_the_warmup():
    calls = []
    out = seconds(lambda: calls.append(1) or time.sleep(0.002), repeats=3, warmup=2)
    assert len(calls) == 5 and len(out) == 3  # two warm-up calls, then one call per measurement
    assert all(0.002 <= s < 1.0 for s in out)  # a sleep lasts at least what it was asked


def test_side_by_side_alternates_and_times_each_run_alone():
    order = []
    runs = {"fast": lambda: order.append("fast"), "slow": lambda: order.append("slow") or time.sleep(0.02)}
    out = side_by_side(runs, repeats=3, warmup=1)
    assert order == ["fast", "slow"] * 4  # one warm-up round, then three rounds, each run once in turn
    assert all(s >= 0.02 for s in out["slow"]) and max(out["fast"]) < min(
        out["slow"]
    )  # 20 ms: beyond a scheduler hiccup


def test_stopwatch_times_its_block_once_even_when_the_block_raises():
    with stopwatch() as watch:
        assert watch.seconds is None  # nothing to read until the block ends
        time.sleep(0.02)
    assert 0.02 <= watch.seconds < 1.0
    with pytest.raises(RuntimeError):
        with stopwatch() as failed:
            time.sleep(0.01)
            raise RuntimeError("the block's own error")
    assert 0.01 <= failed.seconds < 1.0
    with stopwatch() as again:  # a fresh measurement, not the sum with the last one
        pass
    assert again.seconds < 0.01


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="fn must be callable"):
        seconds(3)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        seconds(lambda: None, repeats=0)
    with pytest.raises(TypeError, match="runs must be a non-empty dict"):
        side_by_side({})
