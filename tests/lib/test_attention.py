"""lib.attention: every backend equals the reference; masked weights are exactly zero; rows with
no visible key give zeros (never NaN), forward and backward; bad input gets a clear error."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from refusals import assert_refuses, not_float, rows

from lib.attention import (
    BACKENDS,
    attention,
    attention_backward_ref,
    attention_chunked,
    attention_ref,
    attention_scores,
    attention_weights,
    online_softmax_update,
    register_backend,
    safe_softmax,
)
from lib.masks import causal_mask, combine_masks, padding_mask, sliding_window_mask


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def qkv(B=2, H=4, T=37, S=None, D=16, H_kv=None, D_v=None, seed=0, scale=1.0, dtype=torch.float32):
    S, H_kv, D_v = S or T, H_kv or H, D_v or D
    return (
        rand(B, H, T, D, seed=seed, scale=scale, dtype=dtype),
        rand(B, H_kv, S, D, seed=seed + 1, scale=scale, dtype=dtype),
        rand(B, H_kv, S, D_v, seed=seed + 2, dtype=dtype),
    )


def err(x, truth):
    return (x.double() - truth.double()).abs().max().item()


def truth_of(q, k, v, mask=None, causal=False):
    """float64 reference: the yardstick for every float32/16 result."""
    return attention_ref(q.double(), k.double(), v.double(), None if mask is None else mask.double(), causal)


# Inputs chosen to break things: T=1, lengths that are no multiple of a block, T < S (decoding),
# grouped-query heads, a value dim unlike the key dim, very large and negative scores, padding
# on both sides so that some query rows see no key at all.
CASES = {
    "T=1": (dict(B=1, H=1, T=1, D=8), None, False),
    "T=37 causal": (dict(T=37), None, True),
    "T=37 S=50 causal (decode-style)": (dict(T=37, S=50), None, True),
    "T=1 S=33 causal (one decode step)": (dict(T=1, S=33), None, True),
    "GQA H=4 H_kv=2, D_v=8": (dict(H=4, H_kv=2, D_v=8), None, True),
    "large scores": (dict(T=29, D=32, scale=6.0), None, False),
    "negative scores": (dict(T=29, D=32, scale=-4.0), None, True),
    "padding both sides + causal": (dict(T=12), padding_mask(torch.tensor([[0, 0] + [1] * 9 + [0], [1] * 12])), True),
    "(T, S) sliding window": (dict(T=20), sliding_window_mask(20, 5), False),
    "full (B, H, T, S) mask": (
        dict(B=2, H=4, T=9),
        torch.where(rand(2, 4, 9, 9, seed=9) > 0.8, float("-inf"), 0.0),
        False,
    ),
}


@pytest.mark.parametrize("backend", ["naive", "sdpa", "chunked"])
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_float64_truth_within_twice_the_fp32_reference_error(backend, case):
    shape, mask, causal = CASES[case]
    q, k, v = qkv(**shape)
    truth = truth_of(q, k, v, mask, causal)
    # fp32 tolerance, flash-attention's rule: a backend may be off by at most twice what the
    # fp32 reference itself is off by (1e-6 floor for inputs where that is ~0).
    budget = 2 * err(attention_ref(q, k, v, mask, causal), truth) + 1e-6
    out = attention(q, k, v, mask, causal, backend=backend)
    assert out.shape == truth.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    assert err(out, truth) <= budget


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
def test_half_precision_error_is_no_worse_than_pytorchs_own(dtype, backend):
    q, k, v = qkv(T=45, D=32, dtype=dtype)
    truth = truth_of(q, k, v, causal=True)
    # half-precision tolerance judged against PyTorch's SDPA in the same dtype (2x its error)
    torch_err = err(F.scaled_dot_product_attention(q, k, v, is_causal=True), truth)
    assert err(attention(q, k, v, causal=True, backend=backend), truth) <= 2 * torch_err + 1e-3


@given(
    T=st.integers(1, 40),
    extra=st.integers(0, 20),
    D=st.sampled_from([1, 4, 16]),
    block_q=st.integers(1, 17),
    block_k=st.integers(1, 17),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_reference_for_any_block_sizes(T, extra, D, block_q, block_k, causal, seed):
    q, k, v = qkv(B=1, H=2, T=T, S=T + extra, D=D, seed=seed)
    out = attention_chunked(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    # fp32, scores of size ~1: only the order of summation differs
    assert torch.allclose(out, attention_ref(q, k, v, causal=causal), atol=1e-5, rtol=1e-5)


@given(
    T=st.integers(2, 40),
    extra=st.integers(0, 12),
    block_q=st.integers(1, 9),
    block_k=st.integers(1, 17),
    causal=st.booleans(),
    left=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_chunked_equals_reference_with_padding_masks_and_more_queries_than_a_block(
    T, extra, block_q, block_k, causal, left, seed, data
):
    """A padding mask per sequence (left or right padded, any number of real keys, 1 up to all),
    several query blocks (T > block_q), keys beyond the queries: the same output as the reference,
    and rows that see no key (left padding under the causal mask) give exactly 0."""
    if T <= block_q:
        block_q = max(1, T - 1)
    S = T + extra
    q, k, v = qkv(B=2, H=2, T=T, S=S, D=4, seed=seed)
    real = [data.draw(st.integers(1, S)) for _ in range(2)]
    keep = torch.zeros(2, S, dtype=torch.long)
    for b, n in enumerate(real):
        if left:
            keep[b, S - n :] = 1
        else:
            keep[b, :n] = 1
    mask = padding_mask(keep)
    out = attention_chunked(q, k, v, mask, causal=causal, block_q=block_q, block_k=block_k)
    want = attention_ref(q, k, v, mask, causal=causal)
    # fp32, scores of size ~1: only the order of summation differs
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[want.abs().sum(-1) == 0], want[want.abs().sum(-1) == 0])


def test_masked_weights_are_exactly_zero_and_rows_sum_to_one_or_zero():
    q, k, _ = qkv(T=10)
    mask = combine_masks(causal_mask(10), padding_mask(torch.tensor([[0, 0] + [1] * 8, [1] * 7 + [0] * 3])))
    w = attention_weights(q, k, mask)
    blocked = torch.isneginf(mask).expand_as(w)
    assert (w[blocked] == 0).all()
    sums = w.sum(-1)
    has_key = (~torch.isneginf(mask)).any(-1).expand_as(sums)
    assert torch.allclose(sums[has_key], torch.ones_like(sums[has_key]))
    assert (sums[~has_key] == 0).all() and (~has_key).any()  # left padding + causal: empty rows exist


@pytest.mark.parametrize("backend", ["naive", "chunked"])
def test_rows_without_visible_keys_give_zero_output_and_finite_gradients(backend):
    q, k, v = (x.requires_grad_() for x in qkv(B=2, H=2, T=6, D=4))
    mask = combine_masks(causal_mask(6), padding_mask(torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])))
    out = attention(q, k, v, mask, backend=backend)
    assert torch.equal(out[0, :, :2], torch.zeros(2, 2, 4))
    keep_rows = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6], dtype=torch.float32)[:, None, :, None]
    (out * keep_rows).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_plain_softmax_gives_nan_where_safe_softmax_gives_zero():
    x = torch.tensor([[0.5, float("-inf"), 2.0], [float("-inf")] * 3])
    assert torch.isnan(torch.softmax(x, -1)[1]).all()
    assert torch.equal(safe_softmax(x)[1], torch.zeros(3))
    assert torch.allclose(safe_softmax(x)[0], torch.softmax(x, -1)[0], rtol=0, atol=1e-7)


def test_scores_are_scaled_by_inverse_sqrt_d():
    q, k, _ = qkv(D=16)
    assert torch.allclose(attention_scores(q, k), q @ k.transpose(-2, -1) / 4.0, atol=1e-6)
    assert torch.allclose(attention_scores(q, k, scale=1.0), q @ k.transpose(-2, -1), atol=1e-5)


def test_auto_backend_is_sdpa_and_registered_backends_are_dispatched():
    q, k, v = qkv(T=5)
    assert torch.equal(attention(q, k, v, causal=True), attention(q, k, v, causal=True, backend="sdpa"))
    calls = []

    def spy(q, k, v, mask=None, causal=False, scale=None):
        calls.append(causal)
        return attention_ref(q, k, v, mask, causal, scale)

    register_backend("spy", spy)
    try:
        attention(q, k, v, causal=True, backend="spy")
        assert calls == [True]
    finally:
        BACKENDS.pop("spy")


q0, k0, v0 = qkv(B=2, H=4, T=6, D=8)
_TRITON = "backend='triton' takes causal=True or no mask, not a mask (sdpa takes any)"
_ADDITIVE = "mask must be an additive floating mask (0 = attend, -inf = blocked), got torch"
# fmt: off
ATTENTION_REFUSALS = [
    ("q", q0[0], ValueError, "q must have shape (B, H, T, D) (4 dims), got (4, 6, 8)"),
    ("q", q0[:, :, :0], ValueError, "q must have shape (B, H, T, D) with every size >= 1, got (2, 4, 0, 8)"),
    ("q", q0.long(), TypeError, not_float("q")),
    ("q", [[1.0]], TypeError, "q must be a torch.Tensor, got list"),
    ("k", k0[..., :4], ValueError, "k must have shape (B, H_kv, S, D) with D = 8 as in q, got (2, 4, 6, 4)"),
    ("k, v", (k0[:1], v0[:1]), ValueError, "k must have shape (B, H_kv, S, D) with B = 2 as in q, got (1, 4, 6, 8)"),
    ("k, v", (k0[:, :3], v0[:, :3]), ValueError,
     "the query heads H must be a multiple of the key/value heads H_kv, got H=4, H_kv=3"),
    ("v", v0[:, :, :5], ValueError, "v must have shape (B, H_kv, S, D_v) with S = 6 as in k, got (2, 4, 5, 8)"),
    ("v", v0.double(), ValueError,
     "q, k, v must share one dtype, got q: torch.float32, k: torch.float32, v: torch.float64"),
    ("v", v0.to("meta"), ValueError, "v must be on q's device cpu, got meta"),
    ("mask", torch.zeros(6, 5), ValueError, "mask must have shape (T, S) with S = 6 as in k, got (6, 5)"),
    ("mask", torch.zeros(2, 3, 6, 6), ValueError,
     "mask must broadcast to (B, H, T, S) with H = 4 as in q (or 1), got (2, 3, 6, 6)"),
    ("mask", torch.zeros(6, 6, 6), ValueError,
     "mask must have shape (T, S) or broadcast to (B, H, T, S) (2 or 4 dims), got (6, 6, 6)"),
    ("mask", torch.ones(6, 6, dtype=torch.bool), TypeError,
     f"{_ADDITIVE}.bool; convert with lib.masks.additive_from_bool(keep)"),
    ("mask", torch.zeros(6, 6, dtype=torch.int32), TypeError, f"{_ADDITIVE}.int32"),
    ("mask", torch.full((6, 6), float("nan")), ValueError, "mask must hold finite values or -inf (no NaN, no +inf)"),
    ("mask", torch.zeros(6, 6, device="meta"), ValueError, "mask must be on q's device cpu, got meta"),
    ("q, k, v, causal", (q0[:, :, :4], k0[:, :, :3], v0[:, :, :3], True), ValueError,
     "causal attention needs T <= S (the queries are the last T of S positions), got causal=True, T=4, S=3"),
    ("causal", 1, TypeError, "causal must be a bool, got int"),
    ("scale", -1.0, ValueError, "scale must be a finite number > 0 or None, got -1.0"),
    ("scale", "a", TypeError, "scale must be a real number or None, got str"),
]
# fmt: on
GOOD = dict(q=q0, k=k0, v=v0, mask=None, causal=False, scale=None)


@pytest.mark.parametrize("argument, bad, error, message", rows(ATTENTION_REFUSALS))
@pytest.mark.parametrize("backend", ["naive", "sdpa", "chunked"])
def test_attention_refusals(argument, bad, error, message, backend):
    assert_refuses(attention, {**GOOD, "backend": backend}, argument, bad, error, message)


@pytest.mark.parametrize(
    "fn, argument, bad, error, message",
    [
        (attention, "backend", "flash", ValueError, "backend must be 'auto' or one of {}, got 'flash'"),
        (attention_chunked, "block_q", 0, ValueError, "block_q must be >= 1, got 0"),
        (attention_chunked, "block_k", 2.5, TypeError, "block_k must be an int, got float"),
        (
            attention_backward_ref,
            "grad_out",
            torch.zeros(2, 4, 6, 7),
            ValueError,
            "grad_out must have shape (B, H, T, D_v) with D_v = 8 as in v, got (2, 4, 6, 7)",
        ),
        (attention_backward_ref, "grad_out", None, TypeError, "grad_out must be a torch.Tensor, got NoneType"),
        (
            BACKENDS["triton"],
            "mask",
            torch.zeros(6, 6),
            ValueError,
            _TRITON,
        ),
        (
            BACKENDS["triton"],
            "k, v",
            (k0[:, :2], v0[:, :2]),
            ValueError,
            "flash_attention needs q, k, v of one shape (B, H, T, D): self-attention only, no grouped-query heads "
            "(H_kv != H) or T != S (attention's backend='sdpa' takes any); got q (2, 4, 6, 8), k (2, 2, 6, 8), "
            "v (2, 2, 6, 8)",
        ),
    ],
)
def test_refusals_of_the_other_arguments(fn, argument, bad, error, message):
    good = {**GOOD, "grad_out": torch.zeros(2, 4, 6, 8)} if fn is attention_backward_ref else GOOD
    assert_refuses(fn, good, argument, bad, error, message.format(sorted(BACKENDS)))


ONLINE = dict(
    m=torch.zeros(3, 1), l=torch.zeros(3, 1), acc=torch.zeros(3, 2), scores=torch.zeros(3, 5), values=torch.zeros(5, 2)
)


@pytest.mark.parametrize(
    "argument, bad, error, message",
    rows(
        [
            (
                "scores",
                torch.zeros(4, 5),
                ValueError,
                "scores must have shape (..., R, bk) with R = 3 as in m, got (4, 5)",
            ),
            (
                "values",
                torch.zeros(4, 2),
                ValueError,
                "values must have shape (..., bk, D_v) with bk = 5 as in scores, got (4, 2)",
            ),
            (
                "scores",
                torch.zeros(3, 5, dtype=torch.int64),
                TypeError,
                not_float("scores"),
            ),
            (
                "l",
                torch.zeros(2, 3, 1),
                ValueError,
                "l must have shape (..., R, 1) with ... = () as in m, got (2, 3, 1)",
            ),
        ]
    ),
)
def test_online_softmax_update_refusals(argument, bad, error, message):
    assert_refuses(online_softmax_update, ONLINE, argument, bad, error, message)


def test_reference_matches_the_textbook_formula_on_a_hand_sized_case():
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # (1, 1, 2, 2)
    k = torch.tensor([[[[1.0, 0.0], [1.0, 1.0]]]])
    v = torch.tensor([[[[10.0], [20.0]]]])
    s = torch.tensor([[1.0, 1.0], [0.0, 1.0]]) / math.sqrt(2)
    expected = torch.softmax(s, -1) @ torch.tensor([[10.0], [20.0]])
    assert torch.allclose(attention_ref(q, k, v)[0, 0], expected)
    assert torch.allclose(attention_ref(q, k, v, causal=True)[0, 0, 0], torch.tensor([10.0]))


def test_online_softmax_update_keeps_the_invariant_over_ragged_blocks_and_masked_rows():
    # After every block, acc / l equals the softmax over the keys seen so far, times their values;
    # a row that has seen only -inf keeps l = acc = 0 (no NaN).
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 4, 11, generator=g) * 4 - 1  # (B, H, R, S), negative and large values
    scores[0, 0, 1, :5] = float("-inf")
    values = torch.randn(2, 3, 11, 5, generator=g)
    m = torch.full((2, 3, 4, 1), float("-inf"))
    l, acc = torch.zeros(2, 3, 4, 1), torch.zeros(2, 3, 4, 5)
    for start, end in ((0, 5), (5, 6), (6, 11)):
        m, l, acc = online_softmax_update(m, l, acc, scores[..., start:end], values[..., start:end, :])
        seen = scores[..., :end]
        visible = torch.isfinite(seen).any(-1, keepdim=True)
        truth = safe_softmax(seen) @ values[..., :end, :]
        got = torch.where(visible, acc / torch.where(l == 0, torch.ones_like(l), l), torch.zeros_like(acc))
        assert torch.allclose(got, truth, atol=1e-6)  # fp32, <= 11 terms: rounding only
        assert torch.equal(m, seen.amax(-1, keepdim=True))
        assert not torch.isnan(l).any() and torch.all(l[~visible] == 0)


# --------------------------------------------------------------------------- the backward, by its formulas
@pytest.mark.parametrize(
    "T, S, H_kv, causal, masked",
    [
        (1, 1, 4, True, False),  # T = 1: one query, one key
        (37, 37, 4, True, False),
        (13, 29, 2, True, False),  # a decode-like query block at the end of a longer cache; grouped-query heads
        (20, 20, 1, False, True),  # multi-query, a padding mask with fully masked rows
    ],
)
def test_the_backward_formulas_are_autograds_gradients(T, S, H_kv, causal, masked):
    q, k, v = qkv(T=T, S=S, H_kv=H_kv, D=8, D_v=6, dtype=torch.float64)
    mask = None
    if masked:  # batch 0 pads its first 5 keys away, batch 1 masks every key for queries 3 and 4
        mask = padding_mask(torch.tensor([[0] * 5 + [1] * (S - 5), [1] * S]))
        mask = mask.expand(2, 1, T, S).clone()
        mask[1, :, 3:5] = float("-inf")
    grad_out = rand(2, 4, T, 6, seed=9, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.autograd.backward(attention_ref(*leaves, mask=mask, causal=causal), grad_out)
    ours = attention_backward_ref(q, k, v, grad_out, mask=mask, causal=causal)
    for name, got, leaf in zip("qkv", ours, leaves):
        assert got.shape == leaf.shape and got.dtype == leaf.dtype, name
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-12, msg=f"d{name}")  # fp64: the same algebra
    if masked:
        assert torch.equal(ours[0][1, :, 3:5], torch.zeros_like(ours[0][1, :, 3:5]))  # nothing to attend: no gradient


def test_the_backward_in_fp32_and_half_inputs():
    q, k, v = qkv(T=33, D=16)
    grad_out = rand(2, 4, 33, 16, seed=5)
    truth = attention_backward_ref(*(t.double() for t in (q, k, v, grad_out)), causal=True)
    got = attention_backward_ref(q, k, v, grad_out, causal=True)
    # fp32 with unit-scale inputs: sums of 33 products each, ~1e-6 apart from fp64; 1e-5 leaves room
    assert max(err(g, t) for g, t in zip(got, truth)) < 1e-5
    half = attention_backward_ref(*(t.half() for t in (q, k, v, grad_out)), causal=True)
    assert all(h.dtype == torch.float16 for h in half)
