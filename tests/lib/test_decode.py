"""lib.decode: one generate drives every course decoder (GPT, MoE GPT, Mamba, hybrid) through
the same protocol, cached exactly as recomputed; decode_state_bytes is the bytes the layers'
caches really allocate."""

import pytest
import tiny_models
import torch
from refusals import built, refusal_test

from lib.course.precision import default_dtype
from lib.decode import Decoder, decode_state_bytes, generate
from lib.gpt import GPT, GPTConfig
from lib.kv_cache import KVCache
from lib.mamba import MambaConfig
from lib.mamba_lm import MambaLM, state_bytes
from lib.moe_lm import moe_gpt

tiny_hybrid = tiny_models.hybrid


def decoders() -> dict:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=20, block_size=48, n_layer=2, n_head=4, n_embd=32)
    return {
        "GPT": GPT(config),
        "MoE GPT": moe_gpt(config, num_experts=4, top_k=2),
        "hybrid": tiny_hybrid(),
        "Mamba": MambaLM(MambaConfig(vocab_size=20, d_model=32, n_layers=3, d_state=8)),
    }


def held_bytes(caches) -> int:
    """Counted from the tensors themselves (a KV cache's k and v), not from any formula."""
    return sum(
        c.k.numel() * c.k.element_size() * 2 if isinstance(c, KVCache) else c.conv.nbytes + c.ssm.nbytes for c in caches
    )


@pytest.mark.parametrize("name", ["GPT", "MoE GPT", "hybrid", "Mamba"])
def test_one_generate_decodes_every_model_as_it_recomputes(name):
    model = decoders()[name].eval()
    assert isinstance(model, Decoder)
    idx = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(1))
    greedy = generate(model, idx, 10, temperature=0, use_cache=True)
    assert torch.equal(greedy, generate(model, idx, 10, temperature=0, use_cache=False))
    seq = idx
    with torch.no_grad():  # greedy is the argmax of the plain forward, token by token
        for _ in range(10):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, seq)
    knobs = dict(temperature=0.8, top_k=8, top_p=0.9)
    a = generate(model, idx, 10, generator=torch.Generator().manual_seed(3), **knobs)
    b = generate(model, idx, 10, generator=torch.Generator().manual_seed(3), use_cache=False, **knobs)
    assert torch.equal(a, b) and a.shape == (2, 16)


@pytest.mark.parametrize("name", ["GPT", "hybrid", "Mamba"])
def test_cached_generate_feeds_the_prompt_once_then_one_token_per_step(name):
    """What a cache is for: after the prefill, each step hands the model the newest token alone,
    at the next position, with the same caches (a loop that recomputes the prefix each step gives
    the same tokens, so the equality above cannot see it)."""
    model = decoders()[name].eval()
    calls = []
    forward = model.forward

    def recording(idx, *args, **kwargs):
        calls.append((idx.shape[1], kwargs.get("start", 0), id(kwargs.get("caches"))))
        return forward(idx, *args, **kwargs)

    model.forward = recording
    idx = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(1))
    generate(model, idx, 5, temperature=0, use_cache=True)
    assert [(n, start) for n, start, _ in calls] == [(6, 0)] + [(1, 6 + i) for i in range(4)]
    assert len({cache for *_, cache in calls}) == 1  # the same caches every step


def test_a_lora_wrapped_gpt_still_decodes_with_its_caches():
    """LoRA replaces the attention's projections (no `.weight` on them): the caches take the
    model's dtype and device, not a projection's."""
    from lib.lora import add_lora

    model = decoders()["GPT"].eval()
    idx = torch.randint(0, 20, (2, 4), generator=torch.Generator().manual_seed(2))
    before = generate(model, idx, 6, temperature=0)
    add_lora(model, ("c_attn", "c_proj"), r=2)  # B starts at zero: the same function
    assert torch.equal(generate(model, idx, 6, temperature=0), before)


def test_generate_refuses_what_is_not_a_decoder_and_what_a_model_cannot_do():
    with pytest.raises(TypeError, match="model must be a decoder"):
        generate(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="takes no padding"):
        generate(
            decoders()["Mamba"],
            torch.zeros(2, 3, dtype=torch.long),
            2,
            attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        )
    mamba = decoders()["Mamba"]  # no context limit: far past any GPT's block_size
    assert generate(mamba, torch.zeros(1, 60, dtype=torch.long), 2).shape == (1, 62)


@pytest.mark.parametrize("batch,seq_len", [(1, 1), (2, 17), (3, 40)])
def test_decode_state_bytes_is_what_the_caches_allocate(batch, seq_len):
    models = decoders()
    hybrid, gpt, moe, mamba = (models[k] for k in ("hybrid", "GPT", "MoE GPT", "Mamba"))
    for model in (hybrid, gpt, moe):
        caches = model.new_caches(batch, seq_len)
        assert decode_state_bytes(model, batch, seq_len) == held_bytes(caches)
    assert decode_state_bytes(mamba, batch, seq_len) == held_bytes(mamba.new_caches(batch))
    # the Mamba state does not grow with the context; the attention layers' caches do, linearly
    assert decode_state_bytes(mamba, batch, 1) == decode_state_bytes(mamba, batch, 40)
    grow = [decode_state_bytes(hybrid, batch, s) for s in (10, 20, 30)]
    assert grow[1] - grow[0] == grow[2] - grow[1] > 0
    assert decode_state_bytes(hybrid, batch, 40, "fp16") * 2 == decode_state_bytes(hybrid, batch, 40, torch.float32)


def test_decode_state_bytes_counts_a_float64_model_in_float64():
    """The lessons train in float64: by default the bytes are those its caches really allocate."""
    with default_dtype(torch.float64):
        hybrid = tiny_hybrid("MAM")
        gpt = GPT(GPTConfig(vocab_size=20, block_size=48, n_layer=2, n_head=4, n_embd=32))
        mamba = MambaLM(MambaConfig(vocab_size=20, d_model=32, n_layers=3, d_state=8))
    for model in (hybrid, gpt):
        assert decode_state_bytes(model, 2, 17) == held_bytes(model.new_caches(2, 17))
        assert decode_state_bytes(model, 2, 17) == 2 * decode_state_bytes(model, 2, 17, torch.float32)
    assert decode_state_bytes(mamba, 2, 17) == held_bytes(mamba.new_caches(2)) == state_bytes(mamba, 2)
    assert state_bytes(mamba.config, 2) == state_bytes(mamba, 2) // 2  # a config has no dtype: float32


_DECODER = (
    "model must be a decoder (an nn.Module with vocab_size, block_size, new_caches and cache_bytes, whose forward "
    "takes caches and start): lib.gpt.GPT, lib.llama.Llama, lib.moe_lm.moe_gpt, lib.mamba_lm.MambaLM or "
    "lib.hybrid.HybridGPT; got Linear"
)
# fmt: off
DECODE_STATE_BYTES_REFUSALS = [
    ("model", built(lambda: torch.nn.Linear(2, 2)), TypeError, _DECODER),
    ("seq_len", 0, ValueError, "seq_len must be >= 1, got 0"),
    ("batch", 1.0, TypeError, "batch must be an int, got float"),
    ("dtype", "fp64", ValueError,
     "dtype must be a torch.dtype or one of ['fp32', 'fp16', 'bf16', 'fp8', 'int4'], got 'fp64'"),
]
# fmt: on
test_decode_state_bytes_refusals = refusal_test(
    decode_state_bytes,
    built(lambda: dict(model=tiny_hybrid("MA"), batch=1, seq_len=4, dtype=None)),
    DECODE_STATE_BYTES_REFUSALS,
)
