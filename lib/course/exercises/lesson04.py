"""Checks for lesson 04, "KV-cache math".

check_kv_cache_bytes(fn)  fn(n_layers, batch, seq_len, n_kv_heads, head_dim, bytes_per_elem)
                          -> int, equal to lib.kv_cache.kv_cache_bytes
check_cache_update(fn)    fn(k_cache, v_cache, start, k, v) -> (k_all, v_all): write in place
                          and return every position so far, as lib.kv_cache.KVCache.update does
check_gqa_attention(fn)   fn(q (B, H, T, D), k, v (B, H_kv, S, D), causal) -> (B, H, T, D):
                          grouped-query attention, equal to lib.attention.attention_ref
"""

from __future__ import annotations

import math

import torch

from lib.attention import attention_ref
from lib.course.exercises import Case, CheckReport, call_learner, run_checks
from lib.kv_cache import KVCache, kv_cache_bytes
from lib.masks import causal_mask

__all__ = ["check_cache_update", "check_gqa_attention", "check_kv_cache_bytes"]

_SIZES = [
    ("one layer, one token, one head, fp32", (1, 1, 1, 1, 64, 4)),
    ("the 7B example: 32 layers, batch 16, 4,096 tokens, 32 KV heads of 128, fp16", (32, 16, 4096, 32, 128, 2)),
    ("grouped-query: 8 KV heads, fp32", (32, 1, 8192, 8, 128, 4)),
    ("fp8, odd sizes", (3, 5, 7, 1, 80, 1)),
]


def check_kv_cache_bytes(fn) -> CheckReport:
    """fn(n_layers, batch, seq_len, n_kv_heads, head_dim, bytes_per_elem) must return the bytes as an int."""
    name = "Exercise 4.2 (the KV-cache formula)"
    for case, args in _SIZES:
        got, report = call_learner(name, fn, args, case, len(_SIZES))
        if report is not None:
            return report
        expected = kv_cache_bytes(*args[:5], bytes_per_elem=args[5])
        if isinstance(got, bool) or not isinstance(got, int):
            return CheckReport(
                name,
                False,
                len(_SIZES),
                case,
                f"returned {type(got).__name__}, expected an int",
                "bytes are a whole number: wrap the product in int(...)",
            )
        if got != expected:
            if got * 2 == expected:
                hint = "half the answer: a cache holds keys AND values, so multiply by 2"
            elif got == expected * 8:
                hint = "8x too big: bytes_per_elem is already in bytes, not bits"
            elif got * args[5] == expected:
                hint = "multiply by bytes_per_elem: the formula counts elements, the answer is bytes"
            else:
                hint = "bytes = 2 (K and V) x bytes_per_elem x n_layers x batch x seq_len x n_kv_heads x head_dim"
            return CheckReport(name, False, len(_SIZES), case, f"returned {got:,}, expected {expected:,}", hint)
    return CheckReport(name, True, len(_SIZES))


def check_cache_update(fn) -> CheckReport:
    """fn(k_cache, v_cache, start, k, v) must write k, v at start.. in place and return (B, H_kv, start+T, D)
    views of the caches (sharing their storage, as KVCache.update's do)."""
    name = "Exercise 4.1 (writing into the cache)"
    g = torch.Generator().manual_seed(0)
    B, H_kv, S_max, D = 2, 3, 12, 4
    steps = [
        ("prefill: 5 positions from 0", 0, 5),
        ("decode: one position at 5", 5, 1),
        ("decode: one position at 6", 6, 1),
        ("three more positions from 7", 7, 3),
    ]
    ours = KVCache(B, H_kv, S_max, D)
    k_cache, v_cache = torch.zeros(B, H_kv, S_max, D), torch.zeros(B, H_kv, S_max, D)
    copied = None  # the first step whose result did not share the caches' storage
    for case, start, T in steps:
        k, v = torch.randn(B, H_kv, T, D, generator=g), torch.randn(B, H_kv, T, D, generator=g)
        expected = ours.update(start, k, v)
        got, report = call_learner(name, fn, (k_cache, v_cache, start, k, v), case, len(steps))
        if report is not None:
            return report

        def fail(problem, hint=None, case=case):
            return CheckReport(name, False, len(steps), case, problem, hint)

        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            return fail(f"returned {type(got).__name__}, expected a tuple (k_all, v_all)")
        if not torch.equal(k_cache[:, :, : start + T], ours.k[:, :, : start + T]):
            return fail(
                "k_cache does not hold the keys written so far",
                "write in place: k_cache[:, :, start:start + T] = k (positions are dim 2)",
            )
        if got[0].shape != expected[0].shape:
            hint = (
                "return every position so far, k_cache[:, :, :start + T], not just the new ones"
                if got[0].shape[2] == T
                else "slice the positions dimension (dim 2) up to start + T"
            )
            return fail(f"returned keys of shape {tuple(got[0].shape)}, expected {tuple(expected[0].shape)}", hint)
        if not (torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])):
            return fail("wrong values returned", "did you swap k and v, or return a stale copy?")
        if copied is None and not all(
            t.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
            for t, cache in zip(got, (k_cache, v_cache))
        ):
            copied = case  # right values, but not the cache's own memory: reported once the values all pass
    if copied is not None:
        return CheckReport(
            name,
            False,
            len(steps),
            copied,
            "the returned tensors are copies: attention should read the cache itself",
            "return views, k_cache[:, :, :start + T], not .clone() or torch.cat of the pieces: "
            "copying the whole cache at every step is the O(S) cost the cache exists to avoid",
        )
    return CheckReport(name, True, len(steps))


# --------------------------------------------------------------------------- 4.3 grouped-query attention
def _diagnose_gqa(q, k, v, causal: bool):
    H, H_kv, T, S, D = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    groups = H // H_kv

    def variant(widen=lambda x: x.repeat_interleave(groups, dim=1), scale=1 / math.sqrt(D), mask="bottom-right"):  # noqa: B008
        scores = q @ widen(k).transpose(-2, -1) * scale  # (B, H, T, S)
        if causal and mask == "bottom-right":
            scores = scores + causal_mask(T, kv_len=S)
        elif causal and mask == "top-left":
            scores = scores + torch.full((T, S), float("-inf")).triu(diagonal=1)
        return torch.softmax(scores, dim=-1) @ widen(v)

    def diagnose(got: torch.Tensor) -> str | None:
        if got.shape == (q.shape[0], H_kv, T, D) and H_kv != H:
            return "one output per query head: widen k and v to H heads first, (B, H_kv, S, D) -> (B, H, S, D)"
        if got.shape != q.shape:
            return None
        near = lambda x: bool(torch.allclose(got, x, rtol=1e-4, atol=1e-4))  # noqa: E731
        if groups > 1 and H_kv > 1 and near(variant(widen=lambda x: x.repeat(1, groups, 1, 1))):
            return (
                "the KV heads were tiled (0, 1, 0, 1, ...): query head h shares KV head h // (H // H_kv), so "
                "consecutive query heads form a group (0, 0, 1, 1, ...): repeat_interleave, not repeat"
            )
        if near(variant(scale=1.0)):
            return "the scores were not scaled: multiply QKᵀ by 1/√D (D = q.shape[-1])"
        if causal and T < S and near(variant(mask="top-left")):
            return (
                "the causal mask is aligned to the top left: with T < S the queries are the LAST T positions, "
                "query i sits at S - T + i and sees keys 0 .. S - T + i (causal_mask(T, kv_len=S))"
            )
        if causal and near(variant(mask=None)):
            return "causal=True: block every key after the query's position (-inf above the diagonal)"
        return None

    return diagnose


def check_gqa_attention(fn) -> CheckReport:
    """fn(q (B, H, T, D), k, v (B, H_kv, S, D), causal) must equal lib.attention.attention_ref: each
    group of H // H_kv consecutive query heads attends with one KV head, and with causal=True the T
    queries are the last T of the S positions."""
    g = torch.Generator().manual_seed(4)
    cases = []
    for name, (B, H, H_kv, T, S, D), causal in [
        ("multi-query: 4 query heads share 1 KV head, T = S = 1", (1, 4, 1, 1, 1, 8), True),
        ("2 KV heads for 4 query heads, T = S = 6, no mask", (2, 4, 2, 6, 6, 8), False),
        ("3 KV heads for 6 query heads, causal, T = S = 5", (1, 6, 3, 5, 5, 16), True),
        ("a decode step: 3 new queries against 7 cached keys, causal, 8 heads on 2 KV heads", (2, 8, 2, 3, 7, 8), True),
    ]:
        q = torch.randn(B, H, T, D, generator=g)
        k, v = torch.randn(B, H_kv, S, D, generator=g), torch.randn(B, H_kv, S, D, generator=g)
        # fp32, scores of size ~1 and at most 7 keys: any order of the sums agrees to ~1e-6
        cases.append(
            Case(
                name,
                (q, k, v, causal),
                attention_ref(q, k, v, causal=causal),
                atol=1e-5,
                rtol=1e-5,
                diagnose=_diagnose_gqa(q, k, v, causal),
            )
        )
    return run_checks("Exercise 4.3 (grouped-query attention)", fn, cases)
