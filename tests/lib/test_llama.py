"""lib.llama is Hugging Face's Llama (logits, padded batches, cached keys and values, greedy tokens
equal on tiny random configs: grouped-query, multi-query and multi-head, tied and untied heads),
its cached decode equals the uncached one, its two RoPE layouts are one model up to a row
permutation, and bad input gets clear errors. The real checkpoint is tests/lib/test_smollm2.py."""

import pytest
import torch
from refusals import assert_refuses, built, refusal_test, rows
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM
from transformers.utils import logging as hf_logging

from lib.attention import BACKENDS
from lib.decode import generate
from lib.kv_cache import kv_cache_bytes
from lib.llama import Llama, LlamaConfig
from lib.smollm2 import unpermute_rope_rows

hf_logging.set_verbosity_error()

# fp32 logits through two layers of the same matmuls in another association order (HF computes
# RMSNorm in its own way, we use lib.norms); observed below 1e-6 on these sizes.
ATOL = 1e-5


def hf_llama(seed=0, **changes):
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=48,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    cfg.update(changes)
    model = LlamaForCausalLM(HFLlamaConfig(**cfg, attn_implementation="eager")).eval()
    with torch.no_grad():  # HF starts RMSNorm weights at 1: perturb them so a missing or misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def ids(B, T, seed=1, V=101):
    return torch.randint(V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kv_heads", [8, 2, 1])  # multi-head, grouped-query, multi-query
@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_huggingface_llama(kv_heads, tied):
    hf = hf_llama(num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    ours = Llama.from_huggingface(hf)
    idx = ids(3, 37)  # T not a power of two
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["naive", "chunked", "sdpa"])
def test_every_attention_backend_gives_the_same_logits(backend):
    hf = hf_llama()
    ours = Llama.from_huggingface(hf, attention_backend=backend)
    idx = ids(2, 21)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=ATOL, rtol=0)


def test_checkpoint_names_are_huggingface_names():
    hf = hf_llama(tie_word_embeddings=False)
    assert set(Llama(LlamaConfig.from_huggingface(hf.config)).state_dict()) == set(hf.state_dict())
    tied = hf_llama()
    ours = Llama(LlamaConfig.from_huggingface(tied.config))
    assert set(tied.state_dict()) - set(ours.state_dict()) == {"lm_head.weight"}  # the head is the embedding
    assert ours.lm_head is None and ours.head_weight is ours.model.embed_tokens.weight


with torch.random.fork_rng():  # the table's checkpoint is built at import: leave the global RNG as it was
    _UNTIED = hf_llama(tie_word_embeddings=False)
    _SD = _UNTIED.state_dict()
    _TIED_SD = {k: v for k, v in _SD.items() if k != "lm_head.weight"}
# fmt: off
LOAD_CHECKPOINT_REFUSALS = [
    (  # a tied model refuses an untied head
        "state_dict",
        _SD,
        ValueError,
        "lm_head.weight differs from model.embed_tokens.weight: this checkpoint is untied; "
        "use LlamaConfig(tie_word_embeddings=False)",
    ),
    ("state_dict", {k: v for k, v in _TIED_SD.items() if k != "model.norm.weight"}, ValueError,
     "the state dict does not fit this LlamaConfig: missing keys (1): ['model.norm.weight']"),
    ("state_dict", list(_TIED_SD.items()), TypeError, "state_dict must be a dict of tensors, got list"),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message", rows(LOAD_CHECKPOINT_REFUSALS))
def test_load_checkpoint_refusals(argument, bad, error, message):
    tied = Llama(LlamaConfig.from_huggingface(_UNTIED.config.to_dict() | {"tie_word_embeddings": True}))
    assert_refuses(tied.load_checkpoint, dict(state_dict=_TIED_SD), argument, bad, error, message)


def test_left_padded_batch_matches_huggingface_and_each_prompt_alone():
    hf = hf_llama()
    ours = Llama.from_huggingface(hf)
    idx = ids(3, 12)
    keep = torch.ones(3, 12, dtype=torch.long)
    keep[0, :5] = 0  # row 0: a 7-token prompt, left-padded
    keep[2, :1] = 0
    with torch.no_grad():
        got = ours(idx, attention_mask=keep)
        theirs = hf(idx, attention_mask=keep).logits
        alone = ours(idx[:1, 5:])
    real = keep.bool()
    torch.testing.assert_close(got[real], theirs[real], atol=ATOL, rtol=0)  # padding positions' logits mean nothing
    torch.testing.assert_close(got[0, 5:], alone[0], atol=ATOL, rtol=0)  # RoPE sees offsets only


def test_cached_keys_and_values_equal_huggingface_cache():
    hf = hf_llama()
    ours = Llama.from_huggingface(hf)
    idx = ids(2, 9)
    caches = ours.new_caches(2, 16)
    with torch.no_grad():
        ours(idx, caches=caches)
        past = hf(idx, use_cache=True).past_key_values
    for i, cache in enumerate(caches):
        k, v = past.layers[i].keys, past.layers[i].values  # (B, H_kv, T, D) each, RoPE applied to keys
        assert cache.k.shape[1] == k.shape[1] == 2  # H_kv heads are cached, not H
        torch.testing.assert_close(cache.k[:, :, :9], k, atol=ATOL, rtol=0)
        torch.testing.assert_close(cache.v[:, :, :9], v, atol=ATOL, rtol=0)


def test_greedy_generation_matches_huggingface_generate():
    hf = hf_llama(seed=3)
    ours = Llama.from_huggingface(hf)
    idx = ids(1, 6, seed=4)
    with torch.no_grad():
        theirs = hf.generate(
            idx, max_new_tokens=20, do_sample=False, min_new_tokens=20, attention_mask=torch.ones_like(idx)
        )
        # the test is meaningful only where the argmax is clear of rounding: check the margins
        logits = ours(theirs[:, :-1])[0, 5:]
        top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4
    assert torch.equal(generate(ours, idx, 20, temperature=0.0), theirs)


def sharp_tiny(seed=0, **changes):
    """A tiny random Llama whose attention is peaked (q and k scaled up), so that positions and
    the cache change the logits by far more than rounding."""
    torch.manual_seed(seed)
    model = Llama(LlamaConfig.tiny(**changes)).eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.q_proj.weight.mul_(15)
            block.self_attn.k_proj.weight.mul_(15)
    return model


def test_decode_steps_give_the_logits_of_one_full_pass():
    model = sharp_tiny()
    idx = ids(2, 14, V=64)
    keep = torch.ones_like(idx)
    keep[0, :4] = 0
    caches = model.new_caches(2, 20)
    with torch.no_grad():
        full = model(idx, attention_mask=keep)
        steps = [model(idx[:, :6], caches=caches, attention_mask=keep[:, :6])]  # prefill 6 positions
        for t in range(6, 14):  # then one position at a time
            steps.append(model(idx[:, t : t + 1], caches=caches, start=t, attention_mask=keep[:, : t + 1]))
    stepped = torch.cat(steps, dim=1)
    real = keep.bool()
    torch.testing.assert_close(stepped[real], full[real], atol=ATOL, rtol=0)


def test_cached_generation_equals_uncached_with_padding_and_sampling():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny(vocab_size=50)).eval()
    idx = ids(2, 7, V=50)
    keep = torch.ones_like(idx)
    keep[1, :3] = 0
    runs = [
        generate(
            model,
            idx,
            12,
            temperature=0.8,
            top_k=10,
            attention_mask=keep,
            use_cache=cache,
            generator=torch.Generator().manual_seed(5),
        )
        for cache in (True, False)
    ]
    assert torch.equal(runs[0], runs[1])
    greedy = generate(model, idx, 12, temperature=0.0, attention_mask=keep)
    assert torch.equal(generate(model, idx[1:, 3:], 12, temperature=0.0)[0], greedy[1, 3:])


def test_interleaved_rope_with_llama_cpp_rows_is_the_same_model():
    """llama.cpp stores each head's W_q and W_k rows pair by pair; rotating adjacent pairs
    ("interleaved") on those rows computes what rotate-half computes on HF's rows."""
    hf = hf_llama()
    ours = Llama.from_huggingface(hf)
    cfg = LlamaConfig(**{**ours.config.__dict__, "rope_layout": "interleaved"})
    permuted = Llama(cfg).eval()
    state = {}
    for name, w in ours.state_dict().items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.n_head if "q_proj" in name else cfg.n_kv_head
            D = w.shape[0] // heads
            # llama.cpp's converter: rows (i, i + D/2) of each head go to (2i, 2i + 1)
            w = w.reshape(heads, 2, D // 2, -1).swapaxes(1, 2).reshape(w.shape)
            assert torch.equal(unpermute_rope_rows(w, heads), ours.state_dict()[name])
        state[name] = w
    permuted.load_checkpoint(state)
    idx = ids(2, 15)
    with torch.no_grad():
        torch.testing.assert_close(permuted(idx), ours(idx), atol=ATOL, rtol=0)
        wrong = Llama(LlamaConfig(**{**cfg.__dict__, "rope_layout": "half"})).eval()
        wrong.load_checkpoint(state)  # llama.cpp's rows under HF's rotation: not the model
        assert (wrong(idx) - ours(idx)).abs().max() > 100 * ATOL


def test_weights_stored_by_columns_give_the_same_model():
    hf = hf_llama()
    ours = Llama.from_huggingface(hf)
    idx = ids(2, 11)
    with torch.no_grad():
        before = ours(idx)
        step_before = ours(idx[:, :1])
    values = {k: v.clone() for k, v in ours.state_dict().items()}
    ours.store_by_columns()
    w = ours.model.layers[0].self_attn.q_proj.weight
    assert w.t().is_contiguous() and not w.is_contiguous()
    assert all(torch.equal(values[k], v) for k, v in ours.state_dict().items())
    with torch.no_grad():
        # fp32: the decode step sums partial products over thread slices (lib.kernels.matvec)
        torch.testing.assert_close(ours(idx), before, atol=ATOL, rtol=0)
        torch.testing.assert_close(ours(idx[:, :1]), step_before, atol=ATOL, rtol=0)


def test_attention_weights_are_causal_distributions_and_change_nothing():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).eval()
    idx = ids(2, 10, V=64)
    with torch.no_grad():
        logits, attentions = model(idx, return_attentions=True)
        torch.testing.assert_close(logits, model(idx), atol=1e-6, rtol=0)
    assert len(attentions) == model.config.n_layer
    for w in attentions:
        assert w.shape == (2, model.config.n_head, 10, 10)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, model.config.n_head, 10))
        assert torch.all(w.triu(1) == 0)  # nothing from the future


def test_cache_bytes_count_the_kv_heads_and_equal_what_is_allocated():
    cfg = LlamaConfig.tiny(n_layer=3, n_head=6, n_kv_head=2, n_embd=48)
    model = Llama(cfg)
    caches = model.new_caches(2, 40)
    assert model.cache_bytes(2, 40) == sum(c.nbytes for c in caches)
    assert model.cache_bytes(2, 40) == kv_cache_bytes(3, 2, 40, 2, 8, 4)  # 2 · L · B · S · H_kv · D · 4 bytes
    assert model.cache_bytes(1, 1, "fp16") * 2 == model.cache_bytes(1, 1)


def test_loss_is_the_next_token_cross_entropy():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    idx = ids(2, 9, V=64)
    logits, loss = model(idx[:, :-1], targets=idx[:, 1:])
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.reshape(-1, 64), idx[:, 1:].reshape(-1)))
    loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


# --------------------------------------------------------------------------- bad input
# fmt: off
FORWARD_REFUSALS = [  # forward's door is in test_decoder_door.py; Llama adds these
    (
        "idx",
        torch.zeros(1, 9, dtype=torch.long),
        ValueError,
        "the caches hold 8 positions; idx at 0..8 would overflow them (new_caches(batch_size, max_len) with a "
        "larger max_len)",
    ),
    ("start", 2, ValueError, "start must be <= the cache length 0 (no gaps), got 2"),
    ("targets, return_attentions", (torch.zeros(1, 2, dtype=torch.long), True), ValueError,
     "return_attentions and targets go in separate calls, got return_attentions=True"),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message", rows(FORWARD_REFUSALS))
def test_forward_refusals(argument, bad, error, message):
    model = Llama(LlamaConfig.tiny(block_size=16)).eval()
    good = dict(idx=torch.zeros(1, 2, dtype=torch.long), caches=model.new_caches(1, 8))
    assert_refuses(model, good, argument, bad, error, message)


@pytest.mark.parametrize(
    "argument, bad, error, message",
    rows(
        [
            ("max_len", 17, ValueError, "max_len must be <= block_size=16, got 17"),
            ("max_len", 0, ValueError, "max_len must be >= 1, got 0"),
            ("batch_size", 0, ValueError, "batch_size must be >= 1, got 0"),
            ("batch_size", 1.0, TypeError, "batch_size must be an int, got float"),
        ]
    ),
)
def test_new_caches_refusals(argument, bad, error, message):
    model = Llama(LlamaConfig.tiny(block_size=16))
    assert_refuses(model.new_caches, dict(batch_size=1, max_len=8), argument, bad, error, message)


@pytest.mark.parametrize(
    "argument, bad, error, message",
    rows(
        [
            (
                "max_new_tokens",
                7,
                ValueError,
                "idx has T=10 tokens; with max_new_tokens=7 that passes the context block_size=16",
            ),
            (
                "idx",
                torch.zeros(1, 17, dtype=torch.long),
                ValueError,
                "idx has T=17 tokens; with max_new_tokens=6 that passes the context block_size=16",
            ),
        ]
    ),
)
def test_generate_refusals(argument, bad, error, message):  # generate's own table is in test_gpt.py
    model = Llama(LlamaConfig.tiny(block_size=16)).eval()
    good = dict(model=model, idx=torch.zeros(1, 10, dtype=torch.long), max_new_tokens=6)
    assert_refuses(generate, good, argument, bad, error, message)


# fmt: off
LLAMA_CONFIG_REFUSALS = [
    ("n_head, n_kv_head, n_embd", (6, 4, 48), ValueError,
     "n_head (6) must be a multiple of n_kv_head (4): each key/value head serves n_head / n_kv_head query heads"),
    ("rope_layout", "complex", ValueError, "rope_layout must be one of ('half', 'interleaved'), got 'complex'"),
    ("n_head, n_kv_head, n_embd", (4, 2, 36), ValueError,
     "RoPE rotates pairs of dimensions: the head dim n_embd / n_head = 9 must be even"),
    ("n_embd", 30, ValueError, "n_embd (30) must be divisible by n_head (4)"),
    ("attention_backend", "magic", ValueError,
     f"attention_backend must be 'auto' or one of {sorted(BACKENDS)}, got 'magic'"),
    ("n_kv_head", 0, ValueError, "n_kv_head must be >= 1, got 0"),
]
# fmt: on
test_llama_config_refusals = refusal_test(LlamaConfig, built(lambda: vars(LlamaConfig.tiny())), LLAMA_CONFIG_REFUSALS)


@pytest.mark.parametrize(
    "argument, bad, error, message",
    rows(
        [
            ("config", {"n_layer": 2}, TypeError, "config must be a LlamaConfig, got dict"),
            ("config", None, TypeError, "config must be a LlamaConfig, got NoneType"),
        ]
    ),
)
def test_llama_refusals(argument, bad, error, message):
    assert_refuses(Llama, dict(config=LlamaConfig.tiny()), argument, bad, error, message)


def config_from_huggingface(**changes):
    """LlamaConfig.from_huggingface on hf_llama()'s config dict with `changes` made to its fields."""
    return LlamaConfig.from_huggingface(hf_llama().config.to_dict() | changes)


@pytest.mark.parametrize(
    "argument, bad, error, message",
    rows(
        [
            (
                "rope_scaling",
                {"rope_type": "linear", "factor": 2.0},
                ValueError,
                "rope_scaling {'rope_type': 'linear', 'factor': 2.0} is not implemented here (plain RoPE only)",
            ),
            ("hidden_act", "gelu", ValueError, "only hidden_act='silu' (SwiGLU) is implemented, got 'gelu'"),
            ("attention_bias", True, ValueError, "attention_bias=True is not implemented here"),
            ("mlp_bias", True, ValueError, "mlp_bias=True is not implemented here"),
            (
                "head_dim",
                16,
                ValueError,
                "head_dim=16 with 8 heads is not hidden_size=64: only head_dim = hidden_size / num_attention_heads "
                "is implemented",
            ),
        ]
    ),
)
def test_config_from_huggingface_refusals(argument, bad, error, message):
    assert_refuses(config_from_huggingface, {}, argument, bad, error, message)
