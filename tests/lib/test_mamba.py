"""lib.mamba and lib.mamba_lm: recurrent decoding matches the parallel forward, the state has a
constant size, the model is causal, initialised and trained as Mamba, equal to Hugging Face's
Mamba; traced states are the layer's own recurrence; bad inputs are refused clearly."""

import math

import pytest
import tiny_models
import torch
import torch.nn.functional as F
from refusals import assert_refuses, refusal_test, rows
from scan_builders import one_thread  # noqa: F401  (an autouse fixture: one thread for tiny tensors)

from lib.decode import generate
from lib.gpt import GPT, Block, GPTConfig
from lib.kv_cache import kv_cache_bytes
from lib.lti import lti_kernel, ssm_convolution
from lib.mamba import MambaConfig, MambaMixer, MixerCache, SelectiveSSM
from lib.mamba_lm import MambaLM, state_bytes, trace_states
from lib.scan import discretize
from lib.train import train_lm


def test_non_selective_layer_is_a_convolution_of_its_own_kernel():
    config = MambaConfig.tiny(d_model=8, n_layers=1, selective=False, d_state=4)
    torch.manual_seed(13)
    layer = SelectiveSSM(config).double()
    x = torch.randn(2, 30, config.d_inner, dtype=torch.float64)
    y, _ = layer(x)
    delta = F.softplus(layer.dt_bias)
    A_bar, B_bar = discretize(delta, -torch.exp(layer.A_log), layer.B)
    K = lti_kernel(A_bar, B_bar, layer.C, 30)
    torch.testing.assert_close(ssm_convolution(x, K, layer.D), y, rtol=1e-10, atol=1e-10)
    d1, _, B1, C1 = layer.ssm_params(x)
    d2, _, B2, C2 = layer.ssm_params(torch.randn_like(x))
    assert torch.equal(d1, d2) and torch.equal(B1, B2) and torch.equal(C1, C2)  # not input-dependent


tiny_model = tiny_models.mamba  # width 32, 2 layers


@pytest.mark.parametrize("changes", [{}, {"chunk_size": 4}, {"selective": False}, {"norm": "layer", "d_conv": 2}])
def test_step_by_step_decoding_matches_parallel_forward(changes):
    """Decoding one token at a time from fresh caches gives the forward's logits at every position.
    Both in fp32; they differ only in rounding order (a conv as a sum vs conv1d, the scan chunked
    vs stepped), and logits are O(1): 1e-5 absolute is ~100 ε of them."""
    model = tiny_model(**changes)
    idx = torch.randint(64, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)  # (B, T, V)
        caches = model.new_caches(2)
        for t in range(idx.shape[1]):
            logits = model(idx[:, t : t + 1], caches=caches, start=t)  # (B, 1, V): one recurrence step
            torch.testing.assert_close(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
    assert all(c.length == idx.shape[1] for c in caches)


def test_one_token_takes_the_recurrence_step_and_a_prompt_the_scan():
    """A MixerCache advances one token with the mixer's `step` (as mamba_ssm decodes) and longer
    inputs with the scan; both continue the same state."""
    model = tiny_model()
    mixer = model.layers[0].mixer
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(6))
    calls = []
    real_step = mixer.step
    mixer.step = lambda *a: calls.append("step") or real_step(*a)
    with torch.no_grad():
        cache = mixer.new_cache(2, dtype=torch.float32, device="cpu")
        prompt = mixer(x[:, :5], cache=cache, start=0)
        last = mixer(x[:, 5:], cache=cache, start=5)
        whole = mixer(x)
    assert calls == ["step"]
    torch.testing.assert_close(torch.cat([prompt, last], dim=1), whole, rtol=1e-5, atol=1e-5)


def test_prefill_in_pieces_matches_one_prefill():
    model = tiny_model()
    idx = torch.randint(64, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        one = model.new_caches(2)
        full = model(idx, caches=one)
        pieces = model.new_caches(2)
        a = model(idx[:, :2], caches=pieces)  # shorter than the conv's window: its state mixes zeros and inputs
        b = model(idx[:, 2:11], caches=pieces, start=2)
        c = model(idx[:, 11:], caches=pieces, start=11)
    torch.testing.assert_close(torch.cat([a, b, c], dim=1), full, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the same scan as with caches (selective_scan's "auto" picks by whether grad is needed)
        torch.testing.assert_close(full, model(idx), rtol=0, atol=0)
    # with gradients on, "auto" is the chunked scan: the same up to fp32 rounding (logits are O(1))
    torch.testing.assert_close(full, model(idx), rtol=1e-5, atol=1e-5)
    for u, v in zip(one, pieces):
        torch.testing.assert_close(u.conv, v.conv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(u.ssm, v.ssm, rtol=1e-5, atol=1e-5)


def test_state_size_is_constant_in_position_and_matches_state_bytes():
    model = tiny_model()
    config = model.config
    expected = state_bytes(model, 3)
    assert expected == config.n_layers * 3 * config.d_inner * (config.d_conv - 1 + config.d_state) * 4
    caches = model.new_caches(3)
    sizes = [sum(c.nbytes for c in caches)]
    with torch.no_grad():
        for t in range(40):
            model(torch.full((3, 1), t % 64), caches=caches, start=t)
            sizes.append(sum(c.nbytes for c in caches))
        long = model.new_caches(3)
        model(torch.randint(64, (3, 500)), caches=long)
    assert set(sizes) == {expected} and sum(c.nbytes for c in long) == expected == model.cache_bytes(3, 500)
    assert state_bytes(config, 3, "fp16") == expected // 2 == state_bytes(config, 3, torch.bfloat16)
    # a KV cache of the same width and depth passes it after a handful of positions, and keeps growing
    kv = [kv_cache_bytes(config.n_layers, 3, s, 1, config.d_model, 4) for s in (1, 100)]
    assert kv[1] == 100 * kv[0] > expected


def test_greedy_generate_matches_recomputing_the_forward():
    model = tiny_model()
    prompt = torch.randint(64, (2, 5), generator=torch.Generator().manual_seed(3))
    out = generate(model, prompt, 12, temperature=0.0)
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    a = generate(model, prompt, 8, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(4))
    b = generate(model, prompt, 8, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and a.shape == (2, 13)


def test_model_is_causal_and_scans_agree():
    model = tiny_model(chunk_size=4)
    idx = torch.randint(64, (1, 20), generator=torch.Generator().manual_seed(5))
    changed = idx.clone()
    changed[0, 12] = (idx[0, 12] + 1) % 64
    with torch.no_grad():
        a, b = model(idx), model(changed)
        assert torch.equal(a[:, :12], b[:, :12]) and not torch.allclose(a[:, 12:], b[:, 12:])
        for scan in ("ref", "parallel"):
            other = tiny_model(scan=scan)
            other.load_state_dict(model.state_dict())
            torch.testing.assert_close(other(idx), a, rtol=1e-5, atol=1e-5)


def test_initialisation_follows_mamba():
    model = tiny_model()
    config = model.config
    ssm = model.layers[0].mixer.ssm
    n = config.d_state
    A = -torch.arange(1, n + 1).float().repeat(config.d_inner, 1)  # S4D-real: A[d, n] = -(n + 1)
    torch.testing.assert_close(-torch.exp(ssm.A_log), A, rtol=1e-6, atol=0)  # exp(log(k)) rounds in the last bit
    assert torch.equal(ssm.D, torch.ones(config.d_inner))
    dt = F.softplus(ssm.dt_proj.bias)
    assert (dt >= config.dt_min * (1 - 1e-5)).all() and (dt <= config.dt_max * (1 + 1e-5)).all()
    assert config.dt_rank == math.ceil(32 / 16) and config.d_inner == 64
    assert model.lm_head.weight is model.embedding.weight


def test_tiny_mamba_trains_and_loss_decreases():
    """A stream whose next token is fixed by the current one: the loss falls from ln(64) fast."""
    g = torch.Generator().manual_seed(6)
    successor = torch.randperm(64, generator=g)
    stream = [0]
    for _ in range(4000):  # 90%: the current token's fixed successor; 10%: a random token
        follow = torch.rand(1, generator=g) < 0.9
        stream.append(int(successor[stream[-1]]) if follow else int(torch.randint(64, (1,), generator=g)))
    data = torch.tensor(stream)
    model = tiny_model()
    losses = train_lm(model, data, steps=20, batch_size=8, seq_len=32, lr=1e-2, seed=0)
    assert losses[0] > 3.5  # about ln(64) = 4.16 at the start
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


def test_non_selective_variant_runs_and_has_no_input_projection():
    model = tiny_model(selective=False)
    selective = tiny_model()
    idx = torch.randint(64, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 64) and torch.isfinite(loss)
    assert not hasattr(model.layers[0].mixer.ssm, "x_proj")
    assert model.num_parameters() < selective.num_parameters()


def test_mamba_mixer_stands_in_for_attention_in_a_gpt_block():
    gpt_config = GPTConfig.tiny(n_layer=2, n_embd=32, n_head=2, block_size=16)
    mamba_config = MambaConfig(vocab_size=64, d_model=32, n_layers=2)
    torch.manual_seed(0)
    hybrid = GPT(gpt_config, make_block=lambda cfg, i: Block(cfg, attn=MambaMixer(mamba_config)))
    logits, loss = hybrid(torch.randint(64, (2, 16)), torch.randint(64, (2, 16)))
    assert logits.shape == (2, 16, 64) and torch.isfinite(loss)


def test_traced_states_are_the_layers_own_recurrence_and_selective_steps_differ_by_token():
    torch.manual_seed(0)
    for selective in (True, False):
        model = MambaLM(MambaConfig(vocab_size=10, d_model=16, n_layers=2, selective=selective))
        idx = torch.randint(10, (2, 9), generator=torch.Generator().manual_seed(1))
        tr = trace_states(model, idx, layer=1)  # raises if the states do not reproduce the layer's output
        assert tr["h"].shape == (2, 9, 32, 16) and tr["delta"].shape == (2, 9, 32)
        spread = tr["delta"].std(dim=1).max().item()  # over positions
        assert (spread > 1e-4) if selective else (spread == 0.0)  # Δ depends on the token only when selective
    with pytest.raises(ValueError, match="layer must be < n_layers"):
        trace_states(model, idx, layer=2)


def test_traced_delta_is_the_step_size_the_layers_scan_used(monkeypatch):
    """The Δ that trace_states returns (what widgets.SSMStateView draws) is the one the layer's own
    scan ran with: softplus(dt + dt_proj.bias) of the dt handed to the scan when selective, the Δ
    handed to it when not; and, recomputed from the layer's weights, softplus(dt_proj(x_proj(x)_Δ))."""
    import lib.mamba as mamba

    for selective in (True, False):
        torch.manual_seed(0)
        model = MambaLM(MambaConfig(vocab_size=10, d_model=16, n_layers=2, selective=selective))
        ssm = model.layers[1].mixer.ssm
        seen = []
        scan = mamba.SCANS[ssm.scan]

        def recording(x, delta, *args, _scan=scan, **kwargs):
            seen.append((x, delta, kwargs.get("delta_bias"), kwargs.get("delta_softplus", False)))
            return _scan(x, delta, *args, **kwargs)

        monkeypatch.setitem(mamba.SCANS, ssm.scan, recording)
        idx = torch.randint(10, (2, 9), generator=torch.Generator().manual_seed(1))
        tr = trace_states(model, idx, layer=1)
        monkeypatch.setitem(mamba.SCANS, ssm.scan, scan)
        x, delta, bias, softplus = seen[1]  # layer 1's scan (layer 0's ran first)
        used = F.softplus(delta + bias) if softplus else delta  # (B, T, D): what the scan stepped with
        assert softplus == selective and torch.allclose(tr["delta"], used, rtol=1e-6, atol=1e-7)
        if selective:
            dt = F.linear(x, ssm.x_proj.weight)[..., : ssm.dt_rank]  # (B, T, R)
            assert torch.allclose(tr["delta"], F.softplus(ssm.dt_proj(dt)), rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(tr["delta"][0, 0], F.softplus(ssm.dt_bias))


def test_traced_states_of_a_float64_model_stay_float64():
    """trace_states recomputes in the model's dtype (at least fp32): a float64 model, as the lessons
    train, is traced in float64 and its recomputation reproduces the layer to float64 rounding."""
    from lib.course.precision import default_dtype

    with default_dtype(torch.float64):
        torch.manual_seed(0)
        model = MambaLM(MambaConfig(vocab_size=10, d_model=16, n_layers=2))
    idx = torch.randint(10, (2, 9), generator=torch.Generator().manual_seed(1))
    tr = trace_states(model, idx, layer=1)
    assert tr["h"].dtype == tr["delta"].dtype == torch.float64


HF_NAMES = {
    "embedding.weight": "backbone.embeddings.weight",
    "norm_f.weight": "backbone.norm_f.weight",
    "lm_head.weight": "lm_head.weight",
}


def _hf_name(name: str) -> str:
    """Our parameter name -> Hugging Face MambaForCausalLM's (the official layout, less the `ssm.` step)."""
    if name in HF_NAMES:
        return HF_NAMES[name]
    return "backbone." + name.replace("mixer.ssm.", "mixer.")


@pytest.mark.parametrize("scan", ["auto", "chunked", "ref"])
def test_mamba_lm_is_hugging_faces_mamba_for_causal_lm(scan):
    """Our MambaLM with a Hugging Face MambaForCausalLM's weights (transformers' own PyTorch path,
    no download: a random model of the same config) gives the same logits and the same gradient for
    every parameter, in fp64, whichever scan runs it (auto: the fused C loop and its convolution
    where they compiled), and decodes step by step to the same logits."""
    from transformers import MambaConfig as HFMambaConfig
    from transformers import MambaForCausalLM

    torch.manual_seed(0)
    config = HFMambaConfig(
        vocab_size=37,
        hidden_size=24,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        time_step_rank=3,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        residual_in_fp32=True,
        tie_word_embeddings=True,
    )
    hf = MambaForCausalLM(config).double()
    ours = MambaLM(
        MambaConfig(vocab_size=37, d_model=24, n_layers=2, d_state=8, d_conv=4, dt_rank=3, scan=scan)
    ).double()
    theirs = hf.state_dict()
    missing = ours.load_state_dict({name: theirs[_hf_name(name)] for name in ours.state_dict()}, strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    idx = torch.randint(37, (3, 23), generator=torch.Generator().manual_seed(1))

    def hf_logits(ids):  # MambaForCausalLM's head, without the float32 cast it applies to its logits
        return hf.lm_head(hf.backbone(input_ids=ids).last_hidden_state)

    hf_out = hf_logits(idx[:, :-1])
    hf_loss = F.cross_entropy(hf_out.reshape(-1, 37), idx[:, 1:].reshape(-1))
    logits, loss = ours(idx[:, :-1], idx[:, 1:])
    assert hf_out.dtype == logits.dtype == torch.float64
    # Hugging Face's path computes its RMSNorm and B̄x in float32 even in a float64 model, so the two
    # agree to float32's rounding (measured: 1e-7 of the largest logit, 3e-7 of a gradient's largest
    # entry), not float64's; 1e-5 of the largest value still fails on any real difference (O(1)).
    tol = dict(rtol=1e-5, atol=1e-5 * hf_out.abs().max().item())
    torch.testing.assert_close(logits, hf_out, **tol)
    torch.testing.assert_close(loss, hf_loss, rtol=1e-6, atol=0)
    loss.backward()
    hf_loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        want = hf_params[_hf_name(name)].grad
        torch.testing.assert_close(
            p.grad, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=lambda m: f"grad of {name}: {m}"
        )
    with torch.no_grad():  # and the recurrent step reproduces the parallel forward
        caches = ours.new_caches(3)
        stepped = [ours(idx[:, t : t + 1], caches=caches, start=t) for t in range(idx.shape[1])]
        torch.testing.assert_close(torch.cat(stepped, 1), hf_logits(idx), **tol)


def test_a_float64_model_keeps_every_parameter_in_float64_and_a_half_default_keeps_A_in_fp32():
    """A_log follows the default dtype, so a float64 model trains in float64 throughout; a half default
    keeps A in float32, as the official code does."""
    from lib.course.precision import default_dtype

    with default_dtype(torch.float64):
        model = MambaLM(MambaConfig(vocab_size=10, d_model=16, n_layers=1))
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ssm = SelectiveSSM(MambaConfig(vocab_size=10, d_model=16, n_layers=1))
    finally:
        torch.set_default_dtype(before)
    assert ssm.A_log.dtype == torch.float32 and ssm.D.dtype == torch.bfloat16


def test_the_model_refuses_a_gap_and_state_bytes_a_gpt_config():
    model = tiny_model()  # the model's door (ids, caches, padding): tests/lib/test_decoder_door.py
    one = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"start must equal the positions already read \(0\)"):
        model(one, caches=model.new_caches(2), start=4)
    with pytest.raises(TypeError, match="model_or_config must be a MambaLM or a MambaConfig"):
        state_bytes(GPTConfig.tiny(), 1)
    assert all(isinstance(c, MixerCache) for c in model.new_caches(1))


# fmt: off
CONFIG_REFUSALS = [
    ("scan", "fast", ValueError,
     "scan must be one of ('auto', 'chunked', 'cpu', 'ref', 'parallel', 'triton'), got 'fast'"),
    ("dt_rank", "big", TypeError, "dt_rank must be an int, got str"),
    ("norm", "batch", ValueError, "norm must be one of ('rms', 'layer'), got 'batch'"),
    ("chunk_size", 0, ValueError, "chunk_size must be >= 1, got 0"),
    ("d_model", 0, ValueError, "d_model must be >= 1, got 0"),
    ("dt_min, dt_max", (0.2, 0.1), ValueError, "need 0 < dt_min <= dt_max, got dt_min=0.2, dt_max=0.1"),
]
# fmt: on
test_config_refusals = refusal_test(MambaConfig, dict(vocab_size=64, d_model=32, n_layers=2), CONFIG_REFUSALS)


# fmt: off
MIXER_REFUSALS = [
    ("cache", MixerCache(3, 64, 4, 16), ValueError, "the cache was built for batch size 3, x has batch size 2"),
    (
        "mask",
        torch.zeros(1, 1, 1, 1),
        ValueError,
        (
            "a Mamba mixer takes no padding mask (mask must be None): a padding token would enter its "
            "state; run unpadded sequences"
        ),
    ),
    (
        "cache",
        object(),
        ValueError,
        (
            "a Mamba mixer carries a recurrent state, not a KV cache: cache must be a "
            "lib.mamba.MixerCache or None, got object"
        ),
    ),
    ("start", 4, ValueError,
     "start must equal the positions already read (0): a recurrent state cannot skip or rewind positions, got 4"),
    ("start", -1, ValueError, "start must be >= 0, got -1"),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message", rows(MIXER_REFUSALS))
def test_mixer_refusals(argument, bad, error, message):
    torch.manual_seed(0)
    mixer = MambaMixer(MambaConfig(vocab_size=64, d_model=32, n_layers=2))  # d_inner 64, d_conv 4, d_state 16
    cache = mixer.new_cache(2, dtype=torch.float32, device="cpu")
    assert_refuses(mixer, dict(x=torch.zeros(2, 1, 32), cache=cache, start=0), argument, bad, error, message)
    assert cache.length == 0  # a refused step leaves the state where it was
