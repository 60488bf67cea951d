"""Lesson 08's results explorer draws the committed record the verdicts come from (the mean of its
seeds, a bar from the lowest seed to the highest), with the page's short live run only as a dotted,
labelled overlay."""

from pathlib import Path

import jupytext
import pytest

from lib.course.bench.compare import explorer_results, load_results
from widgets.compare_view import CompareView

LESSON = Path(__file__).resolve().parents[2] / "lessons" / "08-architectures-compared.md"
FULL = load_results("full")
pytestmark = pytest.mark.skipif(FULL is None, reason="no committed record (benchmarks/compare_full.json)")


def _mean(values):
    return sum(values) / len(values)


def test_explorer_results_are_the_records_seeds_and_counts():
    results = explorer_results(FULL)
    assert set(results) == {"recall", "copy", "flops", "memory"}
    for task in ("recall", "copy"):
        for name, row in FULL[f"{task}_accuracy"].items():
            xs, ys = results[task][name]
            assert xs == [int(k) for k in row] and ys == list(row.values())  # every seed, not a mean
    assert results["flops"]["GPT"] == (FULL["setting"]["flop_lengths"], FULL["flops"]["GPT"])
    assert results["memory"]["Hybrid"] == (FULL["setting"]["memory_contexts"], FULL["state_bytes"]["Hybrid"])


def _lesson_explorer(source_of_lesson: str) -> CompareView:
    """Run the lesson's explorer cell on the record and on a live run of sentinel accuracies."""
    nb = jupytext.reads(source_of_lesson, fmt="md:myst")
    cells = [c.source for c in nb.cells if c.cell_type == "code" and "CompareView(" in c.source]
    assert len(cells) == 1, "one cell builds the explorer"
    sentinel = 0.0123  # no record's accuracy
    live = {
        task: {name: {k: sentinel for k in row} for name, row in FULL[f"{task}_accuracy"].items()}
        for task in ("recall", "copy")
    }
    lengths, contexts = FULL["setting"]["flop_lengths"], FULL["setting"]["memory_contexts"]
    names = dict(
        full=FULL,
        recall_acc=live["recall"],
        copy_acc=live["copy"],
        lengths=lengths,
        contexts=contexts,
        flops={n: [1] * len(lengths) for n in FULL["flops"]},
        state={n: [1] * len(contexts) for n in FULL["state_bytes"]},
        CompareView=CompareView,
        explorer_results=explorer_results,
        print=lambda *a, **k: None,
    )
    exec(cells[0], names)
    return names["explorer"]


@pytest.mark.parametrize("metric", ["recall", "copy"])
def test_lesson_08_explorer_draws_the_record_and_the_live_run_only_as_a_labelled_overlay(metric):
    explorer = _lesson_explorer(LESSON.read_text())
    fig = explorer.figure_for("metric", metric)
    live = [t for t in fig.data if "this page's run" in t.name]
    record = [t for t in fig.data if t not in live]
    assert {t.name.split(" (")[0] for t in record} == set(FULL[f"{metric}_accuracy"])
    for trace in record:
        row = FULL[f"{metric}_accuracy"][trace.name.split(" (")[0]]
        assert list(trace.y) == pytest.approx([_mean(v) for v in row.values()], rel=1e-3)
        assert list(trace.error_y.arrayminus) == pytest.approx([_mean(v) - min(v) for v in row.values()], abs=1e-3)
    assert all(t.line.dash == "dot" for t in live)  # the live run: dotted, named as such
