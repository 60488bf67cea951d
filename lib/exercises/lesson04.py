"""Checks for lesson 04, "KV-cache math".

    check_kv_cache_bytes(fn)  fn(n_layers, batch, seq_len, n_kv_heads, head_dim, bytes_per_elem)
                              -> int, equal to lib.kv_cache.kv_cache_bytes
    check_cache_update(fn)    fn(k_cache, v_cache, start, k, v) -> (k_all, v_all): write in place
                              and return every position so far, as lib.kv_cache.KVCache.update does
"""

from __future__ import annotations

import torch

from lib.exercises import CheckReport, call_learner
from lib.kv_cache import KVCache, kv_cache_bytes

__all__ = ["check_cache_update", "check_kv_cache_bytes"]

_SIZES = [
    ("one layer, one token, one head, fp32", (1, 1, 1, 1, 64, 4)),
    ("the 7B example: 32 layers, batch 16, 4,096 tokens, 32 KV heads of 128, fp16", (32, 16, 4096, 32, 128, 2)),
    ("grouped-query: 8 KV heads, fp32", (32, 1, 8192, 8, 128, 4)),
    ("fp8, odd sizes", (3, 5, 7, 1, 80, 1)),
]


def check_kv_cache_bytes(fn) -> CheckReport:
    """fn(n_layers, batch, seq_len, n_kv_heads, head_dim, bytes_per_elem) must return the bytes as an int."""
    name = "Exercise 4.1 (the KV-cache formula)"
    for case, args in _SIZES:
        got, report = call_learner(name, fn, args, case, len(_SIZES))
        if report is not None:
            return report
        expected = kv_cache_bytes(*args[:5], bytes_per_elem=args[5])
        if isinstance(got, bool) or not isinstance(got, int):
            return CheckReport(name, False, len(_SIZES), case, f"returned {type(got).__name__}, expected an int",
                               "bytes are a whole number: wrap the product in int(...)")
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
    name = "Exercise 4.2 (writing into the cache)"
    g = torch.Generator().manual_seed(0)
    B, H_kv, S_max, D = 2, 3, 12, 4
    steps = [("prefill: 5 positions from 0", 0, 5), ("decode: one position at 5", 5, 1),
             ("decode: one position at 6", 6, 1), ("three more positions from 7", 7, 3)]
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
        if not torch.equal(k_cache[:, :, :start + T], ours.k[:, :, :start + T]):
            return fail("k_cache does not hold the keys written so far",
                        "write in place: k_cache[:, :, start:start + T] = k (positions are dim 2)")
        if got[0].shape != expected[0].shape:
            hint = ("return every position so far, k_cache[:, :, :start + T], not just the new ones"
                    if got[0].shape[2] == T else "slice the positions dimension (dim 2) up to start + T")
            return fail(f"returned keys of shape {tuple(got[0].shape)}, expected {tuple(expected[0].shape)}", hint)
        if not (torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])):
            return fail("wrong values returned", "did you swap k and v, or return a stale copy?")
        if copied is None and not all(t.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
                                      for t, cache in zip(got, (k_cache, v_cache))):
            copied = case  # right values, but not the cache's own memory: reported once the values all pass
    if copied is not None:
        return CheckReport(name, False, len(steps), copied,
                           "the returned tensors are copies: attention should read the cache itself",
                           "return views, k_cache[:, :, :start + T], not .clone() or torch.cat of the pieces: "
                           "copying the whole cache at every step is the O(S) cost the cache exists to avoid")
    return CheckReport(name, True, len(steps))
