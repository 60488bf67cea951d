"""Checks for the build track of lesson 05: the flash algorithm, tile by tile, in plain PyTorch.

    check_fold_key_tile(fn)       fn(m, l, acc, q, k, v, scale, q_start, k_start, causal)
                                  -> (m, l, acc): one key tile folded into a query tile's running
                                  softmax, equal to lib.attention.online_softmax_update
    check_forward_query_tile(fn)  fn(q, k, v, q_start, scale, causal, block_n) -> (o, L): one query
                                  tile's output and log-sum-exp, visiting only the tiles it needs
    check_flash_forward(fn)       fn(q, k, v, causal, block_m, block_n) -> (O, L), equal to
                                  attention_ref and, on a real sentence, to SmolLM2-135M's own
                                  attention at layer 15
    check_backward_tile(fn)       fn(q, k, v, do, L, delta, scale, q_start, k_start, causal)
                                  -> (dq, dk, dv): one (query tile, key tile) pair's share
    check_flash_backward(fn)      fn(q, k, v, o, L, do, causal, block_m, block_n) -> (dq, dk, dv),
                                  equal to autograd through attention_ref

Each check runs the learner's code on crafted tiles (lengths that are no multiple of a tile, T = 1,
tiles at offsets where only absolute positions give the right causal mask, a row that sees no
key) and, when the answer is wrong, recomputes the classic wrong versions to name the one it sees
and the step that holds it: the references below (`_fold`, `_tile_forward`, `_flash_forward`,
`_tile_backward`, `_flash_backward`) are right by default and take one flag per mistake.

Glossary: B batch, H heads, T sequence length (queries and keys: self-attention, as the kernel),
D head dim; bq and bk the rows of a query tile and of a key tile (the kernel's BLOCK_M, BLOCK_N);
m, l, acc the running max, sum and unnormalised output; L = m + log l, the log-sum-exp of a row;
delta the backward's D_i = rowsum(dO ∘ O).
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from functools import lru_cache

import torch

from lib.attention import attention_backward_ref, attention_ref, online_softmax_update
from lib.course.exercises import CheckReport, call_learner
from lib.kernels.flash import key_block_bounds
from lib.kernels.runtime import cdiv
from lib.masks import causal_mask

__all__ = [
    "check_backward_tile",
    "check_flash_backward",
    "check_flash_forward",
    "check_fold_key_tile",
    "check_forward_query_tile",
]

NEG_INF = float("-inf")
# fp32, dot products of D <= 64 terms, sums over <= 40 keys: any correct order of operations
# agrees to ~1e-6 on values of size ~1, so 1e-5 passes every right answer and no wrong one
TOL = dict(rtol=1e-5, atol=1e-5)
# the wrong versions are recomputed in another order than the learner's: a looser match names them
NEAR = dict(rtol=1e-4, atol=1e-4)
# the learner's functions, for a report that an earlier step is still a stub
STEP_OF = {
    "my_fold_key_tile": "5.1",
    "my_forward_query_tile": "5.2",
    "my_flash_forward": "5.3",
    "my_backward_tile": "5.4",
    "my_flash_backward": "5.5",
}


# --------------------------------------------------------------------------- calling, comparing
def _call(name, fn, args, case, n_cases):
    """call_learner, and when the stub that raised is an earlier step's function rather than `fn`
    itself, a hint that says which step to solve first."""
    raised_in = {}

    def traced(*a):
        try:
            return fn(*a)
        except NotImplementedError as err:
            tb = err.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            raised_in["name"] = tb.tb_frame.f_code.co_name
            raise

    got, report = call_learner(name, traced if callable(fn) else fn, args, case, n_cases)
    where = raised_in.get("name")
    if report is not None and where not in (None, getattr(fn, "__name__", None)):
        step = f"Step {STEP_OF[where]}'s " if where in STEP_OF else ""
        report.hint = (
            f"{step}`{where}`, which this step calls, still raises NotImplementedError: "
            "solve it and run its cell first, then this one again"
        )
    return got, report


def _close(a: torch.Tensor, b: torch.Tensor, tol: dict) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), equal_nan=True, **tol))


def _matches(got, variant, tol=NEAR) -> bool:
    return len(got) == len(variant) and all(_close(g, v, tol) for g, v in zip(got, variant))


def _tuple_report(
    exercise, n_cases, case, got, expected, names, *, tol=TOL, shape_hints=None, diagnose=None, default_hint=None
) -> CheckReport | None:
    """None when `got` is a tuple of tensors equal to `expected` within `tol`; otherwise the
    report, its hint from `diagnose(got)` when that recognises the mistake."""

    def fail(problem, hint=None):
        return CheckReport(exercise, False, n_cases, case, problem, hint)

    listed = ", ".join(names)
    if not (
        isinstance(got, (tuple, list)) and len(got) == len(expected) and all(isinstance(t, torch.Tensor) for t in got)
    ):
        what = f"a {type(got).__name__} of {len(got)}" if isinstance(got, (tuple, list)) else type(got).__name__
        return fail(f"returned {what}, expected a tuple ({listed}) of tensors", f"end with `return {listed}`")
    for name, g, e in zip(names, got, expected):
        if g.shape != e.shape:
            return fail(f"{name} has shape {tuple(g.shape)}, expected {tuple(e.shape)}", (shape_hints or {}).get(name))
        if g.dtype != e.dtype:
            return fail(
                f"{name} has dtype {g.dtype}, expected {e.dtype}",
                "make new tensors in q's dtype: q.new_zeros(...), torch.zeros_like(q)",
            )
    wrong = [name for name, g, e in zip(names, got, expected) if not _close(g, e, tol)]
    if not wrong:
        return None
    hint = diagnose(got) if diagnose else None
    nan = [
        name
        for name, g, e in zip(names, got, expected)
        if bool(torch.isnan(g).any()) and not bool(torch.isnan(e).any())
    ]
    if nan:
        problem = f"NaN in {', '.join(nan)}"
    else:
        worst = max(
            (g.double() - e.double()).abs().nan_to_num(nan=math.inf).max().item()
            for name, g, e in zip(names, got, expected)
            if name in wrong
        )
        problem = f"wrong {', '.join(wrong)} (largest difference {worst:.3g})"
    return fail(problem, hint or default_hint)


def _first_match(got, variants) -> str | None:
    """The hint of the first (compute, hint) whose result `got` matches."""
    for compute, hint in variants:
        try:
            variant = compute()
        except (RuntimeError, ValueError, ZeroDivisionError):  # a version this case cannot run
            continue
        if _matches(got, variant):
            return hint
    return None


def _inherited(flag: str, mistakes, step: str, compute):
    """Wrong versions from an earlier step, recomputed by `compute(**{flag: keywords})`, each hint
    saying which step to fix."""
    return [(lambda kw=kw: compute(**{flag: kw}), f"this comes from Step {step}: {hint}") for kw, hint in mistakes]


# --------------------------------------------------------------------------- references, mistakes
def _scores(q, k, scale, q_start, k_start, causal, mask="absolute"):
    """A tile's scores q kᵀ · scale (B, H, bq, bk), keys after their query at -inf under causal.
    mask: "absolute" (right), "local" (tile-local indices), "diagonal" (a query blocked from its
    own key), "finite" (-1e9 instead of -inf), "none"."""
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, bq, D) @ (B, H, D, bk) -> (B, H, bq, bk)
    if causal and mask != "none":
        i = torch.arange(q.shape[2]).unsqueeze(1)  # (bq, 1)
        j = torch.arange(k.shape[2]).unsqueeze(0)  # (1, bk)
        if mask == "local":
            blocked = j > i
        elif mask == "diagonal":
            blocked = k_start + j >= q_start + i
        else:
            blocked = k_start + j > q_start + i
        s = s.masked_fill(blocked, -1e9 if mask == "finite" else NEG_INF)
    return s


def _fold(
    m,
    l,
    acc,
    q,
    k,
    v,
    scale,
    q_start,
    k_start,
    causal,
    *,
    mask="absolute",
    rescale_l=True,
    rescale_acc=True,
    normalise=False,
    old_max=False,
):
    """One key tile folded into (m, l, acc)."""
    s = _scores(q, k, scale, q_start, k_start, causal, mask)
    m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # (B, H, bq, 1)
    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    m_old_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - (m_old_safe if old_max else m_safe))  # (B, H, bq, bk)
    alpha = torch.exp(m - m_safe)
    l_new = (l * alpha if rescale_l else l) + p.sum(dim=-1, keepdim=True)
    acc_new = (acc * alpha if rescale_acc else acc) + p @ v  # (B, H, bq, bk) @ (B, H, bk, D)
    if normalise:
        acc_new = acc_new / torch.where(l_new == 0, torch.ones_like(l_new), l_new)
    return m_new, l_new, acc_new


FOLD_MISTAKES = [  # (keywords for _fold, what they mean)
    (
        dict(rescale_l=False, rescale_acc=False),
        "neither l nor acc was rescaled: when the max rises from m to m_new, what was summed under m "
        "must be multiplied by alpha = exp(m - m_new), in l and in acc",
    ),
    (dict(rescale_acc=False), "acc was not rescaled: multiply the old acc by alpha = exp(m - m_new), as you did l"),
    (
        dict(rescale_l=False),
        "l was not rescaled: the old sum was taken under the old max; l_new = l * exp(m - m_new) + rowsum(p)",
    ),
    (
        dict(normalise=True),
        "acc was divided by l: keep acc unnormalised in the loop; the division by l happens once, "
        "after the last tile (Step 5.2)",
    ),
    (
        dict(old_max=True),
        "p was taken under the old max: compute p = exp(s - m_new) with the new max, then rescale "
        "the old l and acc by exp(m - m_new)",
    ),
    (
        dict(mask="none"),
        "the causal mask is missing: before the max, set the score of every key after its query "
        "(k_start + j > q_start + i) to -inf",
    ),
    (
        dict(mask="local"),
        "the mask compared positions inside the tile (j > i): tiles start at q_start and k_start, "
        "so compare absolute positions, k_start + j > q_start + i",
    ),
    (dict(mask="diagonal"), "a query was blocked from its own key: mask only keys strictly after it (k_pos > q_pos)"),
    (
        dict(mask="finite"),
        "masked scores must be -inf, not a large negative number: in a row that sees no key of the "
        "tile, every masked score then equals the max, and each adds exp(0) = 1 to l",
    ),
]


def _tile_forward(
    q,
    k,
    v,
    q_start,
    scale,
    causal,
    block_n,
    *,
    fold=None,
    end="causal",
    normalise_in_loop=False,
    divide=True,
    lse="m + log l",
):
    """One query tile's (o, L) over the key tiles it needs. end: "causal" (stop after the tile
    holding the last query), "full tiles" (a partial last key tile skipped), "before diagonal"
    (stop before the tile holding the first query); lse: "m + log l" or "log l"."""
    B, H, bq, D = q.shape
    T = k.shape[2]
    m = q.new_full((B, H, bq, 1), NEG_INF)
    l, acc = q.new_zeros(B, H, bq, 1), q.new_zeros(B, H, bq, D)
    stop = min(q_start + bq, T) if causal else T
    if end == "before diagonal":
        stop = q_start
    for k_start in range(0, stop, block_n):
        k_end = min(k_start + block_n, T)
        if end == "full tiles" and k_end - k_start < block_n:
            continue
        m, l, acc = _fold(
            m,
            l,
            acc,
            q,
            k[:, :, k_start:k_end],
            v[:, :, k_start:k_end],
            scale,
            q_start,
            k_start,
            causal,
            **(fold or {}),
        )
        if normalise_in_loop:
            acc = acc / torch.where(l == 0, torch.ones_like(l), l)
    o = acc / l if divide else acc
    L = torch.log(l) if lse == "log l" else m + torch.log(l)
    return o, L.squeeze(-1)  # (B, H, bq, D), (B, H, bq)


TILE_MISTAKES = [  # (keywords for _tile_forward, what they mean)
    (dict(lse="log l"), "L = log(l) misses the max: l was summed as exp(s - m), so the log-sum-exp is L = m + log(l)"),
    (
        dict(normalise_in_loop=True),
        "acc was divided by l inside the loop: later tiles then add unnormalised terms to a "
        "normalised acc; divide once, after the last tile",
    ),
    (dict(divide=False), "o is still unnormalised: after the last tile, divide acc by l"),
    (
        dict(end="full tiles"),
        "the last key tile was skipped because it is partial (T is no multiple of block_n): visit "
        "it too, k[:, :, k_start:min(k_start + block_n, T)]",
    ),
    (
        dict(end="before diagonal"),
        "the loop stopped before the diagonal tile: a query sees keys up to its own position, so "
        "visit every key tile that starts before min(q_start + bq, T)",
    ),
]


def _flash_forward(q, k, v, causal, block_m, block_n, *, scale=None, q_start_index=False, tile=None):
    """(O (B, H, T, D), L (B, H, T)) tile by tile."""
    B, H, T, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    O, L = torch.zeros_like(q), q.new_zeros(B, H, T)
    for i, q_start in enumerate(range(0, T, block_m)):
        rows = slice(q_start, min(q_start + block_m, T))
        O[:, :, rows], L[:, :, rows] = _tile_forward(
            q[:, :, rows], k, v, i if q_start_index else q_start, scale, causal, block_n, **(tile or {})
        )
    return O, L


def _forward_truth(q, k, v, causal):
    """attention_ref's output (B, H, T, D) and the log-sum-exp (B, H, T) of each row's scaled,
    masked scores."""
    T, D = q.shape[2], q.shape[3]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)  # (B, H, T, T)
    if causal:
        scores = scores + causal_mask(T, dtype=q.dtype)
    return attention_ref(q, k, v, causal=causal), torch.logsumexp(scores, dim=-1)


def _tile_backward(
    q,
    k,
    v,
    do,
    L,
    delta,
    scale,
    q_start,
    k_start,
    causal,
    *,
    mask="absolute",
    p_from="L",
    subtract_delta=True,
    times_p=True,
    scale_dq=True,
    scale_dk=True,
):
    """One tile's (dq, dk, dv). p_from: "L" (P = exp(S - L), right), "exp" (exp(S), L
    forgotten), "tile softmax" (a softmax over this tile's keys only)."""
    s = _scores(q, k, scale, q_start, k_start, causal, mask)  # (B, H, bq, bk)
    if p_from == "tile softmax":
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    elif p_from == "exp":
        p = torch.exp(s)
    else:
        p = torch.exp(s - L.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ do  # (B, H, bk, bq) @ (B, H, bq, D) -> (B, H, bk, D)
    dp = do @ v.transpose(-2, -1)  # (B, H, bq, bk)
    centred = dp - delta.unsqueeze(-1) if subtract_delta else dp
    ds = p * centred if times_p else centred.masked_fill(torch.isneginf(s), 0.0)
    dq = (ds @ k) * (scale if scale_dq else 1.0)  # (B, H, bq, D)
    dk = (ds.transpose(-2, -1) @ q) * (scale if scale_dk else 1.0)  # (B, H, bk, D)
    return dq, dk, dv


BACKWARD_TILE_MISTAKES = [  # (keywords for _tile_backward, what they mean)
    (
        dict(subtract_delta=False),
        "dS = P ∘ dP misses the softmax's correction: dS = P ∘ (dP - delta), delta = rowsum(dO ∘ O) per query",
    ),
    (dict(times_p=False), "dS = dP - delta misses the factor P: the softmax's backward is dS = P ∘ (dP - delta)"),
    (
        dict(scale_dq=False, scale_dk=False),
        "dQ and dK miss the scale: S = q kᵀ · scale, so dQ = dS k · scale and dK = dSᵀ q · scale",
    ),
    (dict(scale_dq=False), "dQ misses the scale: dQ = dS k · scale (S = q kᵀ · scale)"),
    (dict(scale_dk=False), "dK misses the scale: dK = dSᵀ q · scale (S = q kᵀ · scale)"),
    (
        dict(p_from="exp"),
        "P = exp(S) forgets the forward's normaliser: recompute P = exp(S - L), L the saved log-sum-exp",
    ),
    (
        dict(p_from="tile softmax"),
        "P was normalised over this tile's keys only: a row's softmax runs over all its keys, and "
        "L holds that whole sum: P = exp(S - L)",
    ),
    (
        dict(mask="none"),
        "the recomputed P misses the causal mask: keys after their query "
        "(k_start + j > q_start + i) get S = -inf, hence P = 0",
    ),
    (
        dict(mask="local"),
        "the mask compared positions inside the tile (j > i): compare absolute positions, k_start + j > q_start + i",
    ),
    (dict(mask="diagonal"), "a query was blocked from its own key: mask only keys strictly after the query"),
]


def _flash_backward(
    q,
    k,
    v,
    o,
    L,
    do,
    causal,
    block_m,
    block_n,
    *,
    delta_from="dO * O",
    accumulate=True,
    skip_partial=False,
    end="causal",
    tile=None,
):
    """(dq, dk, dv) summed over every visited tile. delta_from: "dO * O" (right), "dO"
    (rowsum(dO)), "zero"; end: "causal" or "before diagonal"."""
    B, H, T, D = q.shape
    scale = 1 / math.sqrt(D)
    delta = {"dO * O": lambda: (do * o).sum(-1), "dO": lambda: do.sum(-1), "zero": lambda: torch.zeros_like(L)}[
        delta_from
    ]()  # (B, H, T)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q_start in range(0, T, block_m):
        rows = slice(q_start, min(q_start + block_m, T))
        stop = (q_start if end == "before diagonal" else rows.stop) if causal else T
        for k_start in range(0, stop, block_n):
            cols = slice(k_start, min(k_start + block_n, T))
            if skip_partial and (cols.stop - k_start < block_n or rows.stop - q_start < block_m):
                continue
            parts = _tile_backward(
                q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                do[:, :, rows],
                L[:, :, rows],
                delta[:, :, rows],
                scale,
                q_start,
                k_start,
                causal,
                **(tile or {}),
            )
            for total, index, part in ((dq, rows, parts[0]), (dk, cols, parts[1]), (dv, cols, parts[2])):
                if accumulate:
                    total[:, :, index] += part
                else:
                    total[:, :, index] = part
    return dq, dk, dv


# --------------------------------------------------------------------------- inputs
def _rand(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def _empty_state(B, H, bq, D):
    """m = -inf, l = 0, acc = 0: a query tile before its first key tile."""
    return torch.full((B, H, bq, 1), NEG_INF), torch.zeros(B, H, bq, 1), torch.zeros(B, H, bq, D)


def _lib_fold(m, l, acc, q, k, v, scale, q_start, k_start, causal):
    """What lib does with a tile: mask the scores, then lib.attention.online_softmax_update."""
    return online_softmax_update(m, l, acc, _scores(q, k, scale, q_start, k_start, causal), v)


def _fold_cases():
    """(case, args) for step 5.1; a state other than the empty one is lib's after earlier tiles."""
    g = torch.Generator().manual_seed(50)
    B, H, D = 1, 2, 8
    scale = 1 / math.sqrt(D)
    r = lambda *shape, s=1.0: _rand(g, B, H, *shape, D, scale=s)  # noqa: E731
    q, k1, v1, v2 = r(4), r(4), r(4), r(6)
    k2 = r(6, s=3.0)  # larger scores: the running max rises in most rows
    state1 = _lib_fold(*_empty_state(B, H, 4, D), q, k1, v1, scale, 0, 4, False)
    qc, kc, vc = r(4), r(8), r(8)
    state_c = _lib_fold(*_empty_state(B, H, 4, D), qc, r(8), r(8), scale, 12, 0, True)  # keys 0..7
    qd, kd, vd = r(4), r(4), r(4)
    state_d = _lib_fold(*_empty_state(B, H, 4, D), qd, r(8), r(8), scale, 8, 0, True)  # keys 0..7
    qe, ke, ve = r(4), r(4), r(4)
    return [
        (
            "the first key tile, from the empty state (m = -inf, l = 0, acc = 0), no mask",
            (*_empty_state(B, H, 4, D), q, k1, v1, scale, 0, 4, False),
        ),
        (
            "a second tile with larger scores: the running max rises, so l and acc must be rescaled",
            (*state1, q, k2, v2, scale, 0, 8, False),
        ),
        (
            "causal, the diagonal tile: queries 8..11 and keys 8..11, after keys 0..7",
            (*state_d, qd, kd, vd, scale, 8, 8, True),
        ),
        (
            "causal, tiles at different offsets: queries 12..15, keys 8..15 (compare absolute positions)",
            (*state_c, qc, kc, vc, scale, 12, 8, True),
        ),
        (
            "causal, from the empty state, queries 0..3 and keys 2..5: rows 0 and 1 see no key of "
            "this tile (they keep m = -inf, l = 0, acc = 0)",
            (*_empty_state(B, H, 4, D), qe, ke, ve, scale, 0, 2, True),
        ),
    ]


# --------------------------------------------------------------------------- 5.1 one key tile
def check_fold_key_tile(fn) -> CheckReport:
    """fn(m, l, acc, q, k, v, scale, q_start, k_start, causal) -> (m, l, acc): q (B, H, bq, D) a
    query tile at positions q_start.., k and v (B, H, bk, D) a key tile at k_start.., m and l
    (B, H, bq, 1), acc (B, H, bq, D); the tile's scores q kᵀ · scale (keys after their query at
    -inf under causal) folded into the running softmax."""
    name = "Step 5.1 (fold one key tile into the running softmax)"
    cases = _fold_cases()
    for case, args in cases:
        copies = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in args)
        got, report = _call(name, fn, copies, case, len(cases))
        if report is not None:
            return report
        m, l, acc, q, k, v, scale, q_start, k_start, causal = args
        variants = [
            (
                lambda: _fold(m, l, acc, q, k, v, 1.0, q_start, k_start, causal),
                "the scores were not scaled: s = (q @ kᵀ) * scale",
            )
        ]
        variants += [(lambda kw=kw, args=args: _fold(*args, **kw), hint) for kw, hint in FOLD_MISTAKES]

        def diagnose(got, variants=variants):
            if any(bool(torch.isnan(t).any()) for t in got):
                return (
                    "a row that has seen no key has m_new = -inf, and exp(-inf - (-inf)) "
                    "is NaN: subtract 0 where m_new is -inf "
                    "(m_safe = torch.where(torch.isneginf(m_new), 0, m_new))"
                )
            return _first_match(got, variants)

        column = "m and l are columns (B, H, bq, 1): take amax and sum with keepdim=True"
        report = _tuple_report(
            name,
            len(cases),
            case,
            got,
            _lib_fold(*args),
            ("m", "l", "acc"),
            diagnose=diagnose,
            shape_hints={"m": column, "l": column},
            default_hint="m_new = max(m, rowmax(s)); "
            "l = l·exp(m - m_new) + rowsum(exp(s - m_new)); "
            "acc = acc·exp(m - m_new) + exp(s - m_new) @ v",
        )
        if report is not None:
            return report
    return CheckReport(name, True, len(cases))


# --------------------------------------------------------------------------- 5.2 one query tile
def _poisoned(k, v, first_unneeded: int):
    """k and v with NaN from position `first_unneeded` on: keys a flash kernel never loads for
    this query tile, so a loop that visits them shows."""
    k, v = k.clone(), v.clone()
    k[:, :, first_unneeded:] = float("nan")
    v[:, :, first_unneeded:] = float("nan")
    return k, v


def check_forward_query_tile(fn) -> CheckReport:
    """fn(q, k, v, q_start, scale, causal, block_n) -> (o (B, H, bq, D), L (B, H, bq)): q a query
    tile at positions q_start.., k and v (B, H, T, D) every key; the tile's rows of attention_ref
    and their log-sum-exp, folding key tiles of block_n keys and, under causal, none that lies
    wholly after the tile's last query."""
    name = "Step 5.2 (one query tile: walk the key tiles, then normalise)"
    g = torch.Generator().manual_seed(51)
    B, H, D = 2, 2, 8
    specs = [  # (case, T, q_start, bq, block_n, causal, poison)
        ("no mask, queries 3..5, T = 10 keys in tiles of 4 (the last tile holds 2)", 10, 3, 3, 4, False, False),
        (
            "causal, queries 4..6 of T = 10, key tiles of 4: the second tile holds the diagonal",
            10,
            4,
            3,
            4,
            True,
            False,
        ),
        ("T = 1: one query, one key", 1, 0, 1, 4, True, False),
        (
            "causal, queries 7..9 of T = 10, key tiles of 3: the diagonal runs through a partial last tile",
            10,
            7,
            3,
            3,
            True,
            False,
        ),
        (
            "causal, queries 0..3 of T = 12, key tiles of 4: keys 4..11 hold NaN, as a flash kernel "
            "never loads them for this tile",
            12,
            0,
            4,
            4,
            True,
            True,
        ),
    ]
    for case, T, q_start, bq, block_n, causal, poison in specs:
        q_all, k, v = _rand(g, B, H, T, D), _rand(g, B, H, T, D), _rand(g, B, H, T, D)
        rows = slice(q_start, q_start + bq)
        q = q_all[:, :, rows].clone()
        scale = 1 / math.sqrt(D)
        o_all, L_all = _forward_truth(q_all, k, v, causal)
        expected = (o_all[:, :, rows], L_all[:, :, rows])
        k_in, v_in = _poisoned(k, v, math.ceil((q_start + bq) / block_n) * block_n) if poison else (k, v)
        got, report = _call(name, fn, (q, k_in, v_in, q_start, scale, causal, block_n), case, len(specs))
        if report is not None:
            return report
        args = (q, k, v, q_start, scale, causal, block_n)

        def compute(args=args, **kw):
            return _tile_forward(*args, **kw)

        variants = [(lambda kw=kw, compute=compute: compute(**kw), hint) for kw, hint in TILE_MISTAKES]
        variants += _inherited("fold", FOLD_MISTAKES, "5.1", compute)
        variants.append(
            (
                lambda args=args: _tile_forward(*args[:4], 1.0, *args[5:]),
                "this comes from Step 5.1, or the scale you passed it: the scores are (q @ kᵀ) * scale",
            )
        )

        def diagnose(got, variants=variants, poison=poison):
            hint = _first_match(got, variants)
            if hint is None and poison and any(bool(torch.isnan(t).any()) for t in got):
                hint = (
                    "you visited key tiles that lie wholly after the tile's last query (this "
                    "case filled them with NaN): under causal, stop the loop at "
                    "min(q_start + bq, T), as a flash kernel does"
                )
            return hint

        report = _tuple_report(
            name,
            len(specs),
            case,
            got,
            expected,
            ("o", "L"),
            diagnose=diagnose,
            shape_hints={
                "L": "one number per query row: L has shape (B, H, bq); m + log(l) is (B, H, bq, 1), so .squeeze(-1)",
                "o": "o has the query tile's shape (B, H, bq, D)",
            },
            default_hint="o = acc / l after the last tile; L = m + log(l) per row",
        )
        if report is not None:
            return report
    return CheckReport(name, True, len(specs))


# --------------------------------------------------------------------------- 5.3 the whole forward
SENTENCE = (
    "When a language model reads a sentence, each new word looks back at the words "
    "before it and decides which of them matter."
)
LAYER = 15


@lru_cache(maxsize=1)
def real_attention_inputs():
    """SmolLM2-135M-Instruct's layer-15 attention on a real sentence, in float32: its queries,
    keys and values (1, H, T, D) (RoPE applied, the 3 key/value heads repeated for the 9 query
    heads) and the attention output that layer's own forward computes (captured just before
    o_proj); None where the model is not installed. Loaded once, in a few seconds."""
    try:
        from lib.smollm2 import encode, load_smollm2

        model, _ = load_smollm2(dtype=torch.float32)
        idx = encode(SENTENCE)  # (1, T)
    except Exception:  # no model here: the checks run without their real case and say so
        return None
    T = idx.shape[1]
    rope = (model.rope_cos[:T], model.rope_sin[:T])  # (T, D) each: positions 0..T-1
    block, seen = model.model.layers[LAYER], {}
    hook = block.self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args: seen.update(y=args[0])
    )  # (1, T, H·D): the attention's output
    try:
        with torch.no_grad():
            x = model.model.embed_tokens(idx)  # (1, T, C); only the layers up to LAYER run
            for earlier in model.model.layers[:LAYER]:
                x = earlier(x, rope=rope)
            x = block.input_layernorm(x)
            block.self_attn(x, rope=rope)  # the layer's own attention, as the model runs it
            q, k, v = block.self_attn.project(x, rope)  # (1, H, T, D), 2 x (1, H_kv, T, D)
    finally:
        hook.remove()
    H, group = q.shape[1], q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))  # (1, H_kv, T, D) -> (1, H, T, D)
    out = seen["y"].view(1, T, H, -1).transpose(1, 2)  # (1, T, H·D) -> (1, H, T, D)
    return tuple(t.detach().float().contiguous() for t in (q, k, v, out))


def _skipped(name: str, n_cases: int) -> CheckReport:
    return CheckReport(f"{name} (SmolLM2 is not installed here: its real case was skipped)", True, n_cases)


def check_flash_forward(fn) -> CheckReport:
    """fn(q, k, v, causal, block_m, block_n) -> (O (B, H, T, D), L (B, H, T)) for q, k, v
    (B, H, T, D): attention_ref's output and each row's log-sum-exp of its scaled (1/√D), masked
    scores; then SmolLM2's layer 15, against the model's own attention output."""
    name = "Step 5.3 (the whole tiled forward)"
    g = torch.Generator().manual_seed(52)
    specs = [  # (case, B, H, T, D, causal, block_m, block_n)
        ("no mask, T = 37 with 16 × 16 tiles (the last tiles are partial)", 2, 2, 37, 8, False, 16, 16),
        ("causal, T = 37, BLOCK_M = 16, BLOCK_N = 8", 2, 2, 37, 16, True, 16, 8),
        ("causal, T = 20, BLOCK_M = 8, BLOCK_N = 16 (a key tile wider than a query tile)", 1, 3, 20, 8, True, 8, 16),
        ("T = 1, causal", 1, 2, 1, 8, True, 16, 16),
    ]
    n = len(specs) + 1
    for case, B, H, T, D, causal, bm, bn in specs:
        q, k, v = (_rand(g, B, H, T, D) for _ in range(3))
        report = _forward_case(name, fn, case, (q, k, v, causal, bm, bn), None, TOL, n)
        if report is not None:
            return report
    real = real_attention_inputs()
    if real is None:
        return _skipped(name, len(specs))
    q, k, v, out = real
    case = (
        f"SmolLM2-135M layer {LAYER} on a real sentence ({q.shape[2]} tokens, {q.shape[1]} "
        f"heads, D = {q.shape[3]}, causal, 16 × 16 tiles), against the model's own attention"
    )
    # fp32 against the model's own fp32 attention: the same sums in another order; 1e-5 of the
    # largest output entry, the bound lesson 05 holds its kernel to
    tol = dict(rtol=1e-4, atol=1e-5 * out.abs().max().item())
    report = _forward_case(name, fn, case, (q, k, v, True, 16, 16), out, tol, n)
    return report if report is not None else CheckReport(name, True, n)


def _forward_case(name, fn, case, args, truth, tol, n_cases) -> CheckReport | None:
    q, k, v, causal, block_m, block_n = args
    got, report = _call(name, fn, args, case, n_cases)
    if report is not None:
        return report
    o, L = _forward_truth(q, k, v, causal)
    expected = (o if truth is None else truth, L)
    T, D = q.shape[2], q.shape[3]

    def compute(**kw):
        return _flash_forward(q, k, v, causal, block_m, block_n, **kw)

    variants = [
        (lambda: compute(scale=1.0), "the scores were not scaled: scale = 1 / sqrt(D), with D = q.shape[-1]"),
        (lambda: compute(scale=1.0 / D), "the scale is 1 / sqrt(D), not 1 / D"),
        (
            lambda: compute(q_start_index=True),
            "the tile was given its index i as q_start: q_start is the position of its first query, i · block_m",
        ),
    ]
    variants += _inherited("tile", TILE_MISTAKES, "5.2", compute)
    variants += _inherited("tile", [(dict(fold=kw), hint) for kw, hint in FOLD_MISTAKES], "5.1", compute)

    def diagnose(got):
        hint = _first_match(got, variants)
        full = T - T % block_m  # the rows of the whole query tiles
        if (
            hint is None
            and full < T
            and all(_close(g[:, :, :full], e[:, :, :full], tol) for g, e in zip(got, expected))
        ):
            hint = (
                f"the last {T - full} queries are wrong, the others right: T = {T} is no "
                f"multiple of block_m = {block_m}, so the last query tile is partial; run it "
                "too, rows q_start..min(q_start + block_m, T)"
            )
        return hint

    return _tuple_report(
        name,
        n_cases,
        case,
        got,
        expected,
        ("O", "L"),
        tol=tol,
        diagnose=diagnose,
        shape_hints={"L": "one number per query: L has shape (B, H, T)", "O": "O has q's shape (B, H, T, D)"},
        default_hint="for each query tile at q_start = 0, block_m, ...: its rows of O and L from "
        "your Step 5.2, with scale = 1 / sqrt(D)",
    )


# --------------------------------------------------------------------------- 5.4 one backward tile
def _backward_inputs(g, B, H, T, D, causal):
    """q, k, v, dO (B, H, T, D), and what the forward saved: O, L (B, H, T), and
    delta = rowsum(dO ∘ O) (B, H, T)."""
    q, k, v, do = (_rand(g, B, H, T, D) for _ in range(4))
    o, L = _forward_truth(q, k, v, causal)
    return q, k, v, do, o, L, (do * o).sum(-1)


BACKWARD_TILE_SHAPES = {
    "dq": "dq has the query tile's shape (B, H, bq, D)",
    "dk": "dk has the key tile's shape (B, H, bk, D): dK = dSᵀ q, (bk, bq) @ (bq, D)",
    "dv": "dv has the key tile's shape (B, H, bk, D): dV = Pᵀ dO, (bk, bq) @ (bq, D)",
}


def _backward_tile_report(name, fn, case, args, n_cases):
    """(got, None) when the learner's tile is right, else (None, report)."""
    got, report = _call(name, fn, args, case, n_cases)
    if report is not None:
        if report.problem.startswith("your function raised") and "must match the size" in report.problem:
            report.hint = (
                "L and delta are (B, H, bq), one number per query row: give them a "
                "last dimension, L.unsqueeze(-1), before subtracting them from the "
                "(B, H, bq, bk) scores or dP"
            )
        return None, report
    variants = [(lambda kw=kw: _tile_backward(*args, **kw), hint) for kw, hint in BACKWARD_TILE_MISTAKES]
    report = _tuple_report(
        name,
        n_cases,
        case,
        got,
        _tile_backward(*args),
        ("dq", "dk", "dv"),
        diagnose=lambda got: _first_match(got, variants),
        shape_hints=BACKWARD_TILE_SHAPES,
        default_hint="P = exp(S - L); dV = Pᵀ dO; dP = dO vᵀ; dS = P ∘ (dP - delta); "
        "dQ = dS k · scale; dK = dSᵀ q · scale",
    )
    return (None, report) if report is not None else (got, None)


def check_backward_tile(fn) -> CheckReport:
    """fn(q, k, v, do, L, delta, scale, q_start, k_start, causal) -> (dq (B, H, bq, D),
    dk (B, H, bk, D), dv (B, H, bk, D)): one (query tile, key tile) pair's share of the gradients,
    P = exp(S - L) recomputed; summed over a sequence's tiles, equal to attention_backward_ref."""
    name = "Step 5.4 (the backward of one tile)"
    g = torch.Generator().manual_seed(53)
    D = 8
    scale = 1 / math.sqrt(D)
    specs = [  # (case, T, causal, query rows, key rows)
        ("no mask: queries 0..3 against keys 4..9 (bq = 4, bk = 6)", 10, False, (0, 4), (4, 10)),
        ("causal, the diagonal tile: queries and keys 4..7", 12, True, (4, 8), (4, 8)),
        (
            "causal, queries 8..11 against keys 4..11: part of the tile lies after its queries",
            12,
            True,
            (8, 12),
            (4, 12),
        ),
    ]
    n = len(specs) + 1
    for case, T, causal, (qs, qe), (ks, ke) in specs:
        q, k, v, do, o, L, delta = _backward_inputs(g, 2, 2, T, D, causal)
        rows, cols = slice(qs, qe), slice(ks, ke)
        args = (
            q[:, :, rows],
            k[:, :, cols],
            v[:, :, cols],
            do[:, :, rows],
            L[:, :, rows],
            delta[:, :, rows],
            scale,
            qs,
            ks,
            causal,
        )
        _, report = _backward_tile_report(name, fn, case, args, n)
        if report is not None:
            return report
    # the shares of every tile a causal sequence visits, summed, are the whole gradient
    T, b = 13, 4
    case = f"summed over every tile a causal T = {T} visits ({b} × {b} tiles)"
    q, k, v, do, o, L, delta = _backward_inputs(g, 1, 2, T, D, True)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs in range(0, T, b):
        rows = slice(qs, min(qs + b, T))
        for ks in range(0, rows.stop, b):
            cols = slice(ks, min(ks + b, T))
            args = (
                q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                do[:, :, rows],
                L[:, :, rows],
                delta[:, :, rows],
                scale,
                qs,
                ks,
                True,
            )
            got, report = _backward_tile_report(name, fn, f"{case}: queries {qs}.., keys {ks}..", args, n)
            if report is not None:
                return report
            dq[:, :, rows] += got[0]
            dk[:, :, cols] += got[1]
            dv[:, :, cols] += got[2]
    report = _tuple_report(
        name,
        n,
        case + ", against attention_backward_ref",
        (dq, dk, dv),
        attention_backward_ref(q, k, v, do, causal=True),
        ("dq", "dk", "dv"),
    )
    return report if report is not None else CheckReport(name, True, n)


# --------------------------------------------------------------------------- 5.5 the whole backward
def check_flash_backward(fn) -> CheckReport:
    """fn(q, k, v, o, L, do, causal, block_m, block_n) -> (dq, dk, dv), each (B, H, T, D): the
    gradients of attention_ref's output against do, from the forward's o and L, tile by tile;
    then on SmolLM2's layer 15 with a random do."""
    name = "Step 5.5 (the whole tiled backward)"
    g = torch.Generator().manual_seed(54)
    specs = [  # (case, B, H, T, D, causal, block_m, block_n)
        ("no mask, T = 23 with 8 × 8 tiles (partial last tiles)", 2, 2, 23, 8, False, 8, 8),
        ("causal, T = 23, BLOCK_M = 8, BLOCK_N = 4", 2, 2, 23, 8, True, 8, 4),
        ("causal, T = 19, BLOCK_M = 4, BLOCK_N = 8 (a key tile wider than a query tile)", 1, 3, 19, 16, True, 4, 8),
        ("T = 1, causal", 1, 2, 1, 8, True, 8, 8),
    ]
    n = len(specs) + 1
    for case, B, H, T, D, causal, bm, bn in specs:
        q, k, v, do = (_rand(g, B, H, T, D) for _ in range(4))
        report = _backward_case(name, fn, case, (q, k, v, do, causal, bm, bn), TOL, n)
        if report is not None:
            return report
    real = real_attention_inputs()
    if real is None:
        return _skipped(name, len(specs))
    q, k, v, _ = real
    do = _rand(g, *q.shape)
    case = (
        f"SmolLM2-135M layer {LAYER}'s queries, keys and values ({q.shape[2]} tokens, causal, "
        "16 × 16 tiles), a random dO"
    )
    # fp32 sums of products of the model's large entries (|q|, |k| up to ~20): 1e-5 of each
    # gradient's largest entry, the bound lesson 05 holds its kernel to
    report = _backward_case(name, fn, case, (q, k, v, do, True, 16, 16), "relative", n)
    return report if report is not None else CheckReport(name, True, n)


@contextmanager
def _tiles_visited(fn):
    """While open, the notebook's my_backward_tile (found through the globals of `fn`, the
    learner's my_flash_backward) records the (q_start, k_start, bq) of every call into the list
    it yields; None when that namespace holds no such function. Put back on exit."""
    target = inspect.unwrap(fn) if callable(fn) else fn
    namespace = getattr(target, "__globals__", None)
    tile = None if namespace is None else namespace.get("my_backward_tile")
    if not callable(tile) or tile is target:
        yield None
        return
    try:
        signature = inspect.signature(tile)
    except (TypeError, ValueError):
        yield None
        return
    visited = []

    def recording(*args, **kwargs):
        try:  # by position in the learner's own signature, whatever they named the parameters
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = list(bound.arguments.values())
            visited.append((int(values[7]), int(values[8]), int(values[0].shape[2])))
        except (TypeError, ValueError, IndexError, AttributeError):
            pass
        return tile(*args, **kwargs)

    namespace["my_backward_tile"] = recording
    try:
        yield visited
    finally:
        namespace["my_backward_tile"] = tile


def _future_tiles(visited, T: int, block_m: int, block_n: int, causal: bool) -> list:
    """The visited (q_start, k_start) pairs a flash backward skips: not among the tiles
    key_block_bounds gives a query tile, and lying wholly after the tile's last query."""
    needed = {
        (i * block_m, j * block_n)
        for i in range(cdiv(T, block_m))
        for j in range(key_block_bounds(i, T, block_m, block_n, causal)[1])
    }
    return sorted({(qs, ks) for qs, ks, bq in visited if causal and (qs, ks) not in needed and ks >= qs + bq})


def _backward_case(name, fn, case, args, tol, n_cases) -> CheckReport | None:
    q, k, v, do, causal, block_m, block_n = args
    o, L = _forward_truth(q, k, v, causal)
    with _tiles_visited(fn) as visited:
        got, report = _call(name, fn, (q, k, v, o, L, do, causal, block_m, block_n), case, n_cases)
    if report is not None:
        return report
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():  # the truth: autograd through attention_ref
        expected = torch.autograd.grad(attention_ref(*leaves, causal=causal), leaves, do)
    if tol == "relative":
        tol = dict(rtol=1e-4, atol=1e-5 * max(t.abs().max().item() for t in expected))

    def compute(**kw):
        return _flash_backward(q, k, v, o, L, do, causal, block_m, block_n, **kw)

    variants = [
        (lambda: compute(delta_from="dO"), "delta = rowsum(dO) forgot O: delta_i = rowsum(dO ∘ O), (do * o).sum(-1)"),
        (
            lambda: compute(delta_from="zero"),
            "no delta was subtracted: either delta is zero here (delta_i = rowsum(dO ∘ O), "
            "(do * o).sum(-1)) or your Step 5.4 tile leaves it out (dS = P ∘ (dP - delta))",
        ),
        (
            lambda: compute(accumulate=False),
            "each tile overwrote the gradients instead of adding to them: dq of a query tile sums "
            "over its key tiles, dk and dv of a key tile over its query tiles (+=)",
        ),
        (
            lambda: compute(skip_partial=True),
            "partial tiles were skipped (T is no multiple of the tile size): slice up to min(start + block, T)",
        ),
        (
            lambda: compute(end="before diagonal"),
            "the diagonal tiles were skipped: under causal a query tile needs every key tile that "
            "starts before its last query + 1",
        ),
    ]
    variants += _inherited("tile", BACKWARD_TILE_MISTAKES, "5.4", compute)
    report = _tuple_report(
        name,
        n_cases,
        case,
        got,
        expected,
        ("dq", "dk", "dv"),
        tol=tol,
        diagnose=lambda got: _first_match(got, variants),
        shape_hints={d: f"{d} has the shape of {d[1]}: (B, H, T, D)" for d in ("dq", "dk", "dv")},
        default_hint="delta = rowsum(dO ∘ O); for each query tile and each key tile it visits, add "
        "your Step 5.4 shares into dq[rows], dk[cols], dv[cols]",
    )
    future = _future_tiles(visited or [], q.shape[2], block_m, block_n, causal)
    if report is None and future:  # right sums: a future tile's shares are all zero
        qs, ks = future[0]
        return CheckReport(
            name,
            False,
            n_cases,
            case,
            f"the gradients are right, but my_backward_tile ran on {len(future)} (query tile, "
            f"key tile) pair(s) that lie wholly in the queries' future, such as queries "
            f"{qs}..{min(qs + block_m, q.shape[2]) - 1} with keys {ks}..",
            "the causal skip is missing: under causal, a query tile at q_start visits only the "
            "key tiles that start before min(q_start + block_m, T), as in your forward (Step "
            "5.2) and key_block_bounds; the others' shares are zero, and a flash kernel never "
            "loads them",
        )
    return report
