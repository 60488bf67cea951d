"""lib.hybrid: a GPT with Mamba-mixer layers decodes with mixed caches exactly as it recomputes;
the pattern alone decides the layers."""

import pytest
import tiny_models
import torch

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


def test_mixer_cache_advances_and_refuses_gaps():
    model = tiny_hybrid("MA")
    caches = model.new_caches(2, 10)
    assert isinstance(caches[0], MixerCache) and isinstance(caches[1], KVCache)
    nbytes = caches[0].nbytes
    model(torch.randint(0, 20, (2, 4)), caches=caches)
    assert caches[0].length == 4 and caches[0].nbytes == nbytes
    with pytest.raises(ValueError, match="cannot skip or rewind positions"):
        model(torch.randint(0, 20, (2, 1)), caches=caches, start=6)
    with pytest.raises(ValueError, match="caches were built for batch size 2"):
        model(torch.randint(0, 20, (3, 1)), caches=caches, start=4)


def test_bad_arguments_are_refused_with_the_reason():
    config = GPTConfig(vocab_size=20, block_size=16, n_layer=3, n_head=4, n_embd=32)
    with pytest.raises(ValueError, match="pattern must be a non-empty string"):
        HybridGPT(config, "MXA")
    with pytest.raises(ValueError, match="pattern has 2 layers but config.n_layer = 3"):
        HybridGPT(config, "MA")
    with pytest.raises(ValueError, match=r"mamba.d_model \(16\) must equal config.n_embd \(32\)"):
        HybridGPT(config, "MAM", MambaConfig(vocab_size=20, d_model=16, n_layers=1))
    with pytest.raises(TypeError, match="config must be a lib.gpt.GPTConfig"):
        HybridGPT({"n_layer": 3}, "MAM")
    model = tiny_hybrid("MA")
    with pytest.raises(ValueError, match="takes no padding"):
        model(torch.randint(0, 20, (2, 4)), attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    ones = model(torch.randint(0, 20, (2, 4)), attention_mask=torch.ones(2, 4, dtype=torch.long))
    assert ones.shape == (2, 4, 20)
    with pytest.raises(ValueError, match="max_len must be <= block_size=48"):
        model.new_caches(1, 49)
