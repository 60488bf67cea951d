"""Lesson 08's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import pytest
import torch
from exercise_helpers import assert_names_the_mistake, assert_passes_and_refuses_the_stub

from lib.course.exercises.lesson08 import check_decode_state_bytes, check_recall_batch, decode_state_bytes_ref
from lib.decode import decode_state_bytes
from lib.gpt import GPTConfig
from lib.hybrid import HybridGPT
from lib.mamba import MambaConfig
from lib.tasks import AssociativeRecall


def test_lesson08_check_passes_on_lib_and_fails_on_the_stub():
    assert check_recall_batch(AssociativeRecall.layout).passed

    def stub(keys, values, asked):
        raise NotImplementedError

    report = check_recall_batch(stub)
    assert not report.passed and "not attempted" in report.problem


def _value_first(keys, values, asked):
    return AssociativeRecall.layout(values, keys, asked)


def _early(keys, values, asked):
    idx, targets = AssociativeRecall.layout(keys, values, asked)
    return idx, torch.cat([targets[:, 1:], torch.full_like(targets[:, :1], -100)], dim=1)


def _targets_are_keys(keys, values, asked):
    idx, targets = AssociativeRecall.layout(keys, values, asked)
    targets[:, 2 * keys.shape[1] + 1 :] = keys.gather(1, asked)
    return idx, targets


def _no_separator(keys, values, asked):
    idx, targets = AssociativeRecall.layout(keys, values, asked)
    idx[:, 2 * keys.shape[1]] = 0
    return idx, targets


@pytest.mark.parametrize(
    "wrong, words",
    [
        (_value_first, "value first"),
        (_early, "one position early"),
        (_targets_are_keys, "targets are the keys"),
        (_no_separator, "separator"),
    ],
)
def test_recall_batch_check_names_the_mistake(wrong, words):
    report = check_recall_batch(wrong)
    assert not report.passed and words in report.problem


def _state_bytes(
    pattern,
    batch,
    context,
    d_model,
    d_state,
    d_conv,
    expand,
    bytes_per_elem,
    *,
    kv=2,
    window="K - 1",
    inner=True,
    grows=False,
):
    """The decoding state by formula; each keyword a way to get it wrong."""
    E = expand * d_model if inner else d_model
    kept = {"K - 1": d_conv - 1, "K": d_conv, "none": 0}[window]  # the convolution's inputs kept
    attention = kv * batch * context * d_model * bytes_per_elem
    mamba = batch * E * (kept + d_state) * bytes_per_elem * (context if grows else 1)
    return sum(attention if kind == "A" else mamba for kind in pattern)


@pytest.mark.parametrize("solution", [_state_bytes, decode_state_bytes_ref])
def test_decode_state_bytes_check_passes_on_solutions_and_refuses_the_stub(solution):
    assert_passes_and_refuses_the_stub(check_decode_state_bytes, solution)


def test_the_reference_counts_what_a_real_hybrid_allocates():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = HybridGPT(
            GPTConfig(vocab_size=8, block_size=64, n_layer=4, n_head=2, n_embd=16),
            pattern="MAMA",
            mamba=MambaConfig(vocab_size=8, d_model=16, n_layers=1, d_state=3, d_conv=4, expand=2),
        )
    for batch, S in ((1, 1), (3, 40)):
        assert decode_state_bytes_ref("MAMA", batch, S, 16, 3, 4, 2, 4) == decode_state_bytes(
            model, batch, S, dtype=torch.float32
        )


@pytest.mark.parametrize(
    "mistake, words",
    [
        (dict(kv=1), "keys AND values"),
        (dict(window="none"), "short convolution's window"),
        (dict(window="K"), "K - 1 inputs, not K"),
        (dict(inner=False), "E = expand · d_model"),
        (dict(grows=True), "does not grow with the context"),
    ],
)
def test_decode_state_bytes_check_names_the_mistake(mistake, words):
    assert_names_the_mistake(check_decode_state_bytes, lambda *a: _state_bytes(*a, **mistake), words)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda p, B, S, C, N, K, e, b: len(p) * 2 * B * S * C * b, "by its letter"),
        (lambda p, B, S, C, N, K, e, b: _state_bytes(p, B, S, C, N, K, e, 1), "multiply by bytes_per_elem"),
        (lambda *a: float(_state_bytes(*a)), "expected an int"),
    ],
)
def test_decode_state_bytes_check_names_other_mistakes(wrong, words):
    assert_names_the_mistake(check_decode_state_bytes, wrong, words)
