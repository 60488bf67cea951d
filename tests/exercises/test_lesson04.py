"""Lesson 04's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import math

import pytest
import torch
from exercise_helpers import assert_names_the_mistake, assert_passes_and_refuses_the_stub, stub

from lib.attention import attention, attention_ref
from lib.course.exercises.lesson04 import check_cache_update, check_gqa_attention, check_kv_cache_bytes
from lib.kv_cache import kv_cache_bytes


def _lib_update(k_cache, v_cache, start, k, v):
    end = start + k.shape[2]
    k_cache[:, :, start:end], v_cache[:, :, start:end] = k, v
    return k_cache[:, :, :end], v_cache[:, :, :end]


def test_lesson04_checks_pass_on_lib_and_fail_on_the_stub():
    assert check_kv_cache_bytes(lambda *a: kv_cache_bytes(*a[:5], bytes_per_elem=a[5])).passed
    assert check_cache_update(_lib_update).passed
    for check in (check_kv_cache_bytes, check_cache_update):
        report = check(stub)
        assert not report.passed and "not attempted" in repr(report)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda L, B, S, H, D, b: L * B * S * H * D * b, "keys AND values"),
        (lambda L, B, S, H, D, b: 2 * L * B * S * H * D, "multiply by bytes_per_elem"),
        (lambda L, B, S, H, D, b: float(2 * L * B * S * H * D * b), "int"),
    ],
)
def test_kv_cache_bytes_check_names_the_mistake(wrong, words):
    report = check_kv_cache_bytes(wrong)
    assert not report.passed and words in (report.hint or "") + (report.problem or ""), report


def _returns_new_only(k_cache, v_cache, start, k, v):
    _lib_update(k_cache, v_cache, start, k, v)
    return k, v


def _not_in_place(k_cache, v_cache, start, k, v):
    return _lib_update(k_cache.clone(), v_cache.clone(), start, k, v)


def _returns_copies(k_cache, v_cache, start, k, v):
    k_all, v_all = _lib_update(k_cache, v_cache, start, k, v)
    return k_all.clone(), v_all.clone()


def _returns_concatenated(k_cache, v_cache, start, k, v):
    _lib_update(k_cache, v_cache, start, k, v)
    return torch.cat([k_cache[:, :, :start], k], dim=2), torch.cat([v_cache[:, :, :start], v], dim=2)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (_returns_new_only, "every position so far"),
        (_not_in_place, "in place"),
        (_returns_copies, "return views"),
        (_returns_concatenated, "return views"),
    ],
)
def test_cache_update_check_names_the_mistake(wrong, words):
    report = check_cache_update(wrong)
    assert not report.passed and words in report.hint, report


def _gqa(q, k, v, causal, widen="repeat_interleave", scale=True, align="bottom-right"):
    """Grouped-query attention by hand; each keyword a way to get it wrong."""
    groups = q.shape[1] // k.shape[1]
    if widen == "repeat_interleave":
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    else:
        k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
    scores = q @ k.transpose(-2, -1) / (math.sqrt(q.shape[-1]) if scale else 1.0)  # (B, H, T, S)
    T, S = scores.shape[-2:]
    if causal and align is not None:
        offset = S - T if align == "bottom-right" else 0
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(diagonal=1 + offset), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize(
    "solution",
    [
        _gqa,
        lambda q, k, v, causal: attention(q, k, v, causal=causal, backend="naive"),
    ],
)
def test_gqa_check_passes_on_solutions_and_refuses_the_stub(solution):
    assert_passes_and_refuses_the_stub(check_gqa_attention, solution)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda q, k, v, c: _gqa(q, k, v, c, widen="repeat"), "repeat_interleave, not repeat"),
        (lambda q, k, v, c: _gqa(q, k, v, c, scale=False), "1/√D"),
        (lambda q, k, v, c: _gqa(q, k, v, c, align="top-left"), "the LAST T positions"),
        (lambda q, k, v, c: _gqa(q, k, v, c, align=None), "causal=True"),
        (lambda q, k, v, c: attention_ref(q[:, : k.shape[1]], k, v, causal=c), "one output per query head"),
    ],
)
def test_gqa_check_names_the_mistake(wrong, words):
    assert_names_the_mistake(check_gqa_attention, wrong, words)
