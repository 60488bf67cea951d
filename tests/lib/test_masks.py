"""lib.masks: every mask is 0/-inf, has the pattern its name promises, and rejects bad input."""

import pytest
import torch

from lib.masks import (
    MASK_KINDS,
    additive_from_bool,
    bidirectional_mask,
    build_mask,
    causal_mask,
    combine_masks,
    cross_attention_mask,
    padding_mask,
    prefix_lm_mask,
    sliding_window_mask,
)

NEG_INF = float("-inf")


def allowed(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "may attend" view of an additive mask, after checking it holds only 0 and -inf."""
    assert bool(((mask == 0) | torch.isneginf(mask)).all()), "an additive mask holds only 0 and -inf"
    return mask == 0


@pytest.mark.parametrize("T", [1, 2, 7, 16])
def test_causal_mask_blocks_exactly_the_future(T):
    m = causal_mask(T)
    assert m.shape == (T, T) and m.dtype == torch.float32
    i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    assert torch.equal(allowed(m), j <= i)


@pytest.mark.parametrize("T", [1, 5, 12])
def test_causal_mask_equals_triu_and_tril_constructions(T):
    via_triu = torch.full((T, T), NEG_INF).triu(diagonal=1)
    tril = torch.tril(torch.ones(T, T))
    via_tril = torch.zeros(T, T).masked_fill(tril == 0, NEG_INF)
    assert torch.equal(causal_mask(T), via_triu)
    assert torch.equal(causal_mask(T), via_tril)


def test_causal_mask_with_kv_len_aligns_queries_to_the_last_positions():
    m = causal_mask(2, kv_len=5)  # two new queries at positions 3 and 4 of a 5-long cache
    assert torch.equal(allowed(m), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(1, kv_len=9), torch.zeros(1, 9))  # one decode step sees everything


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_masks_honour_dtype(dtype):
    for m in (causal_mask(4, dtype=dtype), prefix_lm_mask(4, 2, dtype=dtype), sliding_window_mask(4, 2, dtype=dtype)):
        assert m.dtype == dtype
        allowed(m)


def test_padding_mask_blocks_padding_keys_for_every_query():
    keep = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    m = padding_mask(keep)
    assert m.shape == (2, 1, 1, 5)
    assert torch.equal(allowed(m)[:, 0, 0], keep.bool())
    assert torch.equal(padding_mask(keep.float()), m)  # float 0/1 masks are accepted too


def test_prefix_lm_mask_is_bidirectional_in_the_prefix_and_causal_after():
    T, P = 6, 3
    a = allowed(prefix_lm_mask(T, P))
    assert a[:P, :P].all()  # prefix sees the whole prefix, both ways
    assert not a[:P, P:].any()  # prefix does not see the suffix
    assert a[P:, :P].all()  # suffix sees the whole prefix
    assert torch.equal(a[P:, P:], allowed(causal_mask(T - P)))  # causal among the suffix
    assert torch.equal(prefix_lm_mask(T, 0), causal_mask(T))  # no prefix: GPT
    assert torch.equal(prefix_lm_mask(T, T), bidirectional_mask(T))  # all prefix: BERT


@pytest.mark.parametrize("window", [1, 2, 3, 10])
def test_sliding_window_sees_the_last_window_keys(window):
    T = 8
    a = allowed(sliding_window_mask(T, window))
    i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    assert torch.equal(a, (j <= i) & (i - j < window))
    assert torch.equal(a.sum(-1), torch.clamp(torch.arange(1, T + 1), max=window))
    two_sided = allowed(sliding_window_mask(T, window, causal=False))
    assert torch.equal(two_sided, (i - j).abs() < window)
    if window >= T:
        assert torch.equal(sliding_window_mask(T, window), causal_mask(T))


def test_combine_masks_blocks_what_any_mask_blocks():
    keep = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    combined = combine_masks(causal_mask(4), None, padding_mask(keep))
    assert combined.shape == (2, 1, 4, 4)
    expected = allowed(causal_mask(4))[None, None] & keep.bool()[:, None, None, :]
    assert torch.equal(allowed(combined), expected)
    assert combine_masks() is None and combine_masks(None) is None


def test_build_mask_covers_the_zoo():
    for kind in MASK_KINDS:
        m = build_mask(kind, 5, prefix_len=2, window=2)
        allowed(m)
        assert torch.equal(torch.diagonal(m), torch.zeros(5))  # every query always sees itself


def test_cross_attention_mask_is_rectangular_and_blocks_only_encoder_padding():
    enc = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 0, 0]])  # padding on both sides in row 1
    m = cross_attention_mask(enc, tgt_len=3)
    assert m.shape == (2, 1, 3, 5)  # T = 3 decoder queries, S = 5 encoder keys
    keep = allowed(m)
    assert torch.equal(keep, enc.bool()[:, None, None, :].expand(2, 1, 3, 5))  # per key, never causal
    assert torch.equal(cross_attention_mask(enc, 1)[:, :, 0], padding_mask(enc)[:, :, 0])


def test_additive_from_bool_maps_true_to_zero():
    keep = torch.tensor([[True, False], [False, True]])
    assert torch.equal(additive_from_bool(keep), torch.tensor([[0.0, NEG_INF], [NEG_INF, 0.0]]))


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: causal_mask(0), ValueError, "seq_len"),
        (lambda: causal_mask(3.0), TypeError, "seq_len"),
        (lambda: causal_mask(True), TypeError, "seq_len"),
        (lambda: causal_mask(4, kv_len=2), ValueError, "kv_len"),
        (lambda: causal_mask(4, dtype=torch.int64), TypeError, "dtype"),
        (lambda: prefix_lm_mask(4, 5), ValueError, "prefix_len"),
        (lambda: prefix_lm_mask(4, -1), ValueError, "prefix_len"),
        (lambda: sliding_window_mask(4, 0), ValueError, "window"),
        (lambda: padding_mask(torch.ones(5)), ValueError, "(B, T)"),
        (lambda: padding_mask([[1, 0]]), TypeError, "attention_mask"),
        (lambda: padding_mask(torch.tensor([[1, 2]])), ValueError, "only 0"),
        (lambda: additive_from_bool(torch.ones(2, 2)), TypeError, "torch.bool"),
        (lambda: combine_masks(torch.zeros(2, 3), torch.zeros(4, 3)), ValueError, "broadcast"),
        (lambda: combine_masks(torch.zeros(2, 2, dtype=torch.bool)), TypeError, "floating"),
        (lambda: build_mask("diagonal", 4), ValueError, "kind"),
        (lambda: cross_attention_mask(torch.ones(2, 3), 0), ValueError, "tgt_len"),
        (lambda: cross_attention_mask(torch.ones(3), 2), ValueError, "(B, T)"),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        call()
