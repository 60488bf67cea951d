"""lib.gpt is GPT-2 (logits equal Hugging Face's), its mask keeps the future out, its two attention
paths agree, its cached generation equals the uncached one, and bad input gets clear errors."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

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
    with pytest.raises(ValueError, match="missing keys"):
        ours.load_checkpoint({k: v for k, v in body.items() if k != "wte.weight"})


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


def test_unsupported_huggingface_options_are_refused():
    for changes in (
        dict(scale_attn_weights=False),
        dict(scale_attn_by_inverse_layer_idx=True),
        dict(activation_function="relu"),
        dict(n_inner=100),
    ):
        with pytest.raises(ValueError):
            GPT.from_huggingface(hf_gpt2(**changes))


def test_from_huggingface_keeps_dtype():
    hf = hf_gpt2().to(torch.bfloat16)
    ours = GPT.from_huggingface(hf)
    assert ours.transformer.wte.weight.dtype == torch.bfloat16 and ours.lm_head.weight is ours.transformer.wte.weight


def test_misfit_checkpoint_is_reported():
    hf = hf_gpt2()
    model = GPT(GPTConfig.tiny(vocab_size=101, n_layer=3, n_embd=64, block_size=40))
    with pytest.raises(ValueError, match="missing keys.*h.2"):
        model.load_checkpoint(hf.state_dict())
    sd = dict(hf.state_dict())
    sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"][:10]
    with pytest.raises(ValueError, match="shape mismatches"):
        GPT(GPTConfig.from_huggingface(hf.config)).load_checkpoint(sd)
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        GPT.from_huggingface("gpt2")


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
    with pytest.raises(ValueError, match="seq_len"):
        get_batch(torch.arange(5), 2, 5)


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


def test_bad_generate_input_is_refused_clearly():
    model = GPT(GPTConfig.tiny(block_size=16))
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="block_size"):
        generate(model, torch.zeros(1, 17, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="block_size"):
        generate(model, idx, 13)
    with pytest.raises(TypeError, match="idx must be an int64"):
        generate(model, idx.float(), 2)
    with pytest.raises(ValueError, match=r"idx must have shape \(B, T\)"):
        generate(model, idx[0], 2)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, idx, 2, temperature=-0.5)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, idx, 2, top_k=0)
    with pytest.raises(TypeError, match="top_k"):
        generate(model, idx, 2, top_k=2.5)
    for p in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            generate(model, idx, 2, top_p=p)
    with pytest.raises(ValueError, match="vocab_size"):
        generate(model, torch.full((1, 3), 64), 2)
    with pytest.raises(TypeError, match="generator"):
        generate(model, idx, 2, generator=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, idx, -1)


def test_cached_generation_needs_a_causal_model():
    model = GPT(GPTConfig.tiny(causal=False))
    idx = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="causal"):
        generate(model, idx, 2)
    assert generate(model, idx, 2, use_cache=False).shape == (1, 5)


def test_bad_config_is_refused_clearly():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="positions"):
        GPTConfig(positions="alibi")
    with pytest.raises(ValueError, match="even"):
        GPTConfig(n_embd=12, n_head=4, positions="rope")
    with pytest.raises(ValueError, match="attention_backend"):
        GPTConfig(attention_backend="magic")


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


def test_bad_attention_masks_are_refused_clearly():
    model = GPT(GPTConfig.tiny())
    idx = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, idx, 2, attention_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"shape \(B, start \+ T\)"):
        generate(model, idx, 2, attention_mask=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="only 1"):
        generate(model, idx, 2, attention_mask=torch.full((2, 4), 2))
    with pytest.raises(ValueError, match="at least one real token"):
        generate(model, idx, 2, attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))


def test_on_token_sees_every_new_token_in_order():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    idx = torch.zeros(2, 3, dtype=torch.long)
    seen = []
    out = generate(model, idx, 6, temperature=0.0, on_token=lambda step, tok: seen.append((step, tok.clone())))
    assert [s for s, _ in seen] == list(range(6))
    assert torch.equal(torch.stack([t for _, t in seen], dim=1), out[:, 3:])
    with pytest.raises(TypeError, match="on_token"):
        generate(model, idx, 2, on_token=5)


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
