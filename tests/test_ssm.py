"""lib.scan and lib.mamba: the three selective scans agree (values, gradients, carried state), stay finite for
large Δ, the LTI case is a convolution, the combine is associative, recurrent decoding equals the
parallel forward with a constant-size state, bad inputs are refused clearly, and a tiny Mamba
trains."""

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from lib.gpt import GPT, Block, GPTConfig, train_gpt
from lib.kv_cache import kv_cache_bytes
from lib.mamba import MambaConfig, MambaLM, MambaMixer, MambaState, SelectiveSSM, generate, state_bytes, trace_states
from lib.scan import (default_chunk_size, discretize, lti_kernel, parallel_scan_ref, scan_combine, selective_scan,
                      selective_scan_ref, ssm_convolution)

@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds synchronisation, which on a busy
    2-core machine costs 10-30x the work itself. Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# fp32 comparisons of two scans. Both add the same terms; they group them differently across
# chunks (and the parallel scan in a tree). fp32's ε is 1.2e-7, and the state is a decaying sum
# (every Ā in [0, 1]), so rounding does not compound along the sequence: measured differences are
# below 1e-6 of the output's largest magnitude for L up to 4096. 1e-5 relative (~100 ε) leaves room
# for other CPUs' summation orders and still fails on any real algorithmic slip (those are O(1)).
RTOL32 = 1e-5
# fp64 comparisons: the same algebra in double precision (ε 2.2e-16) must agree to ~1e4 ε.
TOL64 = 1e-12


def scan_inputs(b=2, l=16, d=4, n=3, *, seed=0, dtype=torch.float32, delta=None, x_sign="mixed"):
    """Random scan inputs shaped like a Mamba layer's: Δ mostly 0.005-0.1 (softplus of N(-4, 1)),
    A = -(1..N) per channel scaled by a random factor, x, B, C standard normal; D and h0 too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, d, generator=g, dtype=dtype)
    if x_sign == "negative":
        x = -x.abs()
    dl = F.softplus(torch.randn(b, l, d, generator=g, dtype=dtype) - 4.0) if delta is None else \
        torch.full((b, l, d), float(delta), dtype=dtype)
    A = -torch.arange(1, n + 1, dtype=dtype).repeat(d, 1) * torch.rand(d, 1, generator=g, dtype=dtype).add(0.5)
    B = torch.randn(b, l, n, generator=g, dtype=dtype)
    C = torch.randn(b, l, n, generator=g, dtype=dtype)
    D = torch.randn(d, generator=g, dtype=dtype)
    h0 = torch.randn(b, d, n, generator=g, dtype=dtype)
    return x, dl, A, B, C, D, h0


def assert_close32(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL32, atol=RTOL32 * expected.abs().max().item())


# --------------------------------------------------------------------------- scans agree
@pytest.mark.parametrize("L", [1, 7, 64, 1000, 4096])
@pytest.mark.parametrize("x_sign", ["mixed", "negative"])
def test_chunked_scan_matches_reference_in_fp32(L, x_sign):
    x, delta, A, B, C, D, _ = scan_inputs(2, L, 4 if L < 4096 else 8, 4, seed=L, x_sign=x_sign)
    y_ref = selective_scan_ref(x, delta, A, B, C, D)
    y = selective_scan(x, delta, A, B, C, D, impl="chunked")  # the fused CPU loop: tests/test_scan_cpu.py
    assert y.shape == (2, L, x.shape[2]) and y.dtype == torch.float32
    assert_close32(y, y_ref)


@pytest.mark.parametrize("L,chunk", [(1, None), (7, 3), (50, 1), (50, 8), (64, 16), (65, 16), (37, 37), (37, 100)])
def test_chunked_scan_is_the_reference_algebra_in_fp64(L, chunk):
    """Any chunk size, L a multiple of it or not, with a start state: the same y and final state."""
    x, delta, A, B, C, D, h0 = scan_inputs(2, L, 3, 5, seed=1, dtype=torch.float64)
    y_ref, h_ref = selective_scan_ref(x, delta, A, B, C, D, h0=h0, return_state=True)
    y, h = selective_scan(x, delta, A, B, C, D, h0=h0, return_state=True, chunk_size=chunk, impl="chunked")
    torch.testing.assert_close(y, y_ref, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(h, h_ref, rtol=TOL64, atol=TOL64)


@pytest.mark.parametrize("L", [1, 5, 64, 100])
def test_parallel_scan_matches_reference(L):
    x, delta, A, B, C, D, h0 = scan_inputs(2, L, 3, 4, seed=2, dtype=torch.float64)
    y_ref, h_ref = selective_scan_ref(x, delta, A, B, C, D, h0=h0, return_state=True)
    y, h = parallel_scan_ref(x, delta, A, B, C, D, h0=h0, return_state=True)
    torch.testing.assert_close(y, y_ref, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(h, h_ref, rtol=TOL64, atol=TOL64)
    x, delta, A, B, C, D, _ = scan_inputs(2, L, 3, 4, seed=2)
    assert_close32(parallel_scan_ref(x, delta, A, B, C, D), selective_scan_ref(x, delta, A, B, C, D))


def test_scan_without_skip_and_default_chunk_size():
    x, delta, A, B, C, _, _ = scan_inputs(1, 300, 2, 2, seed=3, dtype=torch.float64)
    for impl in ("chunked", "auto"):
        torch.testing.assert_close(selective_scan(x, delta, A, B, C, impl=impl), selective_scan_ref(x, delta, A, B, C),
                                   rtol=TOL64, atol=TOL64)
    assert default_chunk_size(2048) == 32 and default_chunk_size(1) == 1 and default_chunk_size(10) == 4


@pytest.mark.parametrize("scan", [selective_scan, parallel_scan_ref])
def test_scan_gradients_match_reference(scan):
    """Gradients of every input, including the start state, equal the per-step loop's."""
    inputs = scan_inputs(2, 21, 3, 4, seed=4, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    w_y = torch.randn(2, 21, 3, generator=g, dtype=torch.float64)  # weights of a scalar loss on y and h_L
    w_h = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)

    def grads(fn, **kw):
        leaves = [t.detach().requires_grad_() for t in inputs]
        x, delta, A, B, C, D, h0 = leaves
        y, h = fn(x, delta, A, B, C, D, h0=h0, return_state=True, **kw)
        ((y * w_y).sum() + (h * w_h).sum()).backward()
        return [t.grad for t in leaves]

    expected = grads(selective_scan_ref)
    kw = {"chunk_size": 8} if scan is selective_scan else {}  # 21 = 2 chunks of 8 + a padded one
    for name, got, want in zip(["x", "delta", "A", "B", "C", "D", "h0"], grads(scan, **kw), expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("scan", [partial(selective_scan, impl="chunked"), selective_scan, parallel_scan_ref],
                         ids=["chunked", "auto", "parallel"])
def test_state_carry_splits_a_sequence(scan):
    """Scanning two halves, the second from the first's final state, equals one scan."""
    x, delta, A, B, C, D, h0 = scan_inputs(2, 40, 3, 4, seed=6, dtype=torch.float64)
    y, h = scan(x, delta, A, B, C, D, h0=h0, return_state=True)
    y1, h1 = scan(x[:, :17], delta[:, :17], A, B[:, :17], C[:, :17], D, h0=h0, return_state=True)
    y2, h2 = scan(x[:, 17:], delta[:, 17:], A, B[:, 17:], C[:, 17:], D, h0=h1, return_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(h2, h, rtol=TOL64, atol=TOL64)


@pytest.mark.parametrize("delta", [50.0, "mixed"])
def test_scan_is_finite_and_exact_for_large_delta_and_long_sequences(delta):
    """Δ = 50 with A down to -16 gives Δ·A = -800: exp of it underflows to 0 (forget everything),
    never overflows. A scan that formed exp(+cumsum) would meet exp(3e6) here and return inf/nan."""
    L = 4096
    x, dl, A, B, C, D, _ = scan_inputs(2, L, 4, 16, seed=7, delta=None if delta == "mixed" else delta)
    if delta == "mixed":  # long calm stretches broken by resets
        dl = torch.where(torch.rand(dl.shape, generator=torch.Generator().manual_seed(8)) < 0.05,
                         torch.full_like(dl, 50.0), dl)
    y_ref = selective_scan_ref(x, dl, A, B, C, D)
    y = selective_scan(x, dl, A, B, C, D, chunk_size=64)
    assert torch.isfinite(y).all()
    assert_close32(y, y_ref)
    leaves = [t.detach()[:, :300].requires_grad_() for t in (x, dl, B, C)]
    selective_scan(leaves[0], leaves[1], A, leaves[2], leaves[3], D).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


# --------------------------------------------------------------------------- the pieces
def test_discretize_is_zoh_for_A_and_euler_for_B():
    _, delta, A, B, _, _, _ = scan_inputs(2, 5, 3, 4, seed=9, dtype=torch.float64)
    A_bar, B_bar = discretize(delta, A, B)
    assert A_bar.shape == B_bar.shape == (2, 5, 3, 4)
    b, l, d, n = 1, 3, 2, 1
    assert A_bar[b, l, d, n] == math.exp(delta[b, l, d].item() * A[d, n].item())
    assert B_bar[b, l, d, n] == delta[b, l, d] * B[b, l, n]
    assert (A_bar > 0).all() and (A_bar < 1).all()  # Δ > 0, A < 0: the state decays
    A_bar, B_bar = discretize(delta[0, 0], A, B[0, 0])  # the LTI case: (D,), (N,) -> (D, N)
    assert A_bar.shape == (3, 4)


def test_scan_combine_is_associative_and_its_fold_is_the_recurrence():
    g = torch.Generator().manual_seed(10)
    pairs = [(torch.rand(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64))
             for _ in range(6)]
    p, q, r = pairs[:3]
    left, right = scan_combine(scan_combine(p, q), r), scan_combine(p, scan_combine(q, r))
    for u, v in zip(left, right):
        torch.testing.assert_close(u, v, rtol=TOL64, atol=TOL64)
    h = torch.zeros(3, 4, dtype=torch.float64)
    folded = pairs[0]
    h = pairs[0][0] * h + pairs[0][1]
    for a, b in pairs[1:]:
        h = a * h + b  # the recurrence, one step at a time
        folded = scan_combine(folded, (a, b))
    torch.testing.assert_close(folded[1], h, rtol=TOL64, atol=TOL64)  # applied to h_0 = 0
    torch.testing.assert_close(folded[0], torch.stack([a for a, _ in pairs]).prod(0), rtol=TOL64, atol=TOL64)


def test_lti_recurrence_equals_convolution():
    """Fixed Δ, B, C: the recurrence and y = K * x with K_k = C·(Ā^k ⊙ B̄) agree."""
    b, l, d, n = 2, 50, 3, 4
    x, _, A, _, _, D, _ = scan_inputs(b, l, d, n, seed=11, dtype=torch.float64)
    g = torch.Generator().manual_seed(12)
    delta_d = torch.rand(d, generator=g, dtype=torch.float64) * 0.5  # one Δ per channel, all positions
    B_n, C_n = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    y_rec = selective_scan_ref(x, delta_d.expand(b, l, d), A, B_n.expand(b, l, n), C_n.expand(b, l, n), D)
    A_bar, B_bar = discretize(delta_d, A, B_n)  # (D, N) each
    K = lti_kernel(A_bar, B_bar, C_n, l)  # (D, L)
    assert K.shape == (d, l)
    torch.testing.assert_close(K[:, 0], (C_n * B_bar).sum(-1), rtol=TOL64, atol=TOL64)  # K_0 = C·B̄
    torch.testing.assert_close(ssm_convolution(x, K, D), y_rec, rtol=1e-10, atol=1e-10)  # FFT rounding ~1e-15


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


# --------------------------------------------------------------------------- the model
def tiny_model(seed=0, **changes) -> MambaLM:
    torch.manual_seed(seed)
    return MambaLM(MambaConfig.tiny(d_model=32, n_layers=2, **changes)).eval()


@pytest.mark.parametrize("changes", [{}, {"chunk_size": 4}, {"selective": False}, {"norm": "layer", "d_conv": 2}])
def test_step_by_step_decoding_matches_parallel_forward(changes):
    """Decoding one token at a time from new_state() gives the forward's logits at every position.
    Both in fp32; they differ only in rounding order (a conv as a sum vs conv1d, the scan chunked
    vs stepped), and logits are O(1): 1e-5 absolute is ~100 ε of them."""
    model = tiny_model(**changes)
    idx = torch.randint(64, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)  # (B, T, V)
        state = model.new_state(2)
        for t in range(idx.shape[1]):
            logits, state = model.step(idx[:, t], state)
            torch.testing.assert_close(logits, full[:, t], rtol=1e-5, atol=1e-5)


def test_prefill_in_pieces_matches_one_prefill():
    model = tiny_model()
    idx = torch.randint(64, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, state = model.prefill(idx)
        a, s1 = model.prefill(idx[:, :2])  # shorter than the conv's window: its state mixes zeros and inputs
        b, s2 = model.prefill(idx[:, 2:11], s1)
        c, s3 = model.prefill(idx[:, 11:], s2)
    torch.testing.assert_close(torch.cat([a, b, c], dim=1), full, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the same scan as prefill's (selective_scan's "auto" picks by whether grad is needed)
        torch.testing.assert_close(full, model(idx), rtol=0, atol=0)
    # with gradients on, "auto" is the chunked scan: the same up to fp32 rounding (logits are O(1))
    torch.testing.assert_close(full, model(idx), rtol=1e-5, atol=1e-5)
    for u, v in zip(state.conv + state.ssm, s3.conv + s3.ssm):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


def test_state_size_is_constant_in_position_and_matches_state_bytes():
    model = tiny_model()
    config = model.config
    expected = state_bytes(model, 3)
    assert expected == config.n_layers * 3 * config.d_inner * (config.d_conv - 1 + config.d_state) * 4
    state = model.new_state(3)
    sizes = [state.nbytes]
    with torch.no_grad():
        for t in range(40):
            _, state = model.step(torch.full((3,), t % 64), state)
            sizes.append(state.nbytes)
        _, long_state = model.prefill(torch.randint(64, (3, 500)))
    assert set(sizes) == {expected} and long_state.nbytes == expected
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
    losses = train_gpt(model, data, steps=20, batch_size=8, seq_len=32, lr=1e-2, seed=0)
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


# --------------------------------------------------------------------------- bad input
def _bad_scan_cases():
    x, delta, A, B, C, D, h0 = scan_inputs(2, 6, 3, 4)
    ok = dict(x=x, delta=delta, A=A, B=B, C=C, D=D)
    return [
        ("x rank", dict(ok, x=x[0]), ValueError, r"x must have shape \(B, L, D\)"),
        ("delta shape", dict(ok, delta=delta[:, :5]), ValueError,
         r"delta must have shape \(B, L, D\) = \(2, 6, 3\) like x, got \(2, 5, 3\)"),
        ("A shape", dict(ok, A=A[:2]), ValueError, r"A must have shape \(D, N\) = \(3, 4\) with D = x.shape\[-1\]"),
        ("A rank", dict(ok, A=A[0]), ValueError, r"A must have shape \(D, N\)"),
        ("B shape", dict(ok, B=B[:, :, :3]), ValueError, r"B must have shape \(B, L, N\)"),
        ("C shape", dict(ok, C=C[:1]), ValueError, r"C must have shape \(B, L, N\)"),
        ("D shape", dict(ok, D=D[:2]), ValueError, r"D must have shape \(D,\)"),
        ("h0 shape", dict(ok, h0=h0[:, :, :2]), ValueError, r"h0 must have shape \(B, D, N\)"),
        ("A zero", dict(ok, A=A.clone().index_fill_(1, torch.tensor([0]), 0.0)), ValueError,
         r"A must be negative.*grow without bound"),
        ("A positive", dict(ok, A=-A), ValueError, r"exp\(Δ·A\) must be < 1"),
        ("delta negative", dict(ok, delta=-delta), ValueError, r"delta must be >= 0"),
        ("x integer", dict(ok, x=torch.ones(2, 6, 3, dtype=torch.int64)), TypeError, r"x must have a floating dtype"),
        ("B integer", dict(ok, B=B.long()), TypeError, r"B must have a floating dtype"),
        ("C not a tensor", dict(ok, C=C.tolist()), TypeError, r"C must be a torch.Tensor"),
        ("empty", dict(ok, x=x[:, :0], delta=delta[:, :0], B=B[:, :0], C=C[:, :0]), ValueError, r"every size >= 1"),
        ("z shape", dict(ok, z=x[:, :5]), ValueError, r"z must have shape \(B, L, D\) = \(2, 6, 3\) like x"),
        ("z integer", dict(ok, z=x.long()), TypeError, r"z must have a floating dtype"),
        ("delta_bias shape", dict(ok, delta_bias=D[:2]), ValueError, r"delta_bias must have shape \(D,\) = \(3,\)"),
        ("delta_softplus not a bool", dict(ok, delta_softplus=1), TypeError, r"delta_softplus must be a bool"),
        ("delta NaN under softplus", dict(ok, delta=delta.clone().fill_(float("nan")), delta_softplus=True),
         ValueError, r"delta must not be NaN"),
        ("delta + bias negative", dict(ok, delta_bias=-torch.ones(3)), ValueError,
         r"delta \+ delta_bias must be >= 0.*delta_softplus=True"),
    ]


@pytest.mark.parametrize("scan", [selective_scan, selective_scan_ref, parallel_scan_ref])
@pytest.mark.parametrize("case", _bad_scan_cases(), ids=lambda c: c[0])
def test_scans_refuse_bad_inputs_with_a_clear_error(scan, case):
    _, kwargs, error, message = case
    with pytest.raises(error, match=message):
        scan(**kwargs)


def test_other_bad_inputs_are_refused():
    x, delta, A, B, C, D, _ = scan_inputs(2, 6, 3, 4)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        selective_scan(x, delta, A, B, C, chunk_size=0)
    with pytest.raises(ValueError, match=r"delta must have shape \(\.\.\., D\)"):
        discretize(delta[..., :2], A, B)
    with pytest.raises(ValueError, match=r"B_bar must have shape \(D, N\)"):
        lti_kernel(A, A[:, :2], C[0, 0], 8)
    with pytest.raises(ValueError, match=r"K must have shape \(D, L_K\) with D = 3 and L_K >= L = 6"):
        ssm_convolution(x, torch.ones(3, 5))
    with pytest.raises(ValueError, match="scan must be one of"):
        MambaConfig.tiny(scan="fast")
    with pytest.raises(TypeError, match="dt_rank must be an int"):
        MambaConfig.tiny(dt_rank="big")
    model = tiny_model()
    with pytest.raises(TypeError, match="state must be a MambaState"):
        model.step(torch.zeros(2, dtype=torch.long), None)
    with pytest.raises(ValueError, match=r"state.conv\[0\] must have shape \(2, 64, 3\) for a batch of 2"):
        model.step(torch.zeros(2, dtype=torch.long), model.new_state(3))
    with pytest.raises(ValueError, match=r"idx_t must have shape \(B,\)"):
        model.step(torch.zeros(2, 1, dtype=torch.long), model.new_state(2))
    with pytest.raises(ValueError, match="must lie in"):
        model(torch.full((1, 4), 64))
    with pytest.raises(ValueError, match="no padding mask"):
        model.layers[0].mixer(torch.zeros(1, 3, 32), mask=torch.zeros(1, 1, 1, 3))
    with pytest.raises(ValueError, match="not a KV cache: cache must be a lib.mamba.MixerCache"):
        model.layers[0].mixer(torch.zeros(1, 3, 32), cache=object())
    with pytest.raises(TypeError, match="model_or_config must be a MambaLM or a MambaConfig"):
        state_bytes(GPTConfig.tiny(), 1)
    assert isinstance(model.new_state(1), MambaState)


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


def test_traced_states_of_a_float64_model_stay_float64():
    """trace_states recomputes in the model's dtype (at least fp32): a float64 model, as the lessons
    train, is traced in float64 and its recomputation reproduces the layer to float64 rounding."""
    from lib.precision import default_dtype

    with default_dtype(torch.float64):
        torch.manual_seed(0)
        model = MambaLM(MambaConfig(vocab_size=10, d_model=16, n_layers=2))
    idx = torch.randint(10, (2, 9), generator=torch.Generator().manual_seed(1))
    tr = trace_states(model, idx, layer=1)
    assert tr["h"].dtype == tr["delta"].dtype == torch.float64


# --------------------------------------------------------------------------- against Hugging Face
HF_NAMES = {"embedding.weight": "backbone.embeddings.weight", "norm_f.weight": "backbone.norm_f.weight",
            "lm_head.weight": "lm_head.weight"}


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
    config = HFMambaConfig(vocab_size=37, hidden_size=24, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                           time_step_rank=3, use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5,
                           residual_in_fp32=True, tie_word_embeddings=True)
    hf = MambaForCausalLM(config).double()
    ours = MambaLM(MambaConfig(vocab_size=37, d_model=24, n_layers=2, d_state=8, d_conv=4, dt_rank=3, scan=scan)).double()
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
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                   msg=lambda m: f"grad of {name}: {m}")
    with torch.no_grad():  # and the recurrent step reproduces the parallel forward
        state = ours.new_state(3)
        stepped = []
        for t in range(idx.shape[1]):
            out, state = ours.step(idx[:, t], state)
            stepped.append(out)
        torch.testing.assert_close(torch.stack(stepped, 1), hf_logits(idx), **tol)


def test_a_float64_model_keeps_every_parameter_in_float64_and_a_half_default_keeps_A_in_fp32():
    """A_log follows the default dtype, so a float64 model trains in float64 throughout; a half default
    keeps A in float32, as the official code does."""
    from lib.precision import default_dtype

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
