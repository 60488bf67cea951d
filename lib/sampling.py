"""Choosing the next token: temperature, top-k and top-p (nucleus) filtering, then a draw.

    apply_temperature        logits / temperature
    top_k_filter             keep the k highest logits of each row (Fan et al. 2018, arXiv 1805.04833)
    top_p_filter             keep the smallest most-probable set holding mass p: nucleus sampling
                             (Holtzman et al. 2019, arXiv 1904.09751)
    filter_logits            temperature, then top-k, then top-p: the order of Hugging Face's
                             generate (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    sample_next_token        one token id per row: greedy at temperature 0, else a draw from
                             softmax(filter_logits(...))
    next_token_distribution  every intermediate distribution for one row (drives the sampling widget)

Glossary: B batch, V vocabulary.

Conventions:
- A filtered token gets the logit −inf, so softmax gives it probability exactly 0 and the
  remaining tokens are renormalised: softmax(filter_logits(...)) is the distribution sampled from.
- Temperature 0 means greedy decoding (the argmax; the first one on ties, as torch.argmax picks).
  `apply_temperature` refuses it; `filter_logits` keeps only the argmax; `sample_next_token`
  returns the argmax without drawing.
- The filters act on the last dimension of (..., V); their results keep the input's dtype, while
  fp16/bf16 probabilities are computed in float32.
"""

from __future__ import annotations

import torch

from lib._door import door

__all__ = [
    "SAMPLING_KNOBS",
    "apply_temperature",
    "filter_logits",
    "next_token_distribution",
    "sample_next_token",
    "top_k_filter",
    "top_p_filter",
]

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- the contract
SAMPLING_KNOBS = door(
    logits="logits (..., V)",
    temperature="real >= 0",
    top_k="int >= 1 | None",
    top_p="real > 0 | None",
    generator="instance torch.Generator | None",
    where={"top_p is None or top_p <= 1": "top_p must be in (0, 1], got {top_p!r}"},
)


def _work(logits: torch.Tensor) -> torch.Tensor:
    """Probabilities of fp16/bf16 logits are computed in float32."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


# --------------------------------------------------------------------------- the filters
@SAMPLING_KNOBS.plus(where={"temperature > 0": "temperature must be > 0 here (callers treat 0 as greedy decoding)"})
def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature: T < 1 sharpens the distribution, T > 1 flattens it; T > 0 here."""
    return logits / float(temperature)


@door(logits="logits (..., V)", k="int >= 1")
def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to −inf; logits (..., V) -> (..., V).

    Ties with the k-th largest value are kept, so a row may keep more than k tokens when values
    repeat (the convention of Hugging Face's TopKLogitsWarper and nanoGPT: `x < kth` is cut).
    k >= V returns an unchanged copy.
    """
    if k >= logits.shape[-1]:
        return logits.clone()
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, NEG_INF)


@door(logits="logits (..., V)", p="real > 0", where={"p <= 1": "p must be in (0, 1], got {p!r}"})
def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most probable tokens holding mass p; (..., V).

    The rule, with probabilities softmax(logits) of each row: a token is kept iff the tokens
    strictly more probable than it hold less than p of the mass together. On a row without ties,
    walking the tokens from most to least probable, the kept ones are the shortest prefix whose
    mass reaches p (>= p): removing its least probable member leaves less than p. The most probable
    token is always kept (nothing is ahead of it and p > 0). Tokens with equal logits are kept or
    cut together, so the result does not depend on how a sort orders equal values; with ties at the
    boundary the kept set can hold more than the minimal mass. p == 1 keeps everything (a copy).

    The comparison is computed as Hugging Face's TopPLogitsWarper (min_tokens_to_keep=1) computes
    it: sort ascending, c = cumulative sum of the probabilities, cut where c <= 1 - p. For a token,
    c is its own probability plus everything less probable, i.e. 1 minus the mass ahead of it, so
    this is the rule above, and on untied rows with p < 1 the two agree bit for bit. They differ
    only on ties (HF keeps whichever tied tokens its sort happens to place last) and at p == 1
    (HF's warper still cuts tokens whose probability underflows to 0; HF's generate does not run
    the warper at top_p = 1).
    """
    if p == 1.0:
        return logits.clone()
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending: the most probable token is last
    cum = torch.softmax(_work(sorted_logits), dim=-1).cumsum(dim=-1)  # (..., V)
    keep = cum > 1.0 - p
    keep[..., -1] = True
    # A group of equal logits is kept iff its last (highest-c) member is: c there is 1 minus the
    # mass strictly more probable than the group.
    last_of_group = torch.searchsorted(sorted_logits.contiguous(), sorted_logits.contiguous(), right=True) - 1
    keep = keep.gather(-1, last_of_group)
    keep = torch.empty_like(keep).scatter_(-1, order, keep)  # back to vocabulary order
    return logits.masked_fill(~keep, NEG_INF)


def _greedy_only(logits: torch.Tensor) -> torch.Tensor:
    """Temperature 0: every logit but the row's argmax set to −inf."""
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.argmax(dim=-1, keepdim=True), True)
    return logits.masked_fill(~keep, NEG_INF)


@SAMPLING_KNOBS
def filter_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Temperature, then top-k, then top-p (Hugging Face's order); logits (..., V) -> (..., V).

    softmax of the result is the distribution `sample_next_token` draws from. top_p acts on the
    tempered, top-k-filtered distribution. temperature == 0 keeps only each row's argmax (greedy).
    """
    if temperature == 0:
        return _greedy_only(logits)
    z = logits / float(temperature)  # apply_temperature, its arguments checked above
    if top_k is not None:
        z = top_k_filter(z, top_k)
    if top_p is not None:
        z = top_p_filter(z, top_p)
    return z


# --------------------------------------------------------------------------- sampling
_ONE_LEFT = {"not torch.isneginf(logits).all(-1).any()": "logits has a row that is all -inf: no token left to choose"}


@SAMPLING_KNOBS.plus(logits="logits (B, V)", where=_ONE_LEFT)
def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One next-token id per row: logits (B, V) -> (B,) int64.

    temperature == 0 is greedy decoding (argmax; top_k and top_p change nothing then). Otherwise
    a draw with `generator` from softmax(filter_logits(logits, temperature=..., top_k=..., top_p=...)).
    """
    if temperature == 0:
        return logits.argmax(dim=-1)  # (B,)
    # Subtracting each row's max changes no probability and no filter decision, and keeps a tiny
    # temperature from turning the largest logits into +inf (softmax would then give NaN).
    logits = logits - logits.amax(dim=-1, keepdim=True)
    z = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)  # (B, V)
    probs = torch.softmax(z.float(), dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]  # (B, 1) -> (B,)


@SAMPLING_KNOBS.plus(logits="logits (V,)", where=_ONE_LEFT)
def next_token_distribution(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> dict[str, torch.Tensor]:
    """Every step of `filter_logits` for one row of logits (V,), as (V,) tensors.

    "p_raw"          softmax(logits), float32
    "p_tempered"     softmax(logits / temperature); at temperature 0 the one-hot argmax
    "kept_by_top_k"  bool, False where top-k cut the token
    "kept_by_top_p"  bool, False where top-p cut the token (top-p runs on the tempered, top-k
                     filtered distribution, so a token top-k already cut is not top-p's doing: True)
    "kept"           bool, the tokens left: kept_by_top_k & kept_by_top_p, minus any token whose
                     logit was −inf already; at temperature 0 the argmax alone
    "p_final"        the distribution sampled from, softmax(filter_logits(...)), float32: zero off
                     `kept`, sums to 1

    At temperature 0 (greedy) the filters are not applied: both kept_by_* masks are all True.
    """
    p_raw = torch.softmax(logits.float(), dim=-1)
    all_true = torch.ones_like(logits, dtype=torch.bool)
    if temperature == 0:
        one_hot = _greedy_only(logits) > NEG_INF
        p = one_hot.float()
        return {
            "p_raw": p_raw,
            "p_tempered": p,
            "kept_by_top_k": all_true,
            "kept_by_top_p": all_true.clone(),
            "kept": one_hot,
            "p_final": p.clone(),
        }
    z = apply_temperature(logits - logits.max(), temperature)  # shifted: see sample_next_token
    zk = top_k_filter(z, top_k) if top_k is not None else z
    zp = top_p_filter(zk, top_p) if top_p is not None else zk
    alive, alive_k, alive_p = z > NEG_INF, zk > NEG_INF, zp > NEG_INF
    return {
        "p_raw": p_raw,
        "p_tempered": torch.softmax(z.float(), dim=-1),
        "kept_by_top_k": alive_k | ~alive,
        "kept_by_top_p": alive_p | ~alive_k,
        "kept": alive_p,
        "p_final": torch.softmax(zp.float(), dim=-1),
    }
