"""One Mask's library: the real implementations every lesson imports, one concept per module.

Two layers you can see. The models, their layers and kernels are the modules right here; the
course's machinery (its claims ledger, the benchmarks, lesson 08's judging, precision printing,
the capability check, the hosted setup, the lesson map, the exercise checks, the training replay
cache) lives in `lib.course`, which nothing outside it in `lib` imports. Imports flow one way:
lib.course -> models -> layers -> kernels -> `kernels.runtime` (the one place that imports
Triton), with `_checks`, `_door` and `_replay` at the bottom; `lib` imports nothing from `widgets`
(tests/project/test_layers.py reads the graph). Importing `lib` changes one thing outside it:
without a CUDA GPU it sets TRITON_INTERPRET=1 unless the variable is set (`kernels.runtime`),
because Triton fixes its mode at its first import and torch's own modules (the FLOP counter,
torch.compile) import triton: waiting for the first kernel call would be too late.

Public functions check their arguments once, at the door: a contract declared one line per
argument (`_door`), or a check written out (`_checks`); inside lib's own loops the doors step aside,
and `lib.debug(True)` runs every check everywhere.

    the equation     masks (M as an additive matrix), attention (softmax(QKᵀ/√D + M)V, every
                     backend behind one door), rope, norms
    encoder          bert (the encoder, real all-MiniLM-L6-v2 weights, MLM corruption), bert_mlm
                     (masked-LM pretraining, the initialisation experiment)
    encoder-decoder  encdec (BERT's layer, a causal decoder and cross-attention; == HF BART)
    decoders         gpt (== Hugging Face GPT-2), llama (== HF Llama; grouped-query attention,
                     RoPE, RMSNorm, SwiGLU) and smollm2 (the real SmolLM2-135M loaded into it, with
                     quant, GGUF's Q4_1 and Q8_0 blocks), mamba (the selective SSM, the mixer) and
                     mamba_lm (the language model around it), hybrid, moe (the layer), moe_counts
                     (total vs active parameters), moe_lm (a small MoE LM, its router experiment),
                     moe_parallel (experts over processes)
    decoding         decode (the Decoder protocol, one `generate`), sampling, kv_cache,
                     paging (PagedAttention's block table), serving (the memory simulator),
                     serving_result (what a run measured), workload (the requests it serves)
    the scan         scan (contract, reference, the front doors, one `SCANS` table),
                     scan_parallel (the chunked and doubling scans around one combine),
                     lti (a time-invariant SSM as a convolution), ssd (the selective SSM as a
                     masked attention), conv (the mixer's short convolution)
    kernels          kernels.flash and kernels.flash_backward, kernels.scan (Triton),
                     kernels.scan_cpu and kernels.cpu_layers (C), kernels.matvec (a decode step's
                     products on a CPU), kernels.runtime
    training         train (the one loop, schedules, the LM recipe), tasks (synthetic tasks),
                     lora, corpus
    measuring        probes (attention sinks, previous-token and induction heads)
    toys             toy
    lib.course       bench (`python -m lib.course.bench.<name>`, one timer, machine records),
                     compare (lesson 08's models and judging), claims (the ledger), precision,
                     doctor (capability check), lessons (the lesson map), hosted, demos (the
                     gallery's small trained models), exercises (checks with hints),
                     training_cache (replaying a run made before: `@lib._replay.replayable`)
"""

# Decides how Triton runs before anything imports it (the interpreter without a GPU): lib.kernels.runtime.
from lib._checks import debug  # lib.debug(True): value scans everywhere (see lib._checks)
from lib.course import training_cache as _training_cache
from lib.kernels import runtime as _runtime  # noqa: F401

# ONEMASK_TRAINING_CACHE=dir replays training runs made before (lib.course.training_cache)
_training_cache.install()

__all__ = ["debug"]
__version__ = "0.1.0"
