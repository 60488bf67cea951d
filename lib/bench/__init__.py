"""Benchmark commands (`python -m lib.bench.attention`). Records, not tests: timings depend on the machine."""
