"""One Mask's library: the real implementations every lesson imports, one concept per module.

Imports flow one way: models -> layers -> kernels -> `kernels.runtime` (the one place that
imports Triton); `lib` imports nothing from `widgets`, and has no import cycle (a test reads the
graph). Public functions check their arguments once, at the door (`_checks`); `lib.debug(True)`
adds the value scans (NaN, id ranges, mask rows) everywhere.

    the equation     masks (M as an additive matrix), attention (softmax(QKᵀ/√D + M)V, every
                     backend behind one door), rope, norms
    encoder          bert (the encoder, real all-MiniLM-L6-v2 weights, MLM corruption)
    encoder-decoder  encdec (BERT's layer, a causal decoder and cross-attention; == HF BART)
    decoders         gpt (== Hugging Face GPT-2), llama (== HF Llama; grouped-query attention,
                     RoPE, RMSNorm, SwiGLU) and smollm2 (the real SmolLM2-135M loaded into it, with
                     quant, GGUF's Q4_1 and Q8_0 blocks), mamba (selective SSM, mixer, LM), hybrid,
                     moe (the layer) and moe_lm (a small MoE LM, its router experiment),
                     moe_parallel (experts over processes)
    decoding         decode (the Decoder protocol, one `generate`), sampling, kv_cache,
                     paging (PagedAttention's block table), serving (the memory simulator),
                     workload (the requests it serves)
    the scan         scan (contract, reference, chunked, doubling, fused, one `SCANS` table),
                     lti (a time-invariant SSM as a convolution), ssd (the selective SSM as a
                     masked attention), conv (the mixer's short convolution)
    kernels          kernels.flash, kernels.scan (Triton), kernels.scan_cpu (C), kernels.matvec
                     (a decode step's products on a CPU), kernels.runtime
    training         train (the one loop, schedules, the LM recipe), tasks (synthetic tasks),
                     lora, corpus, training_cache (replaying a run made before)
    measuring        bench (`python -m lib.bench.<name>`, one timer, machine records), probes
                     (attention sinks, previous-token and induction heads),
                     compare (lesson 08's models and judging), claims (the ledger), precision
    the course       doctor (capability check), course (the lesson map), hosted, toy,
                     exercises (checks with hints)
"""

# Decides how Triton runs before anything imports it (the interpreter without a GPU): lib.kernels.runtime.
from lib.kernels import runtime as _runtime  # noqa: F401

from lib._checks import debug  # noqa: E402  lib.debug(True): value scans everywhere (see lib._checks)

__version__ = "0.1.0"
