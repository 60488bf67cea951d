"""lib.sampling: the filters keep the sets their definitions say, agree with Hugging Face's
warpers, and sample_next_token draws from exactly softmax(filter_logits(...))."""

import math

import pytest
import torch
from refusals import assert_refuses, not_float, refusal_test, rows
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from lib.sampling import (
    apply_temperature,
    filter_logits,
    next_token_distribution,
    sample_next_token,
    top_k_filter,
    top_p_filter,
)


def random_logits(B: int, V: int, seed: int, scale: float = 3.0, shift: float = 0.0, dtype=torch.float32):
    """Gaussian rows without ties: each value gets rank × 1e-4 added, which keeps the order and
    separates values that rounding to float32 made equal (at V = 500 some rows have such pairs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g, dtype=torch.float64) * scale + shift
    rank = x.argsort(-1).argsort(-1)  # (B, V): 0 for the smallest value of each row
    return (x + 1e-4 * rank).to(dtype)


def untied(x: torch.Tensor) -> bool:
    return all(len(set(row.tolist())) == len(row) for row in x.reshape(-1, x.shape[-1]))


# --------------------------------------------------------------------------- top-k
@pytest.mark.parametrize("k", [1, 2, 5, 19])
def test_top_k_keeps_exactly_the_k_largest_on_untied_rows(k):
    x = random_logits(16, 20, seed=k)
    assert untied(x)
    out = top_k_filter(x, k)
    kept = torch.isfinite(out)
    assert (kept.sum(-1) == k).all()
    top = torch.topk(x, k, dim=-1).indices
    assert kept.gather(-1, top).all()
    assert torch.equal(out[kept], x[kept])  # kept logits are untouched
    assert torch.isneginf(out[~kept]).all()


def test_top_k_keeps_every_token_tied_with_the_kth_value():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    assert torch.isfinite(top_k_filter(x, 2)).tolist() == [[True, False, True, True, True, False]]
    assert torch.isfinite(top_k_filter(x, 1)).tolist() == [[True, False, False, False, False, False]]


@pytest.mark.parametrize("k", [7, 8, 100])
def test_top_k_at_or_beyond_the_vocabulary_returns_an_unchanged_copy(k):
    x = random_logits(3, 7, seed=0)
    out = top_k_filter(x, k)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("V", [1, 2, 10, 257])
@pytest.mark.parametrize("k", [1, 3, 50, 300])
@pytest.mark.parametrize("shift", [0.0, -20.0])
def test_top_k_equals_hugging_faces_warper(V, k, shift):
    x = random_logits(32, V, seed=V + k, shift=shift)
    assert torch.equal(top_k_filter(x, k), TopKLogitsWarper(top_k=k)(None, x))


# --------------------------------------------------------------------------- top-p
@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    x = random_logits(64, 40, seed=int(p * 1000), dtype=torch.float64)
    assert untied(x)
    kept = torch.isfinite(top_p_filter(x, p))
    probs = torch.softmax(x, -1)
    mass = (probs * kept).sum(-1)
    least_kept = torch.where(kept, probs, torch.ones_like(probs)).amin(-1)
    eps = 1e-12  # float64 rounding of the sums; a random row sits this close to p with probability ~0
    assert (mass >= p - eps).all(), "the kept set must hold at least p"
    assert (mass - least_kept < p + eps).all(), "dropping the least probable kept token must fall below p"
    # and the kept tokens are the most probable ones: every kept token beats every cut token
    worst_kept = torch.where(kept, x, torch.full_like(x, math.inf)).amin(-1)
    best_cut = torch.where(kept, torch.full_like(x, -math.inf), x).amax(-1)
    assert (worst_kept > best_cut).all()


@pytest.mark.parametrize("p", [1e-9, 1e-3, 0.2])
def test_top_p_always_keeps_the_most_probable_token(p):
    x = random_logits(50, 30, seed=1, scale=0.1)  # flat rows: the top token holds far more than 1e-3 but < 0.2
    kept = torch.isfinite(top_p_filter(x, p))
    assert kept.gather(-1, x.argmax(-1, keepdim=True)).all()
    if p < 0.01:
        assert (kept.sum(-1) == 1).all()


def test_top_p_at_exactly_the_boundary_cuts_what_lies_ahead_of_p():
    # probabilities 0.5, 0.25, 0.25 exactly (powers of two survive softmax and cumsum unrounded), in
    # fp32 and fp64. At p = 0.5 the top token alone holds p: the two behind it have 0.5 ahead of
    # them, not less than p, so both are cut (a `>=` in place of `>` keeps them); at p = 0.75 they
    # have 0.5 ahead, less than p, and both stay.
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([0.0, math.log(2.0), 0.0], dtype=dtype)
        assert torch.softmax(x, -1).tolist() == [0.25, 0.5, 0.25]
        assert torch.isfinite(top_p_filter(x, 0.5)).tolist() == [False, True, False]
        assert torch.isfinite(top_p_filter(x, 0.75)).tolist() == [True, True, True]


def test_top_p_of_one_keeps_everything_even_underflowing_tokens():
    x = torch.tensor([[0.0, -1e4, -50.0, 3.0], [float("-inf"), 1.0, 2.0, 2.0]])
    assert torch.equal(top_p_filter(x, 1.0), x)
    assert torch.equal(top_p_filter(x, 1), x)


def test_top_p_keeps_or_cuts_tied_tokens_together_whatever_their_order():
    x = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0])  # probabilities 0.447, 3 × 0.164, 0.060
    assert torch.isfinite(top_p_filter(x, 0.6)).tolist() == [True, True, True, True, False]  # 0.447 ahead < 0.6
    assert torch.isfinite(top_p_filter(x, 0.4)).tolist() == [True, False, False, False, False]
    perm = torch.tensor([3, 0, 4, 1, 2])
    for p in (0.4, 0.6, 0.95):
        assert torch.equal(top_p_filter(x[perm], p), top_p_filter(x, p)[perm])


@pytest.mark.parametrize("V", [1, 2, 17, 500])
@pytest.mark.parametrize("p", [0.01, 0.25, 0.5, 0.9, 0.99])
def test_top_p_equals_hugging_faces_warper_on_untied_rows(V, p):
    x = random_logits(32, V, seed=V, shift=-5.0)
    assert untied(x)
    assert torch.equal(top_p_filter(x, p), TopPLogitsWarper(top_p=p)(None, x))


def test_top_p_works_in_half_precision_and_keeps_the_dtype():
    x = random_logits(4, 64, seed=2, dtype=torch.bfloat16)
    out = top_p_filter(x, 0.7)
    assert out.dtype == torch.bfloat16
    assert torch.equal(torch.isfinite(out), torch.isfinite(top_p_filter(x.float(), 0.7)))


# --------------------------------------------------------------------------- the chain
@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [None, 1, 5, 100])
@pytest.mark.parametrize("top_p", [None, 0.1, 0.9])
def test_filter_logits_equals_hugging_faces_warper_chain(temperature, top_k, top_p):
    x = random_logits(16, 60, seed=7)
    hf = TemperatureLogitsWarper(float(temperature))(None, x)
    if top_k is not None:
        hf = TopKLogitsWarper(top_k=top_k)(None, hf)
    if top_p is not None:
        hf = TopPLogitsWarper(top_p=top_p)(None, hf)
    assert torch.equal(filter_logits(x, temperature=temperature, top_k=top_k, top_p=top_p), hf)


def test_filters_act_row_by_row_on_any_leading_shape_and_on_strided_views():
    x = random_logits(12, 40, seed=10).view(3, 4, 40)
    knobs = {"temperature": 0.8, "top_k": 10, "top_p": 0.7}
    rows = torch.stack([filter_logits(x[i], **knobs) for i in range(3)])
    assert torch.equal(filter_logits(x, **knobs), rows)
    last = x[:, -1, :]  # (B, T, V)[:, -1]: a non-contiguous view, as generate takes it
    assert not last.is_contiguous()
    assert torch.equal(filter_logits(last, **knobs), filter_logits(last.contiguous(), **knobs))
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert torch.equal(
        sample_next_token(last, generator=g(), **knobs), sample_next_token(last.contiguous(), generator=g(), **knobs)
    )


def test_apply_temperature_divides():
    x = random_logits(2, 5, seed=0)
    assert torch.equal(apply_temperature(x, 0.5), x / 0.5)
    assert torch.equal(apply_temperature(x, 2), x / 2)


def test_filter_logits_at_temperature_zero_keeps_only_the_argmax():
    x = random_logits(8, 12, seed=3)
    out = filter_logits(x, temperature=0.0, top_k=5, top_p=0.5)
    kept = torch.isfinite(out)
    assert (kept.sum(-1) == 1).all() and kept.gather(-1, x.argmax(-1, keepdim=True)).all()


# --------------------------------------------------------------------------- sampling
def test_temperature_zero_is_greedy_argmax_whatever_top_k_and_top_p():
    x = random_logits(64, 33, seed=4)
    for knobs in ({}, {"top_k": 3}, {"top_p": 0.01}, {"top_k": 40, "top_p": 1.0}):
        assert torch.equal(sample_next_token(x, temperature=0, **knobs), x.argmax(-1))
    assert sample_next_token(x, temperature=0.0).dtype == torch.int64


def test_same_generator_seed_gives_the_same_tokens():
    x = random_logits(256, 50, seed=5, scale=1.0)
    draw = lambda seed: sample_next_token(
        x,
        temperature=1.3,
        top_k=20,
        top_p=0.9,  # noqa: E731
        generator=torch.Generator().manual_seed(seed),
    )
    a, b, c = draw(0), draw(0), draw(1)
    assert a.shape == (256,) and a.dtype == torch.int64
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_of_one_always_samples_the_argmax():
    x = random_logits(500, 20, seed=6, scale=0.5)
    g = torch.Generator().manual_seed(0)
    for temperature in (0.5, 1.0, 2.0):
        assert torch.equal(sample_next_token(x, temperature=temperature, top_k=1, generator=g), x.argmax(-1))


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"temperature": 0.7, "top_k": 4},
        {"temperature": 1.5, "top_p": 0.8},
        {"temperature": 0.9, "top_k": 5, "top_p": 0.9},
    ],
)
def test_empirical_frequencies_match_p_final(knobs):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, float("-inf")])  # the last token is banned
    V, N = logits.shape[0], 20_000
    p_final = next_token_distribution(logits, **knobs)["p_final"].double()
    ids = sample_next_token(logits.expand(N, V), generator=torch.Generator().manual_seed(0), **knobs)
    freq = torch.bincount(ids, minlength=V).double() / N
    # Each count is Binomial(N, p): standard error sqrt(p(1 - p) / N) <= 0.0036 here. Five of them
    # leave a false alarm with probability ~6e-7 per token (and the seed is fixed anyway).
    se = torch.sqrt(p_final * (1 - p_final) / N)
    assert (torch.abs(freq - p_final) <= 5 * se + 1e-12).all(), (freq, p_final)
    assert (freq[p_final == 0] == 0).all()


@pytest.mark.parametrize("knobs", [{"top_k": 3}, {"top_p": 0.5}, {"temperature": 2.0, "top_k": 10, "top_p": 0.7}])
def test_sampling_never_draws_a_filtered_token(knobs):
    x = random_logits(2000, 25, seed=8, scale=1.0)
    ids = sample_next_token(x, generator=torch.Generator().manual_seed(1), **knobs)
    kept = torch.isfinite(filter_logits(x, **knobs))
    assert kept.gather(-1, ids[:, None]).all()


def test_sampling_never_draws_a_minus_infinity_logit():
    x = torch.full((1000, 6), float("-inf"))
    x[:, 2], x[:, 4] = 0.0, 1.0
    ids = sample_next_token(x, temperature=1.5, generator=torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {2, 4}


# --------------------------------------------------------------------------- the widget's numbers
@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"temperature": 0.5},
        {"temperature": 2.0, "top_k": 5},
        {"top_p": 0.6},
        {"temperature": 0.8, "top_k": 7, "top_p": 0.9},
        {"top_k": 100},
        {"top_p": 0.001},
        {"temperature": 0.0, "top_k": 3},
    ],
)
def test_next_token_distribution_is_the_sampled_distribution(knobs):
    logits = random_logits(1, 30, seed=9)[0]
    d = next_token_distribution(logits, **knobs)
    assert set(d) == {"p_raw", "p_tempered", "kept_by_top_k", "kept_by_top_p", "kept", "p_final"}
    for name in ("p_raw", "p_tempered", "p_final"):
        assert d[name].shape == (30,) and d[name].dtype == torch.float32
    for name in ("kept_by_top_k", "kept_by_top_p", "kept"):
        assert d[name].shape == (30,) and d[name].dtype == torch.bool
    assert torch.allclose(d["p_raw"], torch.softmax(logits, -1))
    assert math.isclose(d["p_final"].sum().item(), 1.0, rel_tol=1e-6)
    assert (d["p_final"][~d["kept"]] == 0).all() and (d["p_final"][d["kept"]] > 0).all()
    # sample_next_token draws from softmax(filter_logits(...)) of the max-shifted logits: bit for bit
    shifted = logits - logits.max()
    assert torch.allclose(d["p_final"], torch.softmax(filter_logits(shifted, **knobs), -1), atol=0, rtol=0)
    # fp32: the shift moves each probability by a rounding error at most
    assert torch.allclose(d["p_final"], torch.softmax(filter_logits(logits, **knobs), -1), atol=1e-6, rtol=1e-5)
    assert torch.equal(d["kept"], torch.isfinite(filter_logits(logits, **knobs)))
    if knobs.get("temperature", 1.0) == 0:
        assert d["kept"].sum() == 1 and d["kept_by_top_k"].all() and d["kept_by_top_p"].all()
        assert torch.equal(d["p_tempered"], d["p_final"])
    else:
        T = knobs.get("temperature", 1.0)
        assert torch.allclose(d["p_tempered"], torch.softmax(logits / T, -1))
        assert torch.equal(d["kept"], d["kept_by_top_k"] & d["kept_by_top_p"])
        if "top_k" not in knobs:
            assert d["kept_by_top_k"].all()
        if "top_p" not in knobs:
            assert d["kept_by_top_p"].all()


def test_next_token_distribution_blames_each_cut_on_one_filter():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, -1.0])
    d = next_token_distribution(logits, top_k=4, top_p=0.8)
    # top-k leaves tokens 0-3 (mass 0.66, 0.24, 0.09, 0.05 after renormalising); top-p 0.8 keeps 0-1
    assert d["kept_by_top_k"].tolist() == [True, True, True, True, False, False]
    assert d["kept_by_top_p"].tolist() == [True, True, False, False, True, True]
    assert d["kept"].tolist() == [True, True, False, False, False, False]


# --------------------------------------------------------------------------- bad inputs
X = random_logits(2, 5, seed=0)


_FINITE = "must be a finite number"
KNOB_REFUSALS = [
    ("temperature", -0.1, ValueError, f"temperature {_FINITE} >= 0, got -0.1"),
    ("temperature", float("nan"), ValueError, f"temperature {_FINITE} >= 0, got nan"),
    ("temperature", "hot", TypeError, "temperature must be a real number, got str"),
    ("top_k", 0, ValueError, "top_k must be >= 1, got 0"),
    ("top_k", 2.5, TypeError, "top_k must be an int, got float"),
    ("top_k", True, TypeError, "top_k must be an int, got bool"),
    ("top_p", 0, ValueError, f"top_p {_FINITE} > 0 or None, got 0"),
    ("top_p", -0.2, ValueError, f"top_p {_FINITE} > 0 or None, got -0.2"),
    ("top_p", 1.5, ValueError, "top_p must be in (0, 1], got 1.5"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(KNOB_REFUSALS))
@pytest.mark.parametrize("fn", [sample_next_token, filter_logits, next_token_distribution], ids=lambda f: f.__name__)
def test_knob_refusals(fn, argument, bad, error, message):
    assert_refuses(fn, {"logits": X[0] if fn is next_token_distribution else X}, argument, bad, error, message)


_NO_NAN = "logits must hold finite values or -inf (no NaN, no +inf)"
# fmt: off
SAMPLE_REFUSALS = [
    ("generator", 0, TypeError, "generator must be a torch.Generator or None, got int"),
    ("logits", torch.arange(10).view(2, 5), TypeError, not_float("logits")),
    ("logits", X[0], ValueError, "logits must have shape (B, V) (2 dims), got (5,)"),
    ("logits", X[None], ValueError, "logits must have shape (B, V) (2 dims), got (1, 2, 5)"),
    ("logits", torch.tensor([[0.0, float("nan")]]), ValueError, _NO_NAN),
    ("logits", torch.tensor([[0.0, float("inf")]]), ValueError, _NO_NAN),
    ("logits", torch.full((2, 3), float("-inf")), ValueError,
     "logits has a row that is all -inf: no token left to choose"),
    ("logits", torch.zeros(2, 0), ValueError, "logits must have shape (B, V) with every size >= 1, got (2, 0)"),
    ("logits", [[0.0, 1.0]], TypeError, "logits must be a torch.Tensor, got list"),
]
# fmt: on
test_sample_next_token_refusals = refusal_test(sample_next_token, {"logits": X}, SAMPLE_REFUSALS)


@pytest.mark.parametrize(
    "fn, args, error, message",
    [
        (
            apply_temperature,
            (X, 0),
            ValueError,
            "temperature must be > 0 here (callers treat 0 as greedy decoding), got temperature=0",
        ),
        (top_k_filter, (X, 0), ValueError, "k must be >= 1, got 0"),
        (top_p_filter, (X, 0.0), ValueError, f"p {_FINITE} > 0, got 0.0"),
        (top_p_filter, (X, 1.5), ValueError, "p must be in (0, 1], got 1.5"),
        (top_p_filter, (torch.tensor([float("nan"), 0.0]), 0.5), ValueError, _NO_NAN),
        (next_token_distribution, (X,), ValueError, "logits must have shape (V,) (1 dim), got (2, 5)"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_the_filters_refusals(fn, args, error, message):
    with pytest.raises(error) as info:
        fn(*args)
    assert str(info.value) == message


def test_a_tiny_temperature_is_greedy_not_nan():
    logits = random_logits(3, 40, seed=2) * 50
    assert torch.equal(
        sample_next_token(logits, temperature=1e-30, generator=torch.Generator().manual_seed(0)), logits.argmax(-1)
    )
    d = next_token_distribution(logits[0], temperature=1e-30)
    assert torch.equal(d["p_final"], torch.nn.functional.one_hot(logits[0].argmax(), 40).float())
