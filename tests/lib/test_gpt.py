"""lib.gpt is GPT-2 (logits equal Hugging Face's), its mask keeps the future out, its two attention
paths agree, its cached generation equals the uncached one, and bad input gets clear errors."""

import pytest
import torch
from refusals import assert_refuses, built, refusal_test, rows
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

from lib.attention import BACKENDS
from lib.decode import generate
from lib.gpt import GPT, Block, GPTConfig
from lib.train import evaluate_loss, get_batch, train_lm

hf_logging.set_verbosity_error()  # a tiny vocabulary makes HF warn that GPT-2's bos/eos ids are out of range


def hf_gpt2(seed=0, **changes):
    torch.manual_seed(seed)
    cfg = dict(
        n_layer=2,
        n_head=4,
        n_embd=64,
        vocab_size=101,
        n_positions=40,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg.update(changes)
    model = GPT2LMHeadModel(GPT2Config(**cfg)).eval()
    # HF zero-initialises biases and LayerNorms: perturb them so a mixed-up bias or transpose shows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("backend", ["auto", "buffer", "naive", "chunked"])
def test_logits_match_huggingface_gpt2(backend):
    hf = hf_gpt2()
    ours = GPT.from_huggingface(hf, attention_backend=backend)
    idx = torch.randint(101, (3, 37), generator=torch.Generator().manual_seed(1))  # T not a power of two
    with torch.no_grad():
        expected = hf(idx).logits
        got = ours(idx)
    # fp32: the same matmuls and LayerNorms in a different association order; observed ~1e-6.
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_checkpoint_names_are_huggingface_names():
    hf = hf_gpt2()
    ours = GPT(GPTConfig.from_huggingface(hf.config))
    assert set(ours.state_dict()) == set(hf.state_dict())
    # Conv1D stores (in, out); nn.Linear (out, in): the loader transposes exactly these four
    w = dict(GPT.from_huggingface(hf).named_parameters())
    assert torch.equal(w["transformer.h.0.attn.c_attn.weight"], hf.transformer.h[0].attn.c_attn.weight.t())


def test_head_is_tied_to_token_embedding():
    cfg = GPTConfig.tiny()
    model = GPT(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    untied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert model.num_parameters() == untied - cfg.vocab_size * cfg.n_embd  # the (V, C) matrix counted once


def test_a_gpt2model_state_dict_loads_too():
    hf = hf_gpt2()
    body = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k.startswith("transformer.")}
    ours = GPT(GPTConfig.from_huggingface(hf.config))
    ours.load_checkpoint(body)  # no prefix, no lm_head: the head is the tied embedding
    idx = torch.randint(101, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(idx), hf(idx).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("act", ["gelu_new", "gelu", "gelu_pytorch_tanh"])
def test_activation_names_map_to_the_same_gelu(act):
    hf = hf_gpt2(activation_function=act)
    with torch.no_grad():  # pre-activations of order 1, where the tanh form and erf differ (~1e-3)
        for block in hf.transformer.h:
            block.mlp.c_fc.weight.mul_(30.0)
    ours = GPT.from_huggingface(hf)
    idx = torch.randint(101, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-5, rtol=0)


def test_from_huggingface_keeps_dtype():
    hf = hf_gpt2().to(torch.bfloat16)
    ours = GPT.from_huggingface(hf)
    assert ours.transformer.wte.weight.dtype == torch.bfloat16 and ours.lm_head.weight is ours.transformer.wte.weight


_BACKEND_NAMES = f"attention_backend must be 'buffer', 'auto' or one of {sorted(BACKENDS)}, got 'magic'"
with torch.random.fork_rng():  # the tables' models are built at import: leave the global RNG as it was
    _HF = hf_gpt2()
    _SD = _HF.state_dict()
    FROM_HUGGINGFACE_REFUSALS = [
        ("model", "gpt2", TypeError, "model must be a transformers.GPT2LMHeadModel, got str"),
        (
            "model",
            hf_gpt2(scale_attn_weights=False),
            ValueError,
            "scale_attn_weights=False (scores not divided by √D) is not implemented here",
        ),
        (
            "model",
            hf_gpt2(scale_attn_by_inverse_layer_idx=True),
            ValueError,
            "scale_attn_by_inverse_layer_idx=True is not implemented here",
        ),
        (
            "model",
            hf_gpt2(reorder_and_upcast_attn=True),
            ValueError,
            "reorder_and_upcast_attn=True is not implemented here",
        ),
        (
            "model",
            hf_gpt2(activation_function="relu"),
            ValueError,
            "activation_function must be one of ['gelu', 'gelu_new', 'gelu_pytorch_tanh'], got 'relu'",
        ),
        ("model", hf_gpt2(n_inner=100), ValueError, "only n_inner = 4 * n_embd is implemented, got 100"),
        ("n_embed", 64, TypeError, "unknown GPTConfig field 'n_embed'"),  # changes name GPTConfig fields
        ("attention_backend", "magic", ValueError, _BACKEND_NAMES),
    ]
    _BODY = {k.removeprefix("transformer."): v for k, v in _SD.items() if k.startswith("transformer.")}
    _MISFIT = "the state dict does not fit this GPTConfig:"
    LOAD_CHECKPOINT_REFUSALS = [
        (
            "model",
            GPT(GPTConfig.tiny(vocab_size=101, n_layer=3, n_embd=64, block_size=40)),
            ValueError,
            f"{_MISFIT} missing keys (12): ['transformer.h.2.attn.c_attn.bias', 'transformer.h.2.attn.c_attn.weight', "
            "'transformer.h.2.attn.c_proj.bias', 'transformer.h.2.attn.c_proj.weight', 'transformer.h.2.ln_1.bias', "
            "'transformer.h.2.ln_1.weight'] …",
        ),
        (
            "state_dict",
            {**_SD, "transformer.wpe.weight": _SD["transformer.wpe.weight"][:10]},
            ValueError,
            f"{_MISFIT} shape mismatches (1): ['transformer.wpe.weight: checkpoint (10, 64) vs model (40, 64)']",
        ),
        (  # a GPT2Model's names (no prefix, no head) without the embedding: the head is missing too
            "state_dict",
            {k: v for k, v in _BODY.items() if k != "wte.weight"},
            ValueError,
            f"{_MISFIT} missing keys (2): ['lm_head.weight', 'transformer.wte.weight']",
        ),
        (
            "state_dict",
            {**_SD, "lm_head.weight": _SD["lm_head.weight"] + 1},
            ValueError,
            "lm_head.weight differs from transformer.wte.weight: this GPT ties them",
        ),
        ("state_dict", list(_SD.items()), TypeError, "state_dict must be a dict of tensors, got list"),
    ]
    _GPT_OF_HF = GPT(GPTConfig.from_huggingface(_HF.config))


test_from_huggingface_refusals = refusal_test(GPT.from_huggingface, dict(model=_HF), FROM_HUGGINGFACE_REFUSALS)


def load_checkpoint(model, state_dict):
    model.load_checkpoint(state_dict)


test_load_checkpoint_refusals = refusal_test(
    load_checkpoint, dict(model=_GPT_OF_HF, state_dict=_SD), LOAD_CHECKPOINT_REFUSALS
)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_buffer_mask_and_sdpa_is_causal_agree(positions):
    torch.manual_seed(0)
    a = GPT(GPTConfig.tiny(positions=positions, attention_backend="buffer")).eval()
    b = GPT(GPTConfig.tiny(positions=positions, attention_backend="sdpa")).eval()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(64, (2, 45), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32: two softmax implementations over the same scores; observed < 1e-6
        torch.testing.assert_close(a(idx), b(idx), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", ["learned", "rope"])
@pytest.mark.parametrize("backend", ["buffer", "auto"])
def test_changing_a_future_token_never_changes_earlier_logits(positions, backend):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(positions=positions, attention_backend=backend)).eval()
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(64, (1, 30), generator=g)
    for t in (0, 11, 29):
        changed = idx.clone()
        changed[0, t:] = torch.randint(64, (30 - t,), generator=g)
        with torch.no_grad():
            before, after = model(idx), model(changed)
        assert torch.equal(before[:, :t], after[:, :t])  # bit-identical: the mask makes them independent
        if t < 29:
            assert not torch.allclose(before[:, t:], after[:, t:])


def test_without_the_mask_the_past_sees_the_future():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(causal=False)).eval()
    idx = torch.randint(64, (1, 20), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 64
    with torch.no_grad():
        assert not torch.allclose(model(idx)[:, 0], model(changed)[:, 0])


def test_get_batch_targets_are_inputs_shifted_by_one():
    data = torch.arange(100)
    x, y = get_batch(data, 8, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 10)
    assert torch.equal(y, x + 1)


@pytest.mark.parametrize(
    "argument, bad, error, message",
    rows(
        [
            ("data", torch.arange(5), ValueError, "data must hold more than seq_len=5 tokens, got 5"),
            (
                "data",
                torch.arange(100).reshape(10, 10),
                ValueError,
                "data must have shape (N,) a 1-D stream of token ids (1 dims), got (10, 10)",
            ),
            ("data", list(range(100)), TypeError, "data must be a torch.Tensor, got list"),
            ("batch_size", 0, ValueError, "batch_size must be >= 1, got 0"),
            ("seq_len", 0, ValueError, "seq_len must be >= 1, got 0"),
        ]
    ),
)
def test_get_batch_refusals(argument, bad, error, message):
    assert_refuses(get_batch, dict(data=torch.arange(100), batch_size=2, seq_len=5), argument, bad, error, message)


def test_training_learns_a_deterministic_sequence():
    data = torch.arange(200) % 13  # a cycle: every next token is fully determined by the current one
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(vocab_size=13, block_size=16, n_layer=2, n_embd=32))
    before = evaluate_loss(model, data, batch_size=8)
    losses = train_lm(model, data, steps=60, batch_size=16, lr=1e-2, seed=0)
    after = evaluate_loss(model, data, batch_size=8)
    assert len(losses) == 60 and not model.training
    assert before > 2.0 and after < 0.1  # ln 13 = 2.56 at chance; a learned cycle is near 0


@pytest.mark.parametrize("positions", ["learned", "rope"])
@pytest.mark.parametrize("backend", ["buffer", "auto", "chunked"])
def test_cached_generation_matches_uncached(positions, backend):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(positions=positions, attention_backend=backend, block_size=48))
    idx = torch.randint(64, (2, 7), generator=torch.Generator().manual_seed(0))
    greedy_cached = generate(model, idx, 30, temperature=0.0, use_cache=True)
    greedy_plain = generate(model, idx, 30, temperature=0.0, use_cache=False)
    assert torch.equal(greedy_cached, greedy_plain)
    assert torch.equal(greedy_cached[:, :7], idx)
    kwargs = dict(temperature=0.9, top_k=20, top_p=0.9)
    a = generate(model, idx, 30, use_cache=True, generator=torch.Generator().manual_seed(5), **kwargs)
    b = generate(model, idx, 30, use_cache=False, generator=torch.Generator().manual_seed(5), **kwargs)
    assert torch.equal(a, b)


def test_cached_logits_equal_full_forward_logits():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(positions="rope")).eval()
    idx = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(0))
    caches = model.new_caches(2, 12)
    with torch.no_grad():
        full = model(idx)
        parts = [model(idx[:, :5], caches=caches)] + [
            model(idx[:, t : t + 1], caches=caches, start=t) for t in range(5, 12)
        ]
    # fp32: one query row at a time vs all rows at once; observed ~1e-6
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    assert all(c.length == 12 for c in caches)


def test_generation_is_reproducible_with_a_seeded_generator():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    idx = torch.zeros(1, 1, dtype=torch.long)
    a = generate(model, idx, 20, generator=torch.Generator().manual_seed(1))
    b = generate(model, idx, 20, generator=torch.Generator().manual_seed(1))
    c = generate(model, idx, 20, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (1, 21)
    assert torch.equal(generate(model, idx, 0), idx)


def test_generate_restores_training_mode():
    model = GPT(GPTConfig.tiny()).train()
    generate(model, torch.zeros(1, 2, dtype=torch.long), 3)
    assert model.training


_DECODERS = "lib.gpt.GPT, lib.llama.Llama, lib.moe_lm.moe_gpt, lib.mamba_lm.MambaLM or lib.hybrid.HybridGPT; got Linear"
with torch.random.fork_rng():  # the table's models are built at import: leave the global RNG as it was
    _GENERATOR_MODEL = GPT(GPTConfig.tiny(block_size=16))
    GENERATE_REFUSALS = [
        (
            "model",
            torch.nn.Linear(2, 2),
            TypeError,
            "model must be a decoder (an nn.Module with vocab_size, block_size, new_caches and cache_bytes, whose "
            f"forward takes caches and start): {_DECODERS}",
        ),
        (
            "model",
            GPT(GPTConfig.tiny(causal=False)),
            ValueError,
            "caches need a causal model: without the mask, earlier positions' keys would change with every new "
            "token, so cached ones are stale (generate: pass use_cache=False)",
        ),
        (
            "idx",
            torch.zeros(1, 17, dtype=torch.long),
            ValueError,
            "idx has T=17 tokens; with max_new_tokens=2 that passes the context block_size=16",
        ),
        ("idx", torch.zeros(1, 4), TypeError, "idx must be an int64 (or int32) tensor, got torch.float32"),
        ("idx", torch.zeros(4, dtype=torch.long), ValueError, "idx must have shape (B, T) (2 dims), got (4,)"),
        ("idx", torch.full((1, 3), 64), ValueError, "idx must lie in [0, vocab_size=64), got min 64, max 64"),
        (
            "max_new_tokens",
            13,
            ValueError,
            "idx has T=4 tokens; with max_new_tokens=13 that passes the context block_size=16",
        ),
        ("max_new_tokens", -1, ValueError, "max_new_tokens must be >= 0, got -1"),
        ("use_cache", "yes", TypeError, "use_cache must be a bool, got str"),
        ("temperature", -0.5, ValueError, "temperature must be a finite number >= 0, got -0.5"),
        ("top_k", 0, ValueError, "top_k must be >= 1, got 0"),
        ("top_k", 2.5, TypeError, "top_k must be an int, got float"),
        ("top_p", 0.0, ValueError, "top_p must be a finite number > 0 or None, got 0.0"),
        ("top_p", 1.5, ValueError, "top_p must be in (0, 1], got 1.5"),
        ("generator", 3, TypeError, "generator must be a torch.Generator or None, got int"),
        (
            "attention_mask",
            torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
            ValueError,
            "attention_mask must be left-padded: in each row every 0 comes before every 1 (right padding would put "
            "new tokens after the padding)",
        ),
        (
            "attention_mask",
            torch.ones(2, 3, dtype=torch.long),
            ValueError,
            "attention_mask must have shape (B, T) with T = 4 as in idx, got (2, 3)",
        ),
        (
            "attention_mask",
            torch.full((2, 4), 2),
            ValueError,
            "attention_mask must hold only 1 (token) and 0 (padding), as an integer or bool tensor",
        ),
        (
            "attention_mask",
            torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]),
            ValueError,
            "attention_mask: every row needs at least one real token, at the last position",
        ),
        ("on_token", 5, TypeError, "on_token must be callable (step, tokens) -> None, got int"),
    ]


test_generate_refusals = refusal_test(
    generate,
    built(lambda: dict(model=_GENERATOR_MODEL, idx=torch.zeros(2, 4, dtype=torch.long), max_new_tokens=2)),
    GENERATE_REFUSALS,
)


def test_a_non_causal_model_generates_without_the_cache():  # with it, refused (GENERATE_REFUSALS)
    model = GPT(GPTConfig.tiny(causal=False))
    assert generate(model, torch.zeros(1, 3, dtype=torch.long), 2, use_cache=False).shape == (1, 5)


# fmt: off
GPT_CONFIG_REFUSALS = [
    ("n_embd, n_head", (30, 4), ValueError, "n_embd (30) must be divisible by n_head (4)"),
    ("positions", "alibi", ValueError, "positions must be one of ('learned', 'rope'), got 'alibi'"),
    ("n_embd, n_head, positions", (12, 4, "rope"), ValueError,
     "RoPE rotates pairs of dimensions: the head dim n_embd / n_head = 3 must be even"),
    ("attention_backend", "magic", ValueError, _BACKEND_NAMES),
    ("activation", "relu", ValueError,
     "activation must be one of ['gelu', 'gelu_new', 'gelu_pytorch_tanh'], got 'relu'"),
    ("dropout", 1.0, ValueError, "dropout must be in [0, 1), got 1.0"),
    ("n_layer", 0, ValueError, "n_layer must be >= 1, got 0"),
    ("n_head", 2.0, TypeError, "n_head must be an int, got float"),
]
# fmt: on
test_gpt_config_refusals = refusal_test(GPTConfig, {}, GPT_CONFIG_REFUSALS)


def test_blocks_take_their_parts():
    class Doubling(torch.nn.Module):
        def forward(self, x):
            return 2 * x

    cfg = GPTConfig.tiny(n_layer=2)
    model = GPT(cfg, make_block=lambda c, i: Block(c, mlp=Doubling()) if i == 1 else Block(c))
    assert isinstance(model.transformer.h[1].mlp, Doubling)
    assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 64)


@pytest.mark.parametrize("positions", ["learned", "rope"])
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("backend", ["buffer", "auto"])
def test_left_padded_batch_continues_each_prompt_as_if_alone(positions, use_cache, backend):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(positions=positions, attention_backend=backend, block_size=40)).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(64, (n,), generator=g) for n in (1, 6, 11)]  # T = 1 included
    T = max(len(p) for p in prompts)
    idx = torch.zeros(len(prompts), T, dtype=torch.long)
    keep = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        idx[b, T - len(p) :], keep[b, T - len(p) :] = p, 1
    batch = generate(model, idx, 15, temperature=0.0, use_cache=use_cache, attention_mask=keep)
    for b, p in enumerate(prompts):
        alone = generate(model, p[None], 15, temperature=0.0, use_cache=use_cache)
        assert torch.equal(batch[b, T:], alone[0, len(p) :])
    with torch.no_grad():  # and the logits at real positions agree with the unpadded run
        full = model(idx, attention_mask=keep)
        for b, p in enumerate(prompts):
            # fp32: padding changes the reduction lengths and (RoPE) the absolute angles; observed ~1e-6
            torch.testing.assert_close(full[b, T - len(p) :], model(p[None])[0], atol=1e-4, rtol=1e-4)


def test_generate_starts_every_call_from_an_empty_cache():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    idx = torch.randint(64, (2, 5), generator=torch.Generator().manual_seed(0))
    first = generate(model, idx, 10, temperature=0.0)
    assert torch.equal(generate(model, idx, 10, temperature=0.0), first)  # nothing carried over
    other = generate(model, idx.flip(0), 10, temperature=0.0)
    assert torch.equal(other.flip(0), first)


def test_on_token_sees_every_new_token_in_order():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    idx = torch.zeros(2, 3, dtype=torch.long)
    seen = []
    out = generate(model, idx, 6, temperature=0.0, on_token=lambda step, tok: seen.append((step, tok.clone())))
    assert [s for s, _ in seen] == list(range(6))
    assert torch.equal(torch.stack([t for _, t in seen], dim=1), out[:, 3:])


@pytest.mark.parametrize("T, S", [(1, 1), (9, 9), (1, 30), (4, 17)])
def test_forward_flops_counts_what_the_reference_path_multiplies(T, S):
    from torch.utils.flop_counter import FlopCounterMode

    from lib.gpt import forward_flops

    cfg = GPTConfig.tiny(n_layer=2, n_embd=32, attention_backend="naive", block_size=32)
    model = GPT(cfg).eval()
    caches = model.new_caches(1, S)
    with torch.no_grad():
        if S > T:
            model(torch.zeros(1, S - T, dtype=torch.long), caches=caches)  # fill the cache first
        with FlopCounterMode(display=False) as counter:
            model(torch.zeros(1, T, dtype=torch.long), caches=caches, start=S - T)
    assert counter.get_total_flops() == forward_flops(cfg, T, S)


@pytest.mark.parametrize("padded", [False, True])
def test_cached_generate_decodes_one_token_per_step_at_the_next_position(padded):
    """What the model is called with: with the cache, the prompt once at start 0, then exactly one
    token per new token at start T, T + 1, ... (never the prefix again); without it, the whole
    growing sequence from start 0 each time. The two give the same greedy tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=23, block_size=32, n_layer=2, n_head=2, n_embd=16))
    idx = torch.randint(23, (3, 5), generator=torch.Generator().manual_seed(1))
    mask = None
    if padded:
        mask = torch.ones(3, 5, dtype=torch.long)
        mask[1, :2] = 0  # a left-padded row
    calls = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append(
            (tuple(args[0].shape), kwargs.get("start", 0), kwargs.get("caches") is not None)
        ),
        with_kwargs=True,
    )
    try:
        cached = generate(model, idx, 6, temperature=0, attention_mask=mask)
        assert calls == [((3, 5), 0, True)] + [((3, 1), 5 + step, True) for step in range(5)]
        calls.clear()
        recomputed = generate(model, idx, 6, temperature=0, attention_mask=mask, use_cache=False)
        assert calls == [((3, 5 + step), 0, False) for step in range(6)]
    finally:
        handle.remove()
    assert torch.equal(cached, recomputed) and cached.shape == (3, 11)


@pytest.mark.parametrize("loop", ["train_lm", "train_on_task"])
def test_foreach_adamw_trains_the_same_bits_as_the_per_tensor_loop(loop, monkeypatch):
    """The training loops run AdamW's for-each implementation on a CPU too (PyTorch's default
    there is a Python loop over the tensors, slow for models of many small tensors): it must not
    change a single bit of the trained weights, so stored lesson outputs hold either way."""
    from lib.course.precision import default_dtype
    from lib.mamba import MambaConfig
    from lib.mamba_lm import MambaLM
    from lib.tasks import SelectiveCopying, train_on_task

    real = torch.optim.AdamW

    def trained(foreach):
        """(initial, trained) weights of one seeded run, with AdamW's foreach forced."""
        monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **k: real(*a, **{**k, "foreach": foreach}))
        torch.manual_seed(0)
        if loop == "train_lm":
            model = GPT(GPTConfig.tiny(vocab_size=13, block_size=16, n_layer=2, n_embd=32))
            initial = [p.detach().clone() for p in model.parameters()]
            train_lm(model, torch.arange(200) % 13, steps=8, batch_size=8, lr=1e-2, weight_decay=0.1, seed=0)
        else:
            task = SelectiveCopying(n_data=2, n_blank=5, n_symbols=4)
            with default_dtype(torch.float64):
                model = MambaLM(MambaConfig(vocab_size=task.vocab_size, d_model=16, n_layers=2))
                initial = [p.detach().clone() for p in model.parameters()]
                train_on_task(model, task, steps=8, batch_size=8, lr=1e-2, weight_decay=0.1)
        return initial, [p.detach().clone() for p in model.parameters()]

    (start, per_tensor), (_, foreach) = trained(False), trained(True)
    assert all(torch.equal(a, b) for a, b in zip(per_tensor, foreach))
    assert all(not torch.equal(a, b) for a, b in zip(start, per_tensor))  # every parameter moved
