"""lib.toy: the tokenizer, padding with its attention mask, the toy q/k/v and the sinusoidal positions follow
their definitions."""

import pytest
import torch

from lib.toy import PAD, pad_tokens, simple_tokenize, sinusoidal_positions, toy_qkv


def test_tokenizer_splits_words_and_punctuation():
    assert simple_tokenize("The cat sat, on the mat.") == ["the", "cat", "sat", ",", "on", "the", "mat", "."]
    assert simple_tokenize("[PAD] Hi") == [PAD, "hi"]
    assert simple_tokenize("") == []
    with pytest.raises(TypeError, match="text"):
        simple_tokenize(None)


def test_pad_tokens_builds_the_attention_mask():
    toks, keep = pad_tokens(["a", "b"], 2, "left")
    assert toks == [PAD, PAD, "a", "b"] and keep.tolist() == [[0, 0, 1, 1]]
    toks, keep = pad_tokens(["a"], 0)
    assert toks == ["a"] and keep.tolist() == [[1]]
    with pytest.raises(ValueError, match="side"):
        pad_tokens(["a"], 1, "top")
    with pytest.raises(ValueError, match="n_pad"):
        pad_tokens(["a"], -1)


def test_toy_qkv_is_deterministic_per_token_and_unit_scaled():
    q1, k1, v1 = toy_qkv(["the", "cat", "the"], d_k=16)
    q2, _, _ = toy_qkv(["the", "cat", "the"], d_k=16)
    assert torch.equal(q1, q2) and q1.shape == (1, 1, 3, 16)
    assert not torch.equal(q1[0, 0, 0], q1[0, 0, 2])  # positions keep two copies of a word apart
    q, k, _ = toy_qkv([f"w{i}" for i in range(200)], d_k=64)
    scores = q @ k.transpose(-2, -1) / 8.0
    assert 0.6 < scores.var().item() < 1.6  # ≈ 1 by construction: the scale the lesson relies on
    with pytest.raises(ValueError, match="tokens"):
        toy_qkv([])
    with pytest.raises(TypeError, match="tokens"):
        toy_qkv("the cat")


def test_sinusoidal_positions_follow_the_formula():
    pe = sinusoidal_positions(5, 8)
    assert torch.allclose(pe[:, 0], torch.sin(torch.arange(5.0)))
    assert torch.allclose(pe[:, 1], torch.cos(torch.arange(5.0)))
    assert torch.allclose(pe[3, 2], torch.sin(torch.tensor(3.0) / 10000 ** (2 / 8)))
