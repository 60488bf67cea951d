"""lib.hybrid: a GPT with Mamba-mixer layers decodes with mixed caches exactly as it recomputes;
the pattern alone decides the layers."""

import pytest
import tiny_models
import torch
from refusals import assert_refuses, refusal_test, rows

from lib.decode import generate
from lib.gpt import GPTConfig
from lib.hybrid import HybridGPT
from lib.kv_cache import KVCache
from lib.mamba import MambaConfig, MixerCache

tiny_hybrid = tiny_models.hybrid


@pytest.mark.parametrize("pattern", ["MAM", "AM", "MMMA", "M", "A"])
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_cached_decoding_equals_recomputing(pattern, positions):
    model = tiny_hybrid(pattern, positions)
    idx = torch.randint(0, 20, (3, 1 if pattern == "M" else 7))  # T = 1 too: the prompt alone is one token
    cached = generate(model, idx, 12, temperature=0, use_cache=True)
    full = generate(model, idx, 12, temperature=0, use_cache=False)
    assert torch.equal(cached, full)
    # and the logits themselves, position by position, not only the argmax
    caches = model.new_caches(3, idx.shape[1] + 4)
    seq = torch.randint(0, 20, (3, idx.shape[1] + 4))
    logits = [model(seq[:, : idx.shape[1]], caches=caches)]
    for t in range(idx.shape[1], seq.shape[1]):
        logits.append(model(seq[:, t : t + 1], caches=caches, start=t))
    # fp32, the same arithmetic in a different grouping (chunked scan vs one step): ~1e-6 measured
    torch.testing.assert_close(torch.cat(logits, 1), model(seq), atol=1e-5, rtol=1e-5)


def test_mixer_layers_keep_mamba_init_and_only_the_pattern_decides_the_layers():
    model = tiny_hybrid("MAM")
    kinds = [type(b.attn).__name__ for b in model.transformer.h]
    assert kinds == ["MambaMixer", "CausalSelfAttention", "MambaMixer"]
    dt_bias = model.transformer.h[0].attn.ssm.dt_proj.bias
    delta0 = torch.nn.functional.softplus(dt_bias.detach())  # Mamba's init: Δ log-uniform in [dt_min, dt_max]
    assert float(delta0.min()) >= 1e-3 * 0.99 and float(delta0.max()) <= 1e-1 * 1.01
    assert "pattern='MAM'" in repr(model)


def test_mixer_cache_advances():
    model = tiny_hybrid("MA")
    caches = model.new_caches(2, 10)
    assert isinstance(caches[0], MixerCache) and isinstance(caches[1], KVCache)
    nbytes = caches[0].nbytes
    model(torch.randint(0, 20, (2, 4)), caches=caches)
    assert caches[0].length == 4 and caches[0].nbytes == nbytes


# fmt: off
FORWARD_REFUSALS = [
    (  # a gap: the mixer's state cannot skip positions
        "start",
        6,
        ValueError,
        "start must equal the positions already read (4): a recurrent state cannot skip or rewind positions, got 6",
    ),
    ("idx", torch.zeros(3, 1, dtype=torch.long), ValueError,
     "caches were built for batch size 2, idx has batch size 3"),
    (
        "idx, attention_mask, caches",
        (torch.zeros(2, 4, dtype=torch.long), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), None),
        ValueError,
        (
            "a model with Mamba layers takes no padding: attention_mask must be None or all ones (a "
            "padding token would enter the recurrent state); run rows separately"
        ),
    ),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message", rows(FORWARD_REFUSALS))
def test_forward_refusals(argument, bad, error, message):
    model = tiny_hybrid("MA")
    caches = model.new_caches(2, 10)
    model(torch.randint(0, 20, (2, 4)), caches=caches)  # 4 positions read
    good = dict(idx=torch.zeros(2, 1, dtype=torch.long), caches=caches, start=4)
    assert_refuses(model, good, argument, bad, error, message)
    assert caches[0].length == 4  # a refused call leaves the state where it was


_CONFIG = GPTConfig(vocab_size=20, block_size=16, n_layer=3, n_head=4, n_embd=32)
# fmt: off
HYBRID_REFUSALS = [
    (
        "pattern",
        "MXA",
        ValueError,
        (
            "pattern must be a non-empty string of ['A', 'M'] (one letter per layer: A = attention, M "
            "= Mamba mixer), got 'MXA'"
        ),
    ),
    ("pattern", "MA", ValueError, "pattern has 2 layers but config.n_layer = 3; they must agree"),
    (
        "pattern",
        "",
        ValueError,
        (
            "pattern must be a non-empty string of ['A', 'M'] (one letter per layer: A = attention, M "
            "= Mamba mixer), got ''"
        ),
    ),
    ("mamba", MambaConfig(vocab_size=20, d_model=16, n_layers=1), ValueError,
     "mamba.d_model (16) must equal config.n_embd (32)"),
    ("mamba", {"d_model": 32}, TypeError, "mamba must be a lib.mamba.MambaConfig or None, got dict"),
    ("config", {"n_layer": 3}, TypeError, "config must be a lib.gpt.GPTConfig, got dict"),
]
# fmt: on
test_hybrid_refusals = refusal_test(HybridGPT, dict(config=_CONFIG, pattern="MAM", mamba=None), HYBRID_REFUSALS)


def test_an_all_ones_mask_is_taken_and_new_caches_refuses_a_length_past_the_block():
    model = tiny_hybrid("MA")
    ones = model(torch.randint(0, 20, (2, 4)), attention_mask=torch.ones(2, 4, dtype=torch.long))
    assert ones.shape == (2, 4, 20)
    with pytest.raises(ValueError, match="max_len must be <= block_size=48"):
        model.new_caches(1, 49)
