"""One Mask's library: the real implementations every lesson imports.

One concept per module: `masks`, `attention`, `bert` (the encoder, loadable with the real
all-MiniLM-L6-v2 weights, and BERT's MLM corruption), `gpt` (the causal decoder, == HF GPT-2, and
`generate`), `sampling`, `rope`, `lora`, `kv_cache`, `corpus` (generated text), `toy` (tiny worked-example inputs), `doctor`
(capability check), `course` (the lesson map), `exercises` (checks with hints), `precision` (printing a
result at the precision it has), `training_cache` (replaying a training run made before). Later lessons
add `kernels`, `ssm` and `moe`.
"""

import os as _os

import torch as _torch

# Without a GPU the Triton kernels (lesson 05) run in Triton's interpreter. Triton decides which
# mode its own library functions (tl.max, tl.cdiv, ...) get when `triton` is first imported, so the
# variable must be set before anything imports triton: here, on the first `import lib`. An
# explicit TRITON_INTERPRET=0 is respected.
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

__version__ = "0.1.0"
