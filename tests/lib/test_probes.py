"""lib.probes scores read attention weights: each is 1 on the pattern it names, about 1/(t+1) on an
even causal spread, shaped per layer and head, and refuses weights it cannot score."""

import pytest
import torch
from refusals import built, not_float, refusal_test

from lib.masks import causal_mask
from lib.probes import induction_score, key_share, previous_token_score, repeated_random_tokens


def pattern(T, target):
    """(1, 1, T, T) weights: query t puts all its weight on key target(t)."""
    w = torch.zeros(1, 1, T, T)
    for t in range(T):
        w[0, 0, t, target(t)] = 1.0
    return w


def uniform_causal(T):
    return torch.softmax(causal_mask(T), dim=-1)[None, None]  # (1, 1, T, T): 1/(t + 1) on keys <= t


def test_each_score_is_one_on_its_own_pattern_and_low_elsewhere():
    T, P = 12, 5
    sink = pattern(T, lambda t: 0)
    prev = pattern(T, lambda t: max(t - 1, 0))
    induct = pattern(T, lambda t: t - P + 1 if P <= t < 2 * P else t)
    assert key_share(sink).item() == 1.0 and previous_token_score(sink).item() < 0.1
    assert previous_token_score(prev).item() == 1.0 and key_share(prev).item() < 0.1
    assert induction_score(induct, P).item() == 1.0 and induction_score(prev, P).item() == 0.0
    assert (
        induction_score(pattern(T + 2, lambda t: t - P + 1 if P + 2 <= t < 2 * P + 2 else 0), P, start=2).item() == 1.0
    )


def test_an_even_causal_spread_scores_one_over_the_keys_seen():
    T = 8
    w = uniform_causal(T)
    expected = sum(1 / (t + 1) for t in range(1, T)) / (T - 1)  # queries 1..T-1 on key 0, or on t - 1
    torch.testing.assert_close(key_share(w), torch.tensor([expected], dtype=torch.float64))
    torch.testing.assert_close(previous_token_score(w), torch.tensor([expected], dtype=torch.float64))


def test_an_encoder_share_counts_every_query_and_the_end_is_reachable():
    T = 6
    sep = pattern(T, lambda t: T - 1)  # every query on the last token, as BERT heads do on [SEP]
    assert key_share(sep, key=-1, after_only=False).item() == 1.0
    assert key_share(sep, key=0, after_only=False).item() == 0.0
    half = pattern(T, lambda t: 0 if t % 2 else T - 1)
    assert key_share(half, key=0, after_only=False).item() == 0.5


def test_layers_and_heads_keep_their_places():
    T = 10
    layers = [
        torch.cat([pattern(T, lambda t: 0), pattern(T, lambda t: max(t - 1, 0))], dim=1),  # layer 0: 2 heads
        torch.cat([pattern(T, lambda t: max(t - 1, 0)), pattern(T, lambda t: 0)], dim=1),
    ]
    layers = [torch.cat([w, w]) for w in layers]  # batch of 2
    share = key_share(layers)
    assert share.shape == (2, 2) and share[0, 0] == 1 and share[1, 1] == 1 and share[0, 1] < 0.2
    assert torch.equal(previous_token_score(layers), torch.tensor([[1 / 9, 1.0], [1.0, 1 / 9]], dtype=torch.float64))


def test_repeated_random_tokens_repeat_a_block_of_distinct_ids():
    ids = repeated_random_tokens(6, 50, batch=3, seed=1, low=10, prefix=[1])
    assert ids.shape == (3, 13) and torch.all(ids[:, 0] == 1)
    assert torch.equal(ids[:, 1:7], ids[:, 7:]) and ids[:, 1:].min() >= 10 and ids.max() < 50
    assert all(len(set(row[1:7].tolist())) == 6 for row in ids)
    assert torch.equal(ids, repeated_random_tokens(6, 50, batch=3, seed=1, low=10, prefix=[1]))


def test_bad_weights_get_clear_errors():
    with pytest.raises(ValueError, match="needs T >= 10"):
        induction_score(uniform_causal(8), 5)
    with pytest.raises(ValueError, match="fewer than period=6 distinct ids"):
        repeated_random_tokens(6, 10, low=5)


# fmt: off
KEY_SHARE_REFUSALS = [
    ("weights", torch.rand(1, 2, 3, 5, generator=torch.Generator().manual_seed(0)), ValueError,
     "weights must be self-attention over the same positions (T == S), got T=3, S=5"),
    ("key", 3, ValueError, "after_only needs a later query: key < T - 1 = 3, got 3"),
    ("key", 4, ValueError, "key must be an int position in [-T, T) = [-4, 4), got 4"),
    ("key", True, ValueError, "key must be an int position in [-T, T) = [-4, 4), got True"),
    ("weights", [], ValueError, "weights must hold at least one layer's (B, H, T, S) tensor"),
]
# fmt: on
test_key_share_refusals = refusal_test(
    key_share, built(lambda: dict(weights=uniform_causal(4), key=0)), KEY_SHARE_REFUSALS
)


# fmt: off
PREVIOUS_TOKEN_SCORE_REFUSALS = [
    ("weights", [uniform_causal(4), uniform_causal(5)], ValueError,
     "every layer's weights must share one shape (B, H, T, S), got [(1, 1, 4, 4), (1, 1, 5, 5)]"),
    ("weights", torch.ones(1, 1, 3, 3, dtype=torch.long), TypeError, not_float("weights")),
    ("weights", uniform_causal(1), ValueError, "weights need T >= 2 positions for a previous token"),
    ("weights", torch.ones(3, 3), ValueError, "weights must be (B, H, T, S) per layer, got (3, 3)"),
]
# fmt: on
test_previous_token_score_refusals = refusal_test(
    previous_token_score, built(lambda: dict(weights=uniform_causal(4))), PREVIOUS_TOKEN_SCORE_REFUSALS
)
