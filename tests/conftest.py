"""Shared test setup: deterministic hypothesis, Triton's interpreter where there is no GPU."""

from hypothesis import settings

# Kernels (lesson 05 on) run under Triton's interpreter on CPU-only machines; lib.kernels.runtime
# decides it when lib is first imported, which must come before anything imports triton.
import lib  # noqa: E402, F401

# Same examples on every run and machine; no per-example deadline on a loaded 2-core box.
settings.register_profile("onemask", derandomize=True, max_examples=40, deadline=None, print_blob=True)
settings.load_profile("onemask")
