"""One Mask's library: the real implementations every lesson imports.

One concept per module: `masks`, `attention`, `bert` (the encoder, loadable with the real
all-MiniLM-L6-v2 weights, and BERT's MLM corruption), `gpt` (the causal decoder, == HF GPT-2, and
`generate`), `sampling`, `rope`, `lora`, `kv_cache`, `corpus` (generated text), `toy` (tiny worked-example inputs), `doctor`
(capability check), `course` (the lesson map), `exercises` (checks with hints). Later lessons
add `kernels`, `ssm` and `moe`.
"""

__version__ = "0.1.0"
