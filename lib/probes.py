"""What trained attention heads do, measured on their weights: sinks, previous-token and induction heads.

Each score reads attention weights, softmax(QKᵀ/√D + M) for every head, as a model returns them
(`lib.llama.Llama` or `lib.bert.Bert` with `return_attentions=True`): a list of L tensors
(B, H, T, S), or one such tensor. Scores are averages of weights, so 1 means "every query puts all
its attention there" and a head that spreads attention evenly over t + 1 causal keys scores about
1/(t + 1).

    key_share(weights, key)         the mean weight each head puts on one key position, over the
                                    queries after it (or all queries, for an encoder): key 0's
                                    share is the "attention sink" of Xiao et al. 2023
                                    ("Efficient Streaming Language Models with Attention
                                    Sinks", arXiv 2309.17453)
    previous_token_score(weights)   the mean weight on the key just before each query (t - 1)
    induction_score(weights, period)  on a random block of `period` tokens repeated, the mean
                                    weight each query in the second copy puts on the token that
                                    followed its own earlier occurrence (key t - period + 1): the
                                    induction heads of Olsson et al. 2022 ("In-context Learning and
                                    Induction Heads", transformer-circuits.pub), which copy
                                    [A][B] ... [A] -> [B]
    repeated_random_tokens(...)     such a sequence: `period` random ids, then the same ids again

Glossary: L layers, B batch, H heads, T queries, S keys (S = T without a cache).
"""

from __future__ import annotations

import torch

from lib._checks import require_int, require_tensor

__all__ = ["induction_score", "key_share", "previous_token_score", "repeated_random_tokens"]


def _stack(weights) -> torch.Tensor:
    """A (B, H, T, S) tensor or a list of L of them -> (L, B, H, T, S) in float64."""
    if isinstance(weights, (list, tuple)):
        if not weights:
            raise ValueError("weights must hold at least one layer's (B, H, T, S) tensor")
        for i, w in enumerate(weights):
            require_tensor(f"weights[{i}]", w, floating=True)
        if any(w.shape != weights[0].shape for w in weights):
            raise ValueError(
                f"every layer's weights must share one shape (B, H, T, S), got "
                f"{sorted({tuple(w.shape) for w in weights})}"
            )
        w = torch.stack(list(weights))
    else:
        w = require_tensor("weights", weights, floating=True)[None]
    if w.dim() != 5:
        raise ValueError(f"weights must be (B, H, T, S) per layer, got {tuple(w.shape[1:])}")
    if w.shape[3] != w.shape[4]:
        raise ValueError(
            f"weights must be self-attention over the same positions (T == S), got T={w.shape[3]}, S={w.shape[4]}"
        )
    return w.double()


def _squeeze(score: torch.Tensor, weights) -> torch.Tensor:
    """(L, H) for a list of layers, (H,) for one tensor."""
    return score if isinstance(weights, (list, tuple)) else score[0]


def key_share(weights, key: int = 0, *, after_only: bool = True) -> torch.Tensor:
    """Per layer and head, the weight queries put on key position `key` (negative counts from the
    end: -1 is the last token), averaged over queries and the batch -> (L, H), or (H,) for one
    tensor. With `after_only` (for a causal model) only the queries after `key` count: the query at
    `key` itself has nothing else to look at when key = 0, and earlier ones cannot see it. Without
    it (a bidirectional encoder) every query counts."""
    w = _stack(weights)
    T = w.shape[3]
    if isinstance(key, bool) or not isinstance(key, int) or not -T <= key < T:
        raise ValueError(f"key must be an int position in [-T, T) = [{-T}, {T}), got {key!r}")
    key = key % T
    if not after_only:
        return _squeeze(w[:, :, :, :, key].mean(dim=(1, 3)), weights)
    if key >= T - 1:
        raise ValueError(f"after_only needs a later query: key < T - 1 = {T - 1}, got {key}")
    return _squeeze(w[:, :, :, key + 1 :, key].mean(dim=(1, 3)), weights)


def previous_token_score(weights) -> torch.Tensor:
    """Per layer and head, the mean weight of query t on key t - 1 (t >= 1) -> (L, H) or (H,)."""
    w = _stack(weights)
    if w.shape[3] < 2:
        raise ValueError("weights need T >= 2 positions for a previous token")
    prev = torch.diagonal(w, offset=-1, dim1=3, dim2=4)  # (L, B, H, T - 1): w[t, t - 1]
    return _squeeze(prev.mean(dim=(1, 3)), weights)


def induction_score(weights, period: int, start: int = 0) -> torch.Tensor:
    """Per layer and head, on a sequence whose positions start+period .. start+2·period-1 repeat
    positions start .. start+period-1: the mean weight of each query t of the second copy on key
    t - period + 1, the token that followed the current token's first occurrence -> (L, H) or (H,)."""
    w = _stack(weights)
    require_int("period", period, minimum=2)
    require_int("start", start, minimum=0)
    T = w.shape[3]
    if T < start + 2 * period:
        raise ValueError(
            f"weights cover T={T} positions; a block of period={period} from position {start}, "
            f"repeated once, needs T >= {start + 2 * period}"
        )
    queries = torch.arange(start + period, start + 2 * period, device=w.device)  # the second copy
    targets = queries - period + 1  # the token after the earlier occurrence
    return _squeeze(w[:, :, :, queries, targets].mean(dim=(1, 3)), weights)


def repeated_random_tokens(
    period: int, vocab: int, *, batch: int = 1, seed: int = 0, low: int = 0, prefix: list[int] | None = None
) -> torch.Tensor:
    """(batch, len(prefix) + 2·period) int64 ids: `prefix` (e.g. a start token), then `period` ids
    drawn uniformly from [low, vocab) without repeats within a row, then the same `period` ids again."""
    require_int("period", period, minimum=2)
    require_int("vocab", vocab, minimum=1)
    require_int("batch", batch, minimum=1)
    require_int("low", low, minimum=0)
    if vocab - low < period:
        raise ValueError(f"[low, vocab) = [{low}, {vocab}) has fewer than period={period} distinct ids")
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(vocab - low, generator=g)[:period] + low for _ in range(batch)])  # (B, P)
    head = torch.tensor(prefix or [], dtype=torch.long).expand(batch, -1)
    return torch.cat([head, rows, rows], dim=1)
