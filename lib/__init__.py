"""One Mask's library: the real implementations every lesson imports.

One concept per module: `masks`, `attention`, `bert` (the encoder, loadable with the real
all-MiniLM-L6-v2 weights, and BERT's MLM corruption), `gpt` (the causal decoder, == HF GPT-2),
`decode` (the decoder protocol and the one `generate`), `sampling`, `rope`, `lora`, `kv_cache`,
`corpus` (generated text), `toy` (tiny worked-example inputs), `doctor` (capability check),
`course` (the lesson map), `exercises` (checks with hints), `precision` (printing a result at the
precision it has), `training_cache` (replaying a training run made before). Later lessons add
`kernels`, `scan` (the selective scan), `conv` and `mamba` (the model), `moe` (the layer) and
`moe_lm` (a small MoE language model and its router experiment). `bench` holds every benchmark
(`python -m lib.bench.<name>`).
"""

# Decides how Triton runs before anything imports it (the interpreter without a GPU): lib.kernels.runtime.
from lib.kernels import runtime as _runtime  # noqa: F401

from lib._checks import debug  # noqa: E402  lib.debug(True): value scans everywhere (see lib._checks)

__version__ = "0.1.0"
