"""Lesson 04's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import pytest
import torch

from exercise_helpers import stub
from lib.exercises.lesson04 import check_cache_update, check_kv_cache_bytes
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


@pytest.mark.parametrize("wrong, words", [
    (lambda L, B, S, H, D, b: L * B * S * H * D * b, "keys AND values"),
    (lambda L, B, S, H, D, b: 2 * L * B * S * H * D, "multiply by bytes_per_elem"),
    (lambda L, B, S, H, D, b: float(2 * L * B * S * H * D * b), "int"),
])
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


@pytest.mark.parametrize("wrong, words", [(_returns_new_only, "every position so far"), (_not_in_place, "in place"),
                                          (_returns_copies, "return views"), (_returns_concatenated, "return views")])
def test_cache_update_check_names_the_mistake(wrong, words):
    report = check_cache_update(wrong)
    assert not report.passed and words in report.hint, report
