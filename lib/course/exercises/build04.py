"""Checks for build track 04, "the cached decode loop".

The learner writes a KV cache, attention of new queries over it with grouped-query heads, an
attention layer that reads and extends it, the prefill-then-decode loop and the bytes it holds,
each checked against lib (lib.kv_cache.KVCache, lib.attention.attention_ref,
lib.llama.GroupedQueryAttention, lib.decode.generate, lib.kv_cache.kv_cache_bytes). The loop
also drives SmolLM2-135M-Instruct, and a tiny Llama whose attention layers and caches are the
learner's own.

    check_kv_cache(cls)         MyKVCache(B, H_kv, T_max, D, dtype): preallocated self.k, self.v
                                (B, H_kv, T_max, D); update(start, k, v) writes k, v
                                (B, H_kv, T, D) at start..start+T-1 (start may rewind) and
                                returns positions 0..start+T-1, as KVCache.update
    check_cached_attention(fn)  my_cached_attention(q (B, H, T, D), k, v (B, H_kv, S, D)) ->
                                (B, H, T, D): the T queries are the last T of S positions
    check_cached_layer(cls)     MyCachedAttention(cfg)(x (B, T, C), cache, start) -> (B, T, C),
                                equal to GroupedQueryAttention with a KVCache, prefill then decode
    check_cached_generate(fn)   my_generate(model, idx (B, T), n) -> (tokens (B, T + n), logits
                                (B, n, V)): one prefill call, then (B, 1) calls at start = T + i;
                                tokens equal lib.decode.generate's, logits the uncached model's
    check_cache_bytes(fn)       my_cache_bytes(cfg, B, T, dtype) -> int, equal to
                                lib.kv_cache.kv_cache_bytes and to what MyKVCache allocates

Glossary: B batch, T new positions (the prompt's length for a prefill, 1 for a decode step),
S positions cached so far, T_max the positions a cache holds, H query heads, H_kv key/value
heads, D head dim, C width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from lib.attention import attention_ref
from lib.course.exercises import Case, CheckReport, call_learner, run_checks
from lib.course.exercises.build03 import (
    N_NEW,
    PROMPT,
    SMOL_TOL,
    TINY,
    WIDE,
    build,
    call_part,
    copy_weights,
    first_hint,
    learner_global,
    randomised,
    seeded,
    smollm2_run,
    tiny_llama,
    upstream_hint,
)
from lib.decode import generate
from lib.kv_cache import KVCache, dtype_bytes, kv_cache_bytes
from lib.llama import GroupedQueryAttention, Llama, LlamaConfig
from lib.rope import apply_rope, rope_cos_sin

__all__ = [
    "check_cache_bytes",
    "check_cached_attention",
    "check_cached_generate",
    "check_cached_layer",
    "check_kv_cache",
]

# fp32: a cached step computes the uncached pass's sums in other shapes (one query row against
# S keys instead of the whole (T, S) matrix). Measured: they differ by at most 2e-5 on the tiny
# Llama's logits of size ~10 (by 1e-6 on one layer's outputs); every mistake the checks name
# moves them by 5e-2 or more.
TOL = dict(atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- 4.1 the cache
def _fail(exercise: str, n: int, case: str, problem: str, hint: str | None = None) -> CheckReport:
    return CheckReport(exercise, False, n, case, problem, hint)


def _buffer_shape_hint(got: tuple, shape: tuple) -> str:
    B, H_kv, T_max, D = shape
    if got == (B, T_max, H_kv, D):
        return "positions are dim 2, after the heads: (B, H_kv, T_max, D), the layout attention reads"
    if len(got) == 4 and got[2] < T_max:
        return (
            "preallocate every position once, in __init__: torch.zeros(B, H_kv, T_max, D); a "
            "cache that grows with torch.cat copies all of itself at every step"
        )
    return "self.k = torch.zeros(B, H_kv, T_max, D, dtype=dtype), and the same for self.v"


def _check_buffers(exercise, n, case, cache, shape, dtype) -> CheckReport | None:
    for name in ("k", "v"):
        buf = getattr(cache, name, None)
        if not isinstance(buf, torch.Tensor):
            return _fail(
                exercise,
                n,
                case,
                f"no tensor self.{name} after __init__",
                "keep the buffers as self.k and self.v: the check (and Step 4.5) reads them",
            )
        if tuple(buf.shape) != shape:
            return _fail(
                exercise,
                n,
                case,
                f"self.{name} has shape {tuple(buf.shape)}, expected {shape}",
                _buffer_shape_hint(tuple(buf.shape), shape),
            )
        if buf.dtype != dtype:
            return _fail(
                exercise,
                n,
                case,
                f"self.{name} has dtype {buf.dtype}, expected {dtype}",
                "use the dtype given to __init__: a model in float16 keeps a float16 cache, half the bytes of float32",
            )
    return None


def _diagnose_write(cache, ref: KVCache, start: int, k: torch.Tensor, v: torch.Tensor) -> str:
    """Why the learner's buffers do not hold what lib's does after writing k, v at `start`."""
    end = start + k.shape[2]
    if end < ref.max_len and torch.equal(cache.k[:, :, start + 1 : end + 1], k):
        return (
            "wrote one position too late: the new positions are start .. start + T - 1, "
            "self.k[:, :, start:start + T] = k"
        )
    if start > 0 and torch.equal(cache.k[:, :, start - 1 : end - 1], k):
        return "wrote one position too early: the new positions are start .. start + T - 1"
    if torch.equal(cache.k[:, :, start:end], v) and torch.equal(cache.v[:, :, start:end], k):
        return "keys and values are swapped: k goes into self.k, v into self.v"
    T = k.shape[2]
    elsewhere = [p for p in range(ref.max_len - T + 1) if p != start and torch.equal(cache.k[:, :, p : p + T], k)]
    if elsewhere and elsewhere[0] > start:
        return (
            f"wrote at position {elsewhere[0]}, after the last write, not at start = {start}: "
            "write at `start`, not after the last write (a caller may rewind, writing "
            "positions again): self.k[:, :, start:start + T] = k"
        )
    if elsewhere:
        return f"wrote at position {elsewhere[0]}, not at start = {start}: self.k[:, :, start:start + T] = k"
    if torch.equal(cache.k[:, :, start:end], k):
        return "writing the new positions changed earlier ones: write only the slice start:start + T"
    return (
        "write in place into the preallocated buffers: self.k[:, :, start:start + T] = k "
        "(positions are dim 2), and the same for v"
    )


def _diagnose_return(got, ref_k, ref_v, start: int, T: int, T_max: int) -> str:
    if got[0].shape[2] == T_max and T_max != start + T:
        return (
            "return only positions 0 .. start + T - 1: the slots after them were never "
            "written, and attention would give them weight (a zero key scores 0, not -inf)"
        )
    if got[0].shape[2] == T and start > 0:
        return "return every position so far, self.k[:, :, :start + T], not just the new ones: the query needs them all"
    if got[0].shape == ref_v.shape and torch.equal(got[0], ref_v) and torch.equal(got[1], ref_k):
        return "return the keys first: (k_all, v_all)"
    return "return self.k[:, :, :start + T], self.v[:, :, :start + T]"


def _pair(got) -> bool:
    return isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)


def check_kv_cache(cls) -> CheckReport:
    """MyKVCache(B, H_kv, T_max, D, dtype) with buffers self.k, self.v (B, H_kv, T_max, D);
    update(start, k, v) writes k, v (B, H_kv, T, D) at start..start+T-1, start possibly before
    the last write's end (a rewind), and returns (self.k[:, :, :start+T],
    self.v[:, :, :start+T]), views of the buffers."""
    exercise = "Step 4.1 (a KV cache of your own)"
    B, H_kv, T_max, D = 2, 3, 12, 4
    steps = [
        ("prefill: 5 positions from 0", 0, 5),
        ("a rewind: 2 positions at start = 3, over positions 3 and 4 (a loop dropping tokens it drafted)", 3, 2),
        ("decode: one position at 5", 5, 1),
        ("decode: one position at 6", 6, 1),
        ("a chunk of 3 positions at 7", 7, 3),
        ("the last two slots, 10 and 11: the cache is full", 10, 2),
    ]
    n = len(steps) + 2
    case = "MyKVCache(2, 3, 12, 4): the buffers after __init__"
    cache, report = call_learner(exercise, cls, (B, H_kv, T_max, D), case, n)
    report = report or _check_buffers(exercise, n, case, cache, (B, H_kv, T_max, D), torch.float32)
    if report is not None:
        return report
    ref = KVCache(B, H_kv, T_max, D)
    g = torch.Generator().manual_seed(200)
    copied = None  # the first step whose result did not share the buffers' memory
    for case, start, T in steps:
        k, v = torch.randn(B, H_kv, T, D, generator=g), torch.randn(B, H_kv, T, D, generator=g)
        ref_k, ref_v = ref.update(start, k, v)
        if not callable(getattr(cache, "update", None)):
            return _fail(exercise, n, case, "MyKVCache has no update method", "def update(self, start, k, v): ...")
        got, report = call_learner(exercise, cache.update, (start, k.clone(), v.clone()), case, n)
        if report is not None:
            return report
        if not _pair(got):
            return _fail(
                exercise,
                n,
                case,
                f"update returned {type(got).__name__}, expected a tuple (k_all, v_all)",
                "return both: `return self.k[:, :, :end], self.v[:, :, :end]`",
            )
        end = start + T
        if not (
            torch.equal(cache.k[:, :, :end], ref.k[:, :, :end]) and torch.equal(cache.v[:, :, :end], ref.v[:, :, :end])
        ):
            return _fail(
                exercise,
                n,
                case,
                "the buffers do not hold the keys and values written so far",
                _diagnose_write(cache, ref, start, k, v),
            )
        if got[0].shape != ref_k.shape or got[1].shape != ref_v.shape:
            return _fail(
                exercise,
                n,
                case,
                f"returned keys of shape {tuple(got[0].shape)}, expected {tuple(ref_k.shape)}",
                _diagnose_return(got, ref_k, ref_v, start, T, T_max),
            )
        if not (torch.equal(got[0], ref_k) and torch.equal(got[1], ref_v)):
            return _fail(
                exercise,
                n,
                case,
                "returned the wrong keys or values",
                _diagnose_return(got, ref_k, ref_v, start, T, T_max),
            )
        shared = all(
            t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for t, b in zip(got, (cache.k, cache.v))
        )
        if copied is None and not shared:
            copied = case  # right values, not the cache's own memory: reported once all pass
    case = "MyKVCache(1, 2, 4, 8, dtype=torch.float64): a float64 cache"
    cache64, report = call_learner(exercise, lambda: cls(1, 2, 4, 8, dtype=torch.float64), (), case, n)
    if report is not None:
        report.hint = "take the buffers' dtype as an argument: __init__(self, B, H_kv, T_max, D, dtype=torch.float32)"
        return report
    report = _check_buffers(exercise, n, case, cache64, (1, 2, 4, 8), torch.float64)
    if report is not None:
        return report
    if copied is not None:
        return _fail(
            exercise,
            n,
            copied,
            "the returned tensors are copies: attention should read the cache itself",
            "return views, self.k[:, :, :start + T], not .clone() or "
            "torch.cat of the pieces: copying the whole cache at every step is the O(S) "
            "cost the cache exists to avoid",
        )
    return CheckReport(exercise, True, n)


# --------------------------------------------------------------------------- 4.2 attention
def attend(q, k, v, *, expand: str = "interleave", mask: str = "end", scale: bool = True) -> torch.Tensor:
    """Attention of the last T of S positions, and its plausible mistakes: KV heads repeated,
    the causal mask aligned to the start (or missing), no scale."""
    B, H, T, D = q.shape
    S, groups = k.shape[2], q.shape[1] // k.shape[1]
    if expand == "interleave":  # (B, H_kv, S, D) -> (B, H, S, D)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    else:
        k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(D) if scale else 1.0)  # (B, H, T, S)
    if mask != "none":  # "end": query i at position S - T + i sees keys 0 .. S - T + i
        future = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1 if mask == "end" else 1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(-1) @ v


def _diagnose_cached_attention(q, k, v, expected):
    variants = [
        (
            attend(q, k, v, expand="repeat"),
            "KV head j serves the query heads j·H/H_kv .. (j+1)·H/H_kv - 1: "
            "repeat_interleave(H // H_kv, dim=1); .repeat cycles through the KV heads",
        ),
        (
            attend(q, k, v, mask="start"),
            "the causal mask must be aligned to the end: the T new queries are the LAST T of the S "
            "positions, so query i (position S - T + i) sees keys 0 .. S - T + i",
        ),
        (
            attend(q, k, v, mask="none"),
            "the T new queries are causal among themselves: query i (position S - T + i) must not "
            "see the keys after it (a decode step, T = 1, needs no mask)",
        ),
        (attend(q, k, v, scale=False), "scale the scores by 1/√D"),
    ]

    def diagnose(got: torch.Tensor) -> str | None:
        B, H, T, D = q.shape
        if got.shape == (B, k.shape[1], T, D) and k.shape[1] != H:
            return "one output per query head, (B, H, T, D): expand the H_kv heads to H first"
        return first_hint(got, variants, expected=expected)

    return diagnose


def check_cached_attention(fn) -> CheckReport:
    """fn(q (B, H, T, D), k, v (B, H_kv, S, D)) -> (B, H, T, D): the T queries sit at positions
    S - T .. S - 1 and see the keys up to their own; each KV head serves H / H_kv query heads."""
    g = torch.Generator().manual_seed(210)
    cases = []
    for name, (B, H, H_kv, T, S, D) in [
        ("the first token: T = S = 1", (1, 4, 2, 1, 1, 8)),
        ("a decode step: one query (T = 1) against S = 7 cached keys", (2, 4, 2, 1, 7, 8)),
        ("a prefill: T = S = 6, causal", (1, 4, 2, 6, 6, 8)),
        ("a chunk: T = 3 new queries at positions 6, 7, 8 (S = 9)", (2, 4, 2, 3, 9, 8)),
        ("three query heads per KV head (H = 6, H_kv = 2), T = 2, S = 5", (1, 6, 2, 2, 5, 4)),
    ]:
        q = 2 * torch.randn(B, H, T, D, generator=g)  # scores far from uniform: a mask shows
        k, v = torch.randn(B, H_kv, S, D, generator=g), torch.randn(B, H_kv, S, D, generator=g)
        expected = attention_ref(q, k, v, causal=True)
        cases.append(Case(name, (q, k, v), expected, diagnose=_diagnose_cached_attention(q, k, v, expected), **TOL))

    def nan_hint(case) -> str:
        return (
            "NaN after the softmax: a query whose keys are all masked? Query i (position "
            "S - T + i) always sees keys 0 .. S - T + i, itself included"
        )

    return run_checks("Step 4.2 (attention over the cache)", fn, cases, nan_hint=nan_hint)


# --------------------------------------------------------------------------- 4.3 the layer
def layer_run(
    att: GroupedQueryAttention,
    cfg: LlamaConfig,
    steps,
    *,
    offset: bool = True,
    rope: str = "qk",
    use_cache: bool = True,
    base: float | None = None,
) -> list:
    """lib's projections `att` over a sequence of calls (x, start, cached), and the plausible
    mistakes: RoPE at positions 0..T-1 whatever `start`, RoPE on other tensors, the cache's
    keys not read, a fixed RoPE base. Returns each call's output (B, T, C)."""
    H, H_kv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    base = cfg.rope_base if base is None else base
    outs, cache = [], None
    for x, start, cached in steps:
        B, T, C = x.shape
        q = att.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, T, H·D) -> (B, H, T, D)
        k = att.k_proj(x).view(B, T, H_kv, D).transpose(1, 2)  # -> (B, H_kv, T, D)
        v = att.v_proj(x).view(B, T, H_kv, D).transpose(1, 2)
        cos, sin = rope_cos_sin(T, D, base=base, offset=start if offset else 0)
        q, k, v = (apply_rope(t, cos, sin) if name in rope else t for name, t in zip("qkv", (q, k, v)))
        if cached:
            cache = KVCache(B, H_kv, 64, D) if start == 0 else cache
            k_all, v_all = cache.update(start, k, v)
            k, v = (k_all, v_all) if use_cache else (k, v)
        y = attention_ref(q, k, v, causal=True)  # (B, H, T, D)
        outs.append(att.o_proj(y.transpose(1, 2).reshape(B, T, H * D)))
    return outs


def _layer_shape_hint(name: str, shape: tuple) -> str:
    if name.startswith(("k_proj", "v_proj")):
        return "k_proj and v_proj make H_kv = cfg.n_kv_head heads: nn.Linear(C, H_kv·D, bias=False)"
    return "q_proj makes H = cfg.n_head heads of D: nn.Linear(C, H·D); o_proj maps H·D back to C"


def _layer_variants(ref, cfg, steps):
    with torch.no_grad():
        return [
            (
                layer_run(ref, cfg, steps, offset=False),
                "rotate the new q and k by their absolute positions start .. start + T - 1: "
                "rope_cos_sin(T, D, base=..., offset=start); a decode step's token is not at "
                "position 0",
            ),
            (layer_run(ref, cfg, steps, rope="qkv"), "RoPE rotates q and k only, not v"),
            (layer_run(ref, cfg, steps, rope="q"), "rotate k as well as q, before it goes into the cache"),
            (
                layer_run(ref, cfg, steps, use_cache=False),
                "attend over what cache.update(start, k, v) returns: every key and value so far, not only this call's",
            ),
            (
                layer_run(ref, cfg, steps, base=10000.0) if cfg.rope_base != 10000.0 else None,
                "use cfg.rope_base (SmolLM2's is 100,000), not a fixed 10000",
            ),
        ]


def check_cached_layer(cls) -> CheckReport:
    """MyCachedAttention(cfg) with q_proj, k_proj, v_proj, o_proj; forward(x (B, T, C), cache,
    start) -> (B, T, C): q and k rotated at positions start..start+T-1, (k, v) =
    cache.update(start, k, v) when a cache is given, then my_cached_attention and o_proj."""
    exercise = "Step 4.3 (an attention layer that reads and extends the cache)"
    g = torch.Generator().manual_seed(220)
    heads = "6 query / 2 KV heads, RoPE base 100,000"
    runs = []  # (cfg, [(case, x, start, cached)])
    for cfg, calls in [
        (
            TINY,
            [
                ("no cache: T = 6 at positions 0..5", 6, 0, False),
                ("prefill: 5 tokens into an empty cache, start = 0", 5, 0, True),
                ("decode: one token at start = 5", 1, 5, True),
                ("decode: one token at start = 6", 1, 6, True),
                ("a chunk of 3 tokens at start = 7", 3, 7, True),
            ],
        ),
        (WIDE, [(f"{heads}: a prefill of 4 tokens", 4, 0, True), (f"{heads}: decode at start = 4", 1, 4, True)]),
    ]:
        runs.append(
            (
                cfg,
                [(case, torch.randn(2, T, cfg.n_embd, generator=g), start, cached) for case, T, start, cached in calls],
            )
        )
    n = sum(len(calls) for _, calls in runs)
    step_4_2 = [("4.2", learner_global(cls, "my_cached_attention"), check_cached_attention)]
    for r, (cfg, calls) in enumerate(runs):
        ref = randomised(seeded(230 + r, lambda: GroupedQueryAttention(cfg)), 240 + r)
        mine, report = build(exercise, cls, (cfg,), n, "MyCachedAttention(cfg)")
        report = report or copy_weights(
            exercise, mine, ref, n, f"{calls[0][0]}: copying lib's weights in", _layer_shape_hint
        )
        if report is not None:
            return report
        steps = [(x, start, cached) for _, x, start, cached in calls]
        with torch.no_grad():
            expected = layer_run(ref, cfg, steps)
        variants = _layer_variants(ref, cfg, steps)
        cache = None
        for i, (case, x, start, cached) in enumerate(calls):
            if cached and start == 0:
                cache = KVCache(2, cfg.n_kv_head, 64, cfg.head_dim)
            with torch.no_grad():
                got, report = call_part(exercise, mine, (x, cache if cached else None, start), case, n, own=cls)
            if report is not None:
                if any(word in (report.problem or "") for word in ("no gaps", "overflow")):
                    report.hint = (
                        "call cache.update(start, k, v) with this call's start: the new keys go at positions start .."
                    )
                return report
            here = [(None if v is None else v[i], hint) for v, hint in variants]

            def hint(got, here=here, expected=expected[i]):
                return upstream_hint(step_4_2) or first_hint(got, here, expected=expected)

            report = run_checks(exercise, lambda: got, [Case(case, (), expected[i], diagnose=hint, **TOL)])
            if not report.passed:
                return dataclasses.replace(report, n_cases=n)
    return CheckReport(exercise, True, n)


# --------------------------------------------------------------------------- 4.4 the loop
class LearnersLlama(nn.Module):
    """lib's Llama `reference` with the learner's MyCachedAttention layers and MyKVCache caches
    in place of its own; the embedding, norms, SwiGLUs and tied head are the reference's modules
    themselves (shared, not copied). Follows lib.decode's protocol (new_caches,
    forward(idx, caches=, start=))."""

    def __init__(self, reference: Llama, layers: list[nn.Module], cache_cls):
        super().__init__()
        self.config, self.cache_cls = reference.config, cache_cls
        self.vocab_size, self.block_size = reference.config.vocab_size, reference.config.block_size
        self.embed_tokens, self.norm = reference.model.embed_tokens, reference.model.norm
        self.blocks = reference.model.layers  # their norms and MLPs; attention from `layers`
        self.attns = nn.ModuleList(layers)

    def new_caches(self, batch_size: int, max_len: int | None = None) -> list:
        cfg = self.config
        max_len = cfg.block_size if max_len is None else max_len
        return [
            self.cache_cls(batch_size, cfg.n_kv_head, max_len, cfg.head_dim, dtype=torch.float32)
            for _ in range(cfg.n_layer)
        ]

    def cache_bytes(self, batch: int, seq_len: int, dtype=None) -> int:
        cfg = self.config
        return kv_cache_bytes(
            cfg.n_layer, batch, seq_len, cfg.n_kv_head, cfg.head_dim, dtype_bytes(dtype or torch.float32)
        )

    def forward(self, idx: torch.Tensor, *, caches: list | None = None, start: int = 0) -> torch.Tensor:
        x = self.embed_tokens(idx)  # (B, T, C)
        for i, (block, attn) in enumerate(zip(self.blocks, self.attns)):
            cache = None if caches is None else caches[i]
            x = x + attn(block.input_layernorm(x), cache, start)
            x = x + block.mlp(block.post_attention_layernorm(x))
        return self.norm(x) @ self.embed_tokens.weight.T  # (B, T, C) @ (C, V) -> (B, T, V)


def _record_calls(model: nn.Module):
    """Record (idx's shape, start, whether caches were passed) of every call to `model`;
    returns (the list, the hook's handle)."""
    calls = []

    def hook(module, args, kwargs):
        idx = args[0] if args else kwargs.get("idx")
        shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else None
        calls.append((shape, kwargs.get("start", 0), kwargs.get("caches") is not None))

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


def _call_pattern_hint(calls, B: int, T: int, n: int) -> str | None:
    """What is wrong with the learner's sequence of model calls, or None."""
    if not calls:
        return "call the model: a prefill on the prompt, then one call per new token"
    if any(not cached for _, _, cached in calls):
        return (
            "pass caches=caches on every call (caches = model.new_caches(B, T + "
            "max_new_tokens), made once): without them nothing is kept between calls"
        )
    shape, start, _ = calls[0]
    if shape != (B, T) or start != 0:
        return "prefill: run the whole prompt in one call, model(idx, caches=caches, start=0), to fill the caches"
    if len(calls) < n:
        return f"{n} new tokens take {n} model calls: the prefill chooses the first, then one decode step per token"
    for j, (shape, start, _) in enumerate(calls[1:n], start=1):
        if shape != (B, 1):
            return (
                "after the prefill, feed only the newest token, (B, 1): the caches hold every "
                "earlier position, and a longer input would write them again"
            )
        if start != T + j - 1:
            return (
                f"decode step {j} feeds the token chosen at step {j - 1}, which sits at "
                f"position T + {j - 1} = {T + j - 1}: start={T + j - 1}, not {start}"
            )
    return None


def _error_hint(problem: str) -> str | None:
    if "no gaps" in problem:
        return (
            "a gap: start is past what the caches hold. The prefill fills positions "
            "0 .. T - 1; the token chosen at step i sits at position T + i"
        )
    if "overflow" in problem:
        return "the caches are too small: caches = model.new_caches(B, T + max_new_tokens)"
    if "needs caches" in problem:
        return "pass caches=caches to every call: a call at start > 0 reads the earlier positions from them"
    return None


def _logits_hint(logits, expected, tol) -> str:
    shifted = expected[:, 1:]
    if torch.allclose(logits[:, :-1], shifted, **tol):
        return "logits[:, i] must be the logits token i was chosen from: the prefill's last position gives the first"
    if torch.allclose(logits[:, :1], expected[:, :1], **tol):
        return (
            "the prefill's logits are right but the decode steps' are not: does each step "
            "write its key at its own position, and read every key so far?"
        )
    return "the logits that choose the first new token are those at the prompt's last position, logits[:, -1]"


def _run_loop(exercise, fn, model, idx, n, n_cases, case, expected_tokens, expected_logits, tol) -> CheckReport | None:
    """Run the learner's loop on `model`; a report unless its calls, tokens and logits are right."""
    B, T = idx.shape
    calls, handle = _record_calls(model)
    try:
        with torch.no_grad():
            got, report = call_learner(exercise, fn, (model, idx.clone(), n), case, n_cases)
    finally:
        handle.remove()
    if report is not None:
        report.hint = _error_hint(report.problem or "") or report.hint
        return report

    def fail(problem, hint=None):
        return CheckReport(exercise, False, n_cases, case, problem, hint)

    if not _pair(got):
        return fail(
            f"returned {type(got).__name__}, expected a tuple (tokens, logits)",
            "return torch.cat(out, dim=1), torch.stack(chosen_by, dim=1)",
        )
    tokens, logits = got
    hint = _call_pattern_hint(calls, B, T, n)
    if hint is not None:
        return fail("the model was not called as a prefill, then one token at a time", hint)
    if tokens.shape != expected_tokens.shape:
        return fail(
            f"returned tokens of shape {tuple(tokens.shape)}, expected {tuple(expected_tokens.shape)}",
            "return the prompt followed by the new tokens, (B, T + max_new_tokens)",
        )
    if logits.shape != expected_logits.shape:
        return fail(
            f"returned logits of shape {tuple(logits.shape)}, expected {tuple(expected_logits.shape)}",
            "one (B, V) row per new token, the logits it was chosen from, stacked on dim 1: (B, n, V)",
        )
    if not torch.allclose(logits, expected_logits, **tol):
        diff = (logits - expected_logits).abs().max().item()
        return fail(
            f"the cached logits differ from the uncached model's (largest difference {diff:.3g})",
            _logits_hint(logits, expected_logits, tol),
        )
    if not torch.equal(tokens.long(), expected_tokens):
        return fail(
            "the tokens differ from lib.decode.generate's",
            "greedy: each new token is the argmax of its logits over the vocabulary, appended to the prompt",
        )
    return None


def _uncached(model, idx, n):
    """lib's greedy tokens (B, T + n) and the uncached logits (B, n, V) that chose them."""
    tokens = generate(model, idx, n, temperature=0.0, use_cache=False)
    with torch.no_grad():
        return tokens, model(tokens[:, :-1])[:, idx.shape[1] - 1 :]


def _learners_model(exercise, fn, model, n_cases, case):
    """The tiny Llama `model` with the notebook's MyCachedAttention and MyKVCache in it."""
    attn_cls, cache_cls = learner_global(fn, "MyCachedAttention"), learner_global(fn, "MyKVCache")
    if attn_cls is None or cache_cls is None:
        return (
            None,
            None,
            _fail(
                exercise,
                n_cases,
                case,
                "no MyCachedAttention or MyKVCache in this notebook",
                "run the cells of Steps 4.1 and 4.3 first: this case builds a model from them",
            ),
        )
    upstream = [("4.1", cache_cls, check_kv_cache), ("4.3", attn_cls, check_cached_layer)]
    layers = []
    for block in model.model.layers:
        layer, report = build(exercise, attn_cls, (model.config,), n_cases, "MyCachedAttention(cfg)")
        report = report or copy_weights(exercise, layer, block.self_attn, n_cases, case)
        if report is not None:
            report.hint = upstream_hint(upstream) or report.hint
            return None, None, report
        layers.append(layer)
    return LearnersLlama(model, layers, cache_cls).eval(), upstream, None


def check_cached_generate(fn) -> CheckReport:
    """fn(model, idx (B, T), max_new_tokens) -> (tokens (B, T + n), logits (B, n, V)): the prompt
    in one call with fresh caches, then each new token alone at start = T + i; checked on lib's
    tiny Llama, on one built from the notebook's MyCachedAttention and MyKVCache, and on
    SmolLM2-135M."""
    exercise = "Step 4.4 (the cached decode loop)"
    n_cases = 4
    g = torch.Generator().manual_seed(250)
    model = tiny_llama(TINY, 260, std=0.5)
    for case, idx, n in [
        ("lib's tiny Llama, B = 2, a 5-token prompt, 8 new tokens", torch.randint(64, (2, 5), generator=g), 8),
        ("lib's tiny Llama, a 1-token prompt, 5 new tokens", torch.randint(64, (1, 1), generator=g), 5),
    ]:
        report = _run_loop(exercise, fn, model, idx, n, n_cases, case, *_uncached(model, idx, n), TOL)
        if report is not None:
            return report
    case = "the tiny Llama with your MyCachedAttention and MyKVCache in every layer"
    mine, upstream, report = _learners_model(exercise, fn, model, n_cases, case)
    if report is not None:
        return report
    idx = torch.randint(64, (2, 4), generator=g)
    report = _run_loop(exercise, fn, mine, idx, 6, n_cases, case, *_uncached(model, idx, 6), TOL)
    if report is not None:
        report.hint = upstream_hint(upstream) or report.hint
        return report
    smol, tokenizer, idx, tokens, logits = smollm2_run()
    case = (
        f"SmolLM2-135M-Instruct with your MyCachedAttention and MyKVCache in its 30 layers, {PROMPT!r} + {N_NEW} tokens"
    )
    mine, upstream, report = _learners_model(exercise, fn, smol, n_cases, case)
    if report is not None:
        return report
    report = _run_loop(exercise, fn, mine, idx, N_NEW, n_cases, case, tokens, logits[:, idx.shape[1] - 1 :], SMOL_TOL)
    if report is not None:
        at_scale = (
            "your parts pass on the tiny configs but not with SmolLM2's: is a value fixed "
            "for the tiny model? SmolLM2 has 9 query and 3 key/value heads of dimension "
            "64 and RoPE base 100,000: read them from cfg"
        )
        differ = "differ" in (report.problem or "")
        report.hint = upstream_hint(upstream) or (at_scale if differ else report.hint)
        return report
    print(
        f"SmolLM2-135M-Instruct, with your KV cache, your attention layers and your loop, "
        f"continues {PROMPT!r}:\n  {tokenizer.decode(tokens[0])!r}"
    )
    return CheckReport(exercise, True, n_cases)


# --------------------------------------------------------------------------- 4.5 the bytes
def _bytes_hint(got: int, cfg: LlamaConfig, B: int, T: int, size: float, expected: int) -> str:
    L, H, H_kv, D = cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim
    variants = [
        (
            2 * L * B * T * H * D * size,
            "count the key/value heads, cfg.n_kv_head, not the query heads: sharing them is what "
            "makes a grouped-query cache H / H_kv times smaller",
        ),
        (L * B * T * H_kv * D * size, "a cache holds keys AND values: times 2"),
        (2 * B * T * H_kv * D * size, "every layer keeps its own cache: times cfg.n_layer"),
        (
            2 * L * B * T * H_kv * D,
            "multiply by the bytes per element of dtype (torch.empty((), dtype=dtype)"
            ".element_size()): the formula counts numbers",
        ),
        (2 * L * B * T * H_kv * D * size * 8, "8 times too many: that is bits; count bytes"),
    ]
    return next(
        (hint for value, hint in variants if got == value and value != expected),
        "bytes = 2 (keys and values) · layers · B · T · H_kv · D · bytes per element",
    )


def check_cache_bytes(fn) -> CheckReport:
    """fn(cfg, B, T, dtype) -> int: the bytes of a model's KV caches after T positions of B
    sequences, 2 · L · B · T · H_kv · D · bytes per element; also what MyKVCache allocates."""
    exercise = "Step 4.5 (the bytes your cache holds)"
    smol = LlamaConfig.smollm2_135m()
    sizes = [
        ("SmolLM2-135M, one token, float32 (46,080 bytes)", smol, 1, 1, torch.float32),
        ("lib's tiny Llama, one sequence, one token, float32", TINY, 1, 1, torch.float32),
        ("SmolLM2-135M, 8 sequences of 8,192 tokens, bfloat16", smol, 8, 8192, torch.bfloat16),
        (
            "as many KV heads as query heads (H_kv = H = 4), 3 sequences of 100 tokens, float16",
            LlamaConfig.tiny(n_kv_head=4),
            3,
            100,
            torch.float16,
        ),
    ]
    n = len(sizes) + 1
    for case, cfg, B, T, dtype in sizes:
        got, report = call_learner(exercise, fn, (cfg, B, T, dtype), case, n)
        if report is not None:
            return report
        size = dtype_bytes(dtype)
        expected = kv_cache_bytes(cfg.n_layer, B, T, cfg.n_kv_head, cfg.head_dim, size)
        if isinstance(got, torch.Tensor) and got.numel() == 1 and not got.is_floating_point():
            got = int(got)
        if isinstance(got, bool) or not isinstance(got, int):
            return _fail(
                exercise,
                n,
                case,
                f"returned {type(got).__name__}, expected an int",
                "bytes are a whole number: return int(...)",
            )
        if got != expected:
            return _fail(
                exercise,
                n,
                case,
                f"returned {got:,}, expected {expected:,}",
                _bytes_hint(got, cfg, B, T, size, expected),
            )
    case = "your MyKVCache, one per layer of SmolLM2-135M, for 2 sequences of 10 tokens, float32"
    cache_cls = learner_global(fn, "MyKVCache")
    if cache_cls is None:
        return _fail(exercise, n, case, "no MyKVCache in this notebook", "run Step 4.1's cell first")
    expected = kv_cache_bytes(smol.n_layer, 2, 10, smol.n_kv_head, smol.head_dim, 4)
    step_4_1 = [("4.1", cache_cls, check_kv_cache)]

    def allocated():
        caches = [cache_cls(2, smol.n_kv_head, 10, smol.head_dim, dtype=torch.float32) for _ in range(smol.n_layer)]
        return sum(c.k.nbytes + c.v.nbytes for c in caches)

    got, report = call_learner(exercise, allocated, (), case, n)
    if report is not None:
        report.hint = upstream_hint(step_4_1) or report.hint
        return report
    if got != expected:
        return _fail(
            exercise,
            n,
            case,
            f"your caches allocate {got:,} bytes, expected {expected:,}",
            upstream_hint(step_4_1)
            or "MyKVCache(B, H_kv, T_max, D, dtype) holds two (B, H_kv, T_max, D) buffers of that dtype",
        )
    return CheckReport(exercise, True, n)
