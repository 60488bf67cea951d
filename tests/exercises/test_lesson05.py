"""Lesson 05's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import pytest
import torch
import triton  # noqa: E402  (after lib, which switches triton to its interpreter without a GPU)
import triton.language as tl  # noqa: E402
from exercise_helpers import assert_names_the_mistake, assert_passes_and_refuses_the_stub, stub

from lib.attention import online_softmax_update
from lib.course.exercises.lesson05 import (
    check_key_block_bounds,
    check_merge_attention,
    check_online_softmax_update,
    check_row_logsumexp,
)
from lib.kernels import key_block_bounds


@triton.jit
def _lse_kernel(X, OUT, n_cols, stride_row, BLOCK: tl.constexpr, TAIL: tl.constexpr, STABLE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_row + cols, mask=cols < n_cols, other=TAIL)
    if STABLE:
        m = tl.max(x, axis=0)
        tl.store(OUT + row, m + tl.log(tl.sum(tl.exp(x - m), axis=0)))
    else:
        tl.store(OUT + row, tl.log(tl.sum(tl.exp(x), axis=0)))


def _lse(tail=float("-inf"), stable=True):
    def run(x):
        out = torch.empty(x.shape[0], device=x.device)
        _lse_kernel[(x.shape[0],)](
            x, out, x.shape[1], x.stride(0), BLOCK=triton.next_power_of_2(x.shape[1]), TAIL=tail, STABLE=stable
        )
        return out

    return run


def test_lesson05_checks_pass_on_lib_and_fail_on_the_stub():
    assert check_online_softmax_update(online_softmax_update).passed
    assert check_key_block_bounds(key_block_bounds).passed
    assert check_row_logsumexp(_lse()).passed
    for check in (check_online_softmax_update, check_key_block_bounds, check_row_logsumexp):
        report = check(stub)
        assert not report.passed and "not attempted" in repr(report)


def test_a_stub_inside_a_triton_kernel_reads_as_not_attempted():
    @triton.jit
    def unfinished(X, OUT):
        raise NotImplementedError

    def run(x):
        unfinished[(1,)](x, torch.empty(1))
        return torch.empty(x.shape[0])

    report = check_row_logsumexp(run)
    assert not report.passed and "not attempted" in repr(report), report


def _no_rescale_l(m, l, acc, s, v):
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    p, c = torch.exp(s - safe), torch.exp(m - safe)
    return m_new, l + p.sum(-1, keepdim=True), acc * c + p @ v


def _no_rescale_acc(m, l, acc, s, v):
    m_new, l_new, _ = online_softmax_update(m, l, acc, s, v)
    safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    return m_new, l_new, acc + torch.exp(s - safe) @ v


def _normalised(m, l, acc, s, v):
    m_new, l_new, acc_new = online_softmax_update(m, l, acc, s, v)
    return m_new, l_new, acc_new / l_new


def _unguarded(m, l, acc, s, v):
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    p, c = torch.exp(s - m_new), torch.exp(m - m_new)
    return m_new, l * c + p.sum(-1, keepdim=True), acc * c + p @ v


@pytest.mark.parametrize(
    "wrong, words",
    [
        (_no_rescale_l, "multiply l by exp(m_old - m_new)"),
        (_no_rescale_acc, "rescale the old acc"),
        (_normalised, "keep acc unnormalised"),
        (_unguarded, "exp(-inf - (-inf)) is NaN"),
    ],
)
def test_online_softmax_check_names_the_mistake(wrong, words):
    report = check_online_softmax_update(wrong)
    assert not report.passed and words in report.hint, report


@pytest.mark.parametrize(
    "wrong, words",
    [
        (
            lambda i, T, bm, bn, c: (
                key_block_bounds(i, T, bm, bn, c) if not c else ((i * bm) // bn, min((i + 1) * bm, T) // bn)
            ),
            "one key block short",
        ),
        (
            lambda i, T, bm, bn, c: key_block_bounds(i, T, bm, bn, c) if c else (-(-T // bn), -(-T // bn)),
            "partial last key block",
        ),
        (
            lambda i, T, bm, bn, c: (
                key_block_bounds(i, T, bm, bn, c)
                if not c
                # n_end not capped at T
                else (key_block_bounds(i, T, bm, bn, c)[0], -(-((i + 1) * bm) // bn))
            ),
            "capped at T - 1",
        ),
        (
            lambda i, T, bm, bn, c: (
                key_block_bounds(i, T, bm, bn, c)
                if not c
                else (key_block_bounds(i, T, bm, bn, c)[1], key_block_bounds(i, T, bm, bn, c)[1])
            ),
            "element mask",
        ),
        (lambda i, T, bm, bn, c: (T // bn, -(-T // bn)), "skip them"),
    ],
)
def test_key_block_bounds_check_names_the_mistake(wrong, words):
    report = check_key_block_bounds(wrong)
    assert not report.passed and words in report.hint, report


@pytest.mark.parametrize(
    "wrong, words",
    [
        (_lse(tail=0.0), "other=float('-inf')"),
        (_lse(stable=False), "tl.max(x) first"),
    ],
)
def test_row_logsumexp_check_names_the_mistake(wrong, words):
    report = check_row_logsumexp(wrong)
    assert not report.passed and words in report.hint, report


def _merge(o1, lse1, o2, lse2, guard=True):
    lse = torch.logaddexp(lse1, lse2)  # (..., T)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse) if guard else lse
    return torch.exp(lse1 - safe)[..., None] * o1 + torch.exp(lse2 - safe)[..., None] * o2, lse


def _merge_by_max(o1, lse1, o2, lse2):  # the online softmax's way: rescale both to the larger lse
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    o = (w1[..., None] * o1 + w2[..., None] * o2) / total.clamp_min(1e-30)[..., None]
    return o, m + torch.log(total)


@pytest.mark.parametrize("solution", [_merge, _merge_by_max])
def test_merge_attention_check_passes_on_solutions_and_refuses_the_stub(solution):
    assert_passes_and_refuses_the_stub(check_merge_attention, solution)


def _merge_by_exp(o1, lse1, o2, lse2):  # weights exp(lse_i): right in exact arithmetic, inf in float32
    e1, e2 = lse1.exp(), lse2.exp()
    return (e1[..., None] * o1 + e2[..., None] * o2) / (e1 + e2)[..., None], torch.log(e1 + e2)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda o1, l1, o2, l2: _merge(o1, l1, o2, l2, guard=False), "exp(-inf - (-inf)) is NaN"),
        (_merge_by_exp, "overflows float32"),
        (lambda o1, l1, o2, l2: ((o1 + o2) / 2, torch.logaddexp(l1, l2)), "a plain average"),
        (
            lambda o1, l1, o2, l2: (o1 * l1.exp()[..., None] + o2 * l2.exp()[..., None], torch.logaddexp(l1, l2)),
            "divide by the total",
        ),
        (lambda o1, l1, o2, l2: (_merge(o1, l1, o2, l2)[0], torch.maximum(l1, l2)), "not the larger of the two"),
        (lambda o1, l1, o2, l2: (_merge(o1, l1, o2, l2)[0], l1 + l2), "adding two logs"),
        (lambda o1, l1, o2, l2: _merge(o1, l1, o2, l2)[0], "expected a tuple"),
    ],
)
def test_merge_attention_check_names_the_mistake(wrong, words):
    assert_names_the_mistake(check_merge_attention, wrong, words)
