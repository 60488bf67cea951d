"""One Mask's library: the real implementations every lesson imports.

One concept per module: `masks`, `attention`, `toy` (tiny worked-example inputs), `doctor`
(capability check), `course` (the lesson map), `exercises` (checks with hints). Later lessons
add `bert`, `gpt`, `kv_cache`, `kernels`, `ssm` and `moe`.
"""

__version__ = "0.1.0"
