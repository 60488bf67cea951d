"""Checks for lesson 05, "Attention kernels".

check_online_softmax_update(fn)  fn(m, l, acc, scores, values) -> (m, l, acc), one online-softmax
                                 step, equal to lib.attention.online_softmax_update
check_key_block_bounds(fn)       fn(block_index, T, block_m, block_n, causal) -> (n_full, n_end),
                                 equal to lib.kernels.key_block_bounds
check_row_logsumexp(fn)          fn(x (R, C) float32) -> (R,) float32, the row-wise log-sum-exp
                                 computed by the learner's Triton kernel, equal to torch.logsumexp
check_merge_attention(fn)        fn(o1, lse1, o2, lse2) -> (o, lse): two blocks' normalised attention
                                 outputs and log-sum-exps merged into attention over both blocks
                                 (the split-KV step of flash-decoding), equal to attention_ref
"""

from __future__ import annotations

import torch

from lib.attention import attention_ref, attention_scores, online_softmax_update
from lib.course.exercises import CheckReport, call_learner
from lib.kernels.flash import key_block_bounds

__all__ = ["check_key_block_bounds", "check_merge_attention", "check_online_softmax_update", "check_row_logsumexp"]


# --------------------------------------------------------------------------- 5.1 online softmax
def _update_cases():
    """(name, scores (R, S), values (S, D_v), block edges): each case folds its blocks in order."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(10, 3, generator=g)
    rising = torch.tensor([[0.0, 1.0, -2.0, 0.5, 8.0, 1.0, -1.0, 9.0, 0.0, 2.0]])  # the max arrives late
    plain = torch.randn(2, 10, generator=g)
    masked = plain.clone()
    masked[0, :4] = float("-inf")  # row 0 sees no key in the first block (as under a causal mask)
    return [
        ("one block: a plain softmax", plain, v, (0, 10)),
        ("two blocks, the second with a larger max (rescaling needed)", rising, v, (0, 4, 10)),
        ("three ragged blocks of 4, 4 and 2 keys, negative scores", plain - 5.0, v, (0, 4, 8, 10)),
        ("a row whose first block is fully masked (-inf)", masked, v, (0, 4, 8, 10)),
    ]


def check_online_softmax_update(fn) -> CheckReport:
    """fn(m (R, 1), l (R, 1), acc (R, D_v), scores (R, bk), values (bk, D_v)) -> (m, l, acc)."""
    name = "Exercise 5.1 (one online-softmax update)"
    cases = _update_cases()
    for case, scores, values, edges in cases:
        R, D_v = scores.shape[0], values.shape[1]
        m, l, acc = torch.full((R, 1), float("-inf")), torch.zeros(R, 1), torch.zeros(R, D_v)
        mine = (m.clone(), l.clone(), acc.clone())
        for start, end in zip(edges[:-1], edges[1:]):
            args = (mine[0], mine[1], mine[2], scores[:, start:end], values[start:end])
            got, report = call_learner(name, fn, args, case, len(cases))
            if report is not None:
                return report
            l_old, acc_old = l, acc
            m, l, acc = online_softmax_update(m, l, acc, scores[:, start:end], values[start:end])
            step = f"{case}, keys {start}..{end - 1}"

            def fail(problem, hint=None, step=step):
                return CheckReport(name, False, len(cases), step, problem, hint)

            if not (isinstance(got, tuple) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
                return fail(f"returned {type(got).__name__}, expected a tuple (m, l, acc) of tensors")
            if tuple(t.shape for t in got) != (m.shape, l.shape, acc.shape):
                return fail(
                    f"returned shapes {[tuple(t.shape) for t in got]}, expected "
                    f"{[tuple(m.shape), tuple(l.shape), tuple(acc.shape)]}",
                    "keep m and l as (R, 1) columns: take max and sum with keepdim=True",
                )
            if any(bool(torch.isnan(t).any()) for t in got):
                return fail(
                    "the result contains NaN",
                    "a row with no visible key has m = -inf, and exp(-inf - (-inf)) is NaN: subtract "
                    "0 instead of m_new where m_new is -inf (torch.where(torch.isneginf(m_new), 0, m_new))",
                )
            if not torch.equal(got[0], m):
                return fail("wrong running max m", "m_new = maximum(m, the block's row max)")
            if not torch.allclose(got[1], l, rtol=1e-5, atol=1e-6):
                hint = "rescale the old sum: l_new = l * exp(m - m_new) + rowsum(exp(scores - m_new))"
                if torch.allclose(
                    got[1], l_old + torch.exp(scores[:, start:end] - m).sum(-1, keepdim=True).nan_to_num(), rtol=1e-5
                ):
                    hint = "the old sum was taken under the old max: multiply l by exp(m_old - m_new) first"
                return fail("wrong running sum l", hint)
            if not torch.allclose(got[2], acc, rtol=1e-5, atol=1e-5):
                hint = "acc_new = acc * exp(m_old - m_new) + exp(scores - m_new) @ values"
                if torch.allclose(got[2], acc / l, rtol=1e-4, atol=1e-5):
                    hint = "keep acc unnormalised: divide by l only once, after the last block"
                elif not torch.allclose(acc_old, torch.zeros_like(acc_old)):
                    hint = "rescale the old acc by exp(m_old - m_new), as you did l"
                return fail("wrong running output acc", hint)
            mine = got
        truth = torch.softmax(scores, dim=-1) @ values
        if not torch.allclose(mine[2] / mine[1], truth, rtol=1e-5, atol=1e-6):
            return CheckReport(name, False, len(cases), case, "acc / l does not equal softmax(scores) @ values")
    return CheckReport(name, True, len(cases))


# --------------------------------------------------------------------------- 5.2 block skipping
_BOUNDS = [
    ("no mask, T a multiple of the block", (1, 256, 64, 64, False)),
    ("no mask, ragged T = 200 (the last key block is partial)", (2, 200, 64, 64, False)),
    ("causal, square blocks, first query block", (0, 256, 64, 64, True)),
    ("causal, square blocks, third query block", (2, 256, 64, 64, True)),
    ("causal, BLOCK_M = 64, BLOCK_N = 32", (1, 256, 64, 32, True)),
    ("causal, BLOCK_M = 32, BLOCK_N = 64 (a key block wider than the query block)", (3, 256, 32, 64, True)),
    ("causal, ragged last query block, T = 200", (3, 200, 64, 64, True)),
    ("causal, ragged last query block, narrow key blocks: T = 200, BLOCK_N = 16", (3, 200, 64, 16, True)),
    ("T = 1", (0, 1, 64, 64, True)),
]


def check_key_block_bounds(fn) -> CheckReport:
    """fn(block_index, T, block_m, block_n, causal) -> (n_full, n_end) as two ints."""
    name = "Exercise 5.2 (which key blocks a query block visits)"
    for case, args in _BOUNDS:
        got, report = call_learner(name, fn, args, case, len(_BOUNDS))
        if report is not None:
            return report
        expected = key_block_bounds(*args)
        if not (
            isinstance(got, tuple)
            and len(got) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in got)
        ):
            return CheckReport(
                name,
                False,
                len(_BOUNDS),
                case,
                f"returned {got!r}, expected a tuple of two ints",
                "use integer arithmetic: //, and -(-a // b) for the ceiling",
            )
        if got == expected:
            continue
        i, T, bm, bn, causal = args
        n_full, n_end = got
        if n_end != expected[1]:
            if causal and n_end == expected[1] - 1:
                hint = (
                    "one key block short: the block's last query sees keys up to its own position, so "
                    "n_end = cdiv(min((i + 1) * BLOCK_M, T), BLOCK_N), a ceiling"
                )
            elif causal and n_end > expected[1]:
                hint = (
                    "too many blocks: keys past the block's last query (capped at T - 1) are in every "
                    "query's future, so skip them"
                )
            elif not causal:
                hint = "without a mask every key block is visited: n_end = cdiv(T, BLOCK_N)"
            else:
                hint = "n_end = cdiv(min((i + 1) * BLOCK_M, T), BLOCK_N)"
            return CheckReport(name, False, len(_BOUNDS), case, f"n_end = {n_end}, expected {expected[1]}", hint)
        if not causal:
            hint = (
                "without a mask, only a partial last key block needs masking (its tail is past T): "
                "n_full = T // BLOCK_N"
            )
        elif n_full > expected[0]:
            hint = (
                "a block cut by the diagonal needs the element mask: only key blocks ending at or before the "
                "block's first query, (i * BLOCK_M) // BLOCK_N of them, are fully visible"
            )
        else:
            hint = "n_full = (i * BLOCK_M) // BLOCK_N: every key in those blocks precedes the block's first query"
        return CheckReport(name, False, len(_BOUNDS), case, f"n_full = {n_full}, expected {expected[0]}", hint)
    return CheckReport(name, True, len(_BOUNDS))


# --------------------------------------------------------------------------- 5.3 a Triton kernel
def _lse_cases():
    g = torch.Generator().manual_seed(0)
    return [
        ("3 rows of 8 columns", torch.randn(3, 8, generator=g)),
        ("5 columns: not a power of two (the block has a masked tail)", torch.randn(4, 5, generator=g)),
        ("one column", torch.randn(6, 1, generator=g)),
        ("negative values", torch.randn(2, 33, generator=g) - 20.0),
        ("values near 1000: exp overflows unless you subtract the row max", 1000.0 + torch.randn(3, 16, generator=g)),
    ]


def check_row_logsumexp(fn) -> CheckReport:
    """fn(x (R, C) float32, contiguous) -> (R,) float32 log-sum-exp of each row, computed by a Triton kernel."""
    from lib.kernels import kernel_mode

    name = "Exercise 5.3 (a row-wise log-sum-exp kernel in Triton)"
    cases = _lse_cases()
    if kernel_mode() == "unavailable":
        from lib.kernels.no_triton import NO_TRITON

        return CheckReport(
            name,
            False,
            len(cases),
            problem=NO_TRITON,
            hint="run this exercise on Linux or in WSL2, where `pip install triton` works",
        )
    device = "cuda" if kernel_mode() == "compiled" else "cpu"
    for case, x in cases:
        x = x.to(device)
        got, report = call_learner(name, fn, (x,), case, len(cases))
        if report is not None:
            return report
        expected = torch.logsumexp(x, dim=1)

        def fail(problem, hint=None, case=case):
            return CheckReport(name, False, len(cases), case, problem, hint)

        if not isinstance(got, torch.Tensor):
            return fail(f"returned {type(got).__name__}, expected a torch.Tensor", "return the output tensor")
        if got.shape != expected.shape:
            return fail(
                f"returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}",
                "one value per row: allocate out = torch.empty(x.shape[0]) and launch one program per row",
            )
        got = got.to(expected.device, expected.dtype)
        if not bool(torch.isfinite(got).all()):
            return fail(
                "the result is not finite (inf or NaN)",
                "exp(1000) overflows float32: take m = tl.max(x) first, then m + log(sum(exp(x - m))); "
                "and load the masked tail with other=float('-inf')",
            )
        # float32, rows of <= 33 values: the kernel's and PyTorch's summation orders differ by ~1e-6
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
            tail = x.shape[1] & (x.shape[1] - 1) != 0
            padded_zero = torch.logaddexp(
                expected,
                torch.log(torch.tensor(float(1 << (x.shape[1] - 1).bit_length()) - x.shape[1], device=expected.device)),
            )
            if tail and torch.allclose(got, padded_zero.to(got.dtype), rtol=1e-4, atol=1e-4):
                hint = (
                    "the masked tail was loaded as 0, so exp(0) terms joined the sum: "
                    "load with other=float('-inf'), whose exp is 0"
                )
            else:
                hint = "logsumexp(x) = m + log(sum(exp(x - m))) with m the row max; check the row offset row * stride"
            return fail(f"wrong values (largest difference {(got - expected).abs().max().item():.3g})", hint)
    return CheckReport(name, True, len(cases))


# --------------------------------------------------------------------------- 5.4 merging two key blocks
def _split_attention(
    seed: int, B: int, H: int, T: int, split: int, S: int, D: int, *, shift: float = 0.0, blocked: tuple = ()
):
    """Attention of (B, H, T, D) queries on S keys, computed in float64 on keys [0, split) and
    [split, S) separately and on all of them; `blocked` lists (query, first key, end key) ranges
    set to -inf, `shift` is added to every score (the outputs do not change, every lse moves by
    it). Returns the two blocks' (o, lse) and the whole's, rounded to float32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (
        torch.randn(B, H, S, D, generator=g, dtype=torch.float64),
        torch.randn(B, H, S, D, generator=g, dtype=torch.float64),
    )
    mask = torch.zeros(T, S, dtype=torch.float64)
    for row, start, end in blocked:
        mask[row, start:end] = float("-inf")
    parts = []
    for keys in (slice(0, split), slice(split, S), slice(0, S)):
        m = mask[:, keys]
        o = attention_ref(q, k[:, :, keys], v[:, :, keys], m)  # zeros for a row with no visible key
        lse = torch.logsumexp(attention_scores(q, k[:, :, keys]) + m, dim=-1) + shift  # (B, H, T); -inf: no key
        parts.append((o.float(), lse.float()))
    return parts


def check_merge_attention(fn) -> CheckReport:
    """fn(o1 (..., T, D), lse1 (..., T), o2, lse2) -> (o, lse): from each key block's normalised
    output and log-sum-exp, the attention over both blocks and its log-sum-exp."""
    name = "Exercise 5.4 (merging two blocks of keys)"
    # fp32 inputs rounded from a float64 truth: the merge adds a few roundings of size ~1e-7 relative, but
    # an lse near 100 carries an absolute rounding of ~4e-6, which exp() turns into that relative error
    # in each block's weight; the plain-attention cases are held to 1e-5, the large-score one to 1e-4
    cases = [
        ("two blocks of 4 keys, 3 queries", _split_attention(0, 1, 2, 3, 4, 8, 8), 1e-5),
        ("uneven blocks: 1 key, then 6", _split_attention(1, 2, 1, 5, 1, 7, 16), 1e-5),
        ("scores near 100: exp(lse) overflows float32", _split_attention(2, 1, 2, 4, 3, 7, 16, shift=100.0), 1e-4),
        (
            "a query that sees no key in the first block (lse1 = -inf)",
            _split_attention(3, 1, 1, 4, 3, 6, 8, blocked=((0, 0, 3), (2, 0, 3))),
            1e-5,
        ),
        (
            "a query that sees no key at all (both lse = -inf): its output is 0",
            _split_attention(4, 1, 1, 3, 2, 5, 8, blocked=((1, 0, 5),)),
            1e-5,
        ),
    ]
    for case, ((o1, lse1), (o2, lse2), (o, lse)), tol in cases:
        got, report = call_learner(name, fn, (o1, lse1, o2, lse2), case, len(cases))
        if report is not None:
            return report

        def fail(problem, hint=None, case=case):
            return CheckReport(name, False, len(cases), case, problem, hint)

        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            return fail(f"returned {type(got).__name__}, expected a tuple (o, lse) of tensors")
        g_o, g_lse = got
        if g_o.shape != o.shape or g_lse.shape != lse.shape:
            return fail(
                f"returned shapes {tuple(g_o.shape)} and {tuple(g_lse.shape)}, expected {tuple(o.shape)} and "
                f"{tuple(lse.shape)}",
                "o keeps o1's shape, lse keeps lse1's: one number per query row",
            )
        if bool(torch.isnan(g_o).any() | torch.isnan(g_lse).any()):
            if bool((torch.isneginf(lse1) & torch.isneginf(lse2)).any()):
                hint = (
                    "a row with no visible key has lse1 = lse2 = -inf, and exp(-inf - (-inf)) is NaN: "
                    "give such a row o = 0 and lse = -inf (e.g. torch.where on torch.isneginf(lse))"
                )
            else:
                hint = (
                    "exp(lse) overflows float32 once lse passes ~88: weight each block by exp(lse_i - lse), "
                    "with lse = torch.logaddexp(lse1, lse2), never by exp(lse_i) itself"
                )
            return fail("the result contains NaN", hint)
        close = lambda a, b: bool(torch.allclose(a, b, rtol=tol, atol=tol))  # noqa: E731
        if not close(g_lse, lse):
            if close(g_lse, torch.maximum(lse1, lse2)):
                hint = "the total is log(e^lse1 + e^lse2) = torch.logaddexp(lse1, lse2), not the larger of the two"
            elif close(g_lse, lse1 + lse2):
                hint = (
                    "adding two logs multiplies the sums they stand for: the total is "
                    "log(e^lse1 + e^lse2) = torch.logaddexp(lse1, lse2)"
                )
            else:
                hint = "lse = torch.logaddexp(lse1, lse2): the log of the two blocks' summed exp-scores"
            return fail("wrong lse", hint)
        if not close(g_o, o):
            if close(g_o, (o1 + o2) / 2):
                hint = (
                    "a plain average weights both blocks alike: weight block i by its share of the softmax "
                    "mass, exp(lse_i - lse)"
                )
            elif close(g_o, o1 * lse1.exp().unsqueeze(-1) + o2 * lse2.exp().unsqueeze(-1)):
                hint = "o1 and o2 are each normalised by their own sum: divide by the total, weights exp(lse_i - lse)"
            else:
                hint = "o = exp(lse1 - lse) * o1 + exp(lse2 - lse) * o2, each weight broadcast over D ([..., None])"
            return fail("wrong o", hint)
    return CheckReport(name, True, len(cases))
