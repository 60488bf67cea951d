"""Shared test setup: deterministic hypothesis, Triton's interpreter where there is no GPU."""

import os

import torch
from hypothesis import settings

# Kernels (lesson 05 on) run under the interpreter on CPU-only machines; the variable is read
# when @triton.jit runs, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Same examples on every run and machine; no per-example deadline on a loaded 2-core box.
settings.register_profile("onemask", derandomize=True, max_examples=40, deadline=None, print_blob=True)
settings.load_profile("onemask")
