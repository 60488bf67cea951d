"""Lesson 08's exercise checks: they fail on stubs and on plausible wrong answers with a hint that
names the mistake, pass on lib."""

import pytest
import torch

from lib.exercises.lesson08 import check_recall_batch
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
    targets[:, 2 * keys.shape[1] + 1:] = keys.gather(1, asked)
    return idx, targets


def _no_separator(keys, values, asked):
    idx, targets = AssociativeRecall.layout(keys, values, asked)
    idx[:, 2 * keys.shape[1]] = 0
    return idx, targets


@pytest.mark.parametrize("wrong, words", [(_value_first, "value first"), (_early, "one position early"),
                                          (_targets_are_keys, "targets are the keys"), (_no_separator, "separator")])
def test_recall_batch_check_names_the_mistake(wrong, words):
    report = check_recall_batch(wrong)
    assert not report.passed and words in report.problem
