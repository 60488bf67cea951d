"""Counting a Mixture of Experts: total vs active parameters, and forward FLOPs per token.

    moe_param_counts(C, F, E, K, ...)   one expert, the router, an MoE layer (all E experts vs the
                                        router and the K a token runs through), and, given n_head
                                        and vocab_size, the Mixtral-style decoder around L layers
    MIXTRAL_8X7B                        mistralai/Mixtral-8x7B-v0.1's published config, to pass as
                                        moe_param_counts(**MIXTRAL_8X7B)

The arguments are checked by lib.moe's `LAYER_SIZES` contract, as the layer's own. The layer is
lib.moe.

Glossary: C model width (d_model), F expert hidden width (d_ff), E experts, K experts per token
(top_k), L layers, V vocabulary.
"""

from __future__ import annotations

from lib.moe import LAYER_SIZES

__all__ = ["MIXTRAL_8X7B", "moe_param_counts"]


MIXTRAL_8X7B = dict(
    d_model=4096,
    d_ff=14336,
    num_experts=8,
    top_k=2,
    activation="swiglu",
    num_layers=32,
    n_head=32,
    n_kv_head=8,
    vocab_size=32000,
)  # mistralai/Mixtral-8x7B-v0.1 config.json


@LAYER_SIZES.plus(
    n_head="int >= 1 | None",
    n_kv_head="int >= 1 | None",
    vocab_size="int >= 1 | None",
    where={
        "n_head is None or (d_model % n_head == 0 and n_head % (n_kv_head or n_head) == 0)": "d_model ({d_model}) "
        "must be divisible by n_head ({n_head}), and n_head by n_kv_head ({n_kv_head or n_head})"
    },
)
def moe_param_counts(
    d_model: int,
    d_ff: int,
    num_experts: int,
    top_k: int,
    *,
    activation: str = "gelu",
    num_layers: int = 1,
    n_head: int | None = None,
    n_kv_head: int | None = None,
    vocab_size: int | None = None,
    tie_embeddings: bool = False,
) -> dict[str, int | float]:
    """Total vs active parameters, and forward FLOPs per token, of `num_layers` MoE layers (and,
    if `n_head` and `vocab_size` are given, the rest of a Mixtral-style decoder around them).

    One expert has 2·C·F parameters (3·C·F with activation="swiglu"); a layer has E experts and
    a router of C·E. A token runs through its router and K experts: active = router + K experts.
    With n_head: attention without biases, q and o C×C, k and v C×(C·n_kv_head/n_head) (grouped
    query attention), two RMSNorm vectors per layer and a final one; with vocab_size: the token
    embedding and an untied output head (V×C each). `moe_param_counts(**MIXTRAL_8X7B)` gives
    46,702,792,704 total (Hugging Face's MixtralForCausalLM counts the same) and 12.9 B active.
    FLOPs: 2 per multiply-add over the active matrices (the embedding lookup is free; attention's
    T-dependent score and mix products are left out).
    """
    C, Fh, E, K, L = d_model, d_ff, num_experts, top_k, num_layers
    expert = (3 if activation == "swiglu" else 2) * C * Fh
    router = C * E
    counts = dict(
        expert=expert, router=router, moe_layer_total=router + E * expert, moe_layer_active=router + K * expert
    )
    attention = norms = embeddings = head = 0
    if n_head is not None:
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        attention = L * (2 * C * C + 2 * C * (C // n_head) * n_kv_head)
        norms = (2 * L + 1) * C
    if vocab_size is not None:
        embeddings = vocab_size * C
        head = 0 if tie_embeddings else vocab_size * C
    counts.update(attention=attention, norms=norms, embedding_and_head=embeddings + head)
    counts["total"] = L * counts["moe_layer_total"] + attention + norms + embeddings + head
    counts["active"] = L * counts["moe_layer_active"] + attention + norms + embeddings + head
    counts["active_fraction"] = counts["active"] / counts["total"]
    output_head = 0 if vocab_size is None else vocab_size * C  # computed even when tied to the embedding
    counts["flops_per_token"] = 2 * (L * counts["moe_layer_active"] + attention + output_head)
    return counts
