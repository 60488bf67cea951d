"""The results explorer draws exactly the numbers it is given, for every metric its menu offers."""

import pytest

from widgets.compare_view import METRICS, CompareView, compare_figure, seed_range_figure

RESULTS = {
    "recall": {"GPT": ([1, 2, 4], [1.0, 0.5, 0.25]), "Mamba": ([1, 2, 4], [0.9, 0.4, 0.1])},
    "copy": {"GPT": ([16, 32], [1.0, 0.2]), "Mamba": ([16, 32], [1.0, 1.0])},
    "flops": {"GPT": ([256, 512], [1e9, 3.9e9]), "Mamba": ([256, 512], [1e9, 2e9])},
    "memory": {"GPT": ([1024, 8192], [65536, 524288]), "Mamba": ([1024, 8192], [1234, 1234])},
}


@pytest.mark.parametrize("metric", list(METRICS))
def test_static_face_draws_the_given_numbers_with_colour_and_symbol(metric):
    fig = compare_figure(RESULTS, metric)
    assert [t.name for t in fig.data] == list(RESULTS[metric])
    for trace, (xs, ys) in zip(fig.data, RESULTS[metric].values()):
        assert list(trace.x) == xs and list(trace.y) == pytest.approx(ys, rel=1e-4)
    assert fig.data[0].marker.symbol != fig.data[1].marker.symbol  # told apart without colour
    assert fig.layout.title.text == METRICS[metric][0] and fig.layout.xaxis.title.text


def test_live_face_switches_metric_on_every_menu_option():
    view = CompareView(RESULTS)
    assert [v for _, v in view.menu.options] == list(RESULTS)
    for metric in RESULTS:
        view.menu.value = metric
        assert [list(t.y) for t in view.figure.data] == [
            list(compare_figure(RESULTS, metric).data[i].y) for i in range(2)
        ]
        assert view.figure.layout.title.text == METRICS[metric][0]
    assert "live widget" in view._repr_mimebundle_()["text/plain"]


def test_bad_results_are_refused():
    with pytest.raises(ValueError, match="results must be a non-empty dict"):
        compare_figure({}, "recall")
    with pytest.raises(ValueError, match="unknown metrics"):
        compare_figure({"speed": {}}, "recall")
    with pytest.raises(ValueError, match="metric must be one of the measured"):
        compare_figure({"recall": RESULTS["recall"]}, "copy")
    with pytest.raises(ValueError, match="one non-zero length"):
        compare_figure({"recall": {"GPT": ([1, 2], [0.5])}}, "recall")


def test_seed_range_figure_draws_the_mean_and_the_lowest_and_highest_seed():
    lines = {"GPT (record)": {"4": [1.0, 0.9, 0.8], "8": [0.5, 0.7, 0.6]}, "GPT (this run)": {4: 0.3, 8: 0.2}}
    fig = seed_range_figure(lines, title="t", x_title="P", styles={"GPT (this run)": dict(color="#000000", dash="dot")})
    record, live = fig.data
    assert list(record.x) == [4, 8] and list(record.y) == pytest.approx([0.9, 0.6])
    assert list(record.error_y.array) == pytest.approx([0.1, 0.1]) and list(record.error_y.arrayminus) == pytest.approx(
        [0.1, 0.1]
    )
    assert list(live.y) == [0.3, 0.2] and live.error_y.array is None  # one run: no bar
    assert (
        live.line.dash == "dot" and live.line.color == "#000000" and record.line.color
    )  # a style, or a default colour
    assert (
        fig.layout.xaxis.type == "linear"
        and seed_range_figure(lines, title="t", x_title="P", log_x=True).layout.xaxis.type == "log"
    )


def test_seed_range_figure_refuses_what_it_cannot_draw():
    with pytest.raises(ValueError, match="lines must be a non-empty dict"):
        seed_range_figure({}, title="t", x_title="P")
    with pytest.raises(ValueError, match="must be a number or a non-empty list"):
        seed_range_figure({"a": {4: []}}, title="t", x_title="P")
    with pytest.raises(ValueError, match="keys must be integers"):
        seed_range_figure({"a": {"four": 0.5}}, title="t", x_title="P")
    with pytest.raises(ValueError, match="must be a non-empty dict"):
        seed_range_figure({"a": [0.5]}, title="t", x_title="P")


SEEDS = {
    "recall": {
        "GPT": ([4, 16], [[1.0, 1.0, 1.0], [0.7, 0.5, 0.6]]),
        "Hybrid": ([4, 16], [[1.0, 0.9, 1.0], [0.9, 1.0, 0.8]]),
    }
}
LIVE = {"recall": {"GPT": ([4, 16], [0.3, 0.2]), "Hybrid": ([4, 16], [0.1, 0.07])}}


def test_several_seeds_draw_the_mean_with_a_bar_from_the_lowest_to_the_highest():
    gpt, hybrid = compare_figure(SEEDS, "recall").data
    assert list(gpt.y) == pytest.approx([1.0, 0.6]) and list(hybrid.y) == pytest.approx(
        [29 / 30, 0.9], rel=1e-3
    )  # to 4 digits
    assert list(gpt.error_y.array) == pytest.approx([0.0, 0.1]) and list(gpt.error_y.arrayminus) == pytest.approx(
        [0.0, 0.1]
    )
    assert compare_figure(RESULTS, "recall").data[0].error_y.array is None  # one run: no bar
    with pytest.raises(ValueError, match="non-empty lists of numbers"):
        compare_figure({"recall": {"GPT": ([4], [[]])}}, "recall")


def test_an_overlay_is_drawn_dotted_and_labelled_beside_the_record():
    view = CompareView(SEEDS, overlay=LIVE, label="record", overlay_label="this page's run")
    names = [t.name for t in view.figure.data]
    assert names == ["GPT (record)", "Hybrid (record)", "GPT (this page's run)", "Hybrid (this page's run)"]
    record, live = view.figure.data[0], view.figure.data[2]
    assert list(record.y) == pytest.approx([1.0, 0.6]) and list(live.y) == pytest.approx([0.3, 0.2])
    assert live.line.dash == "dot" and live.line.color == record.line.color and record.line.dash is None
    # a metric the overlay did not measure: the record alone
    only = compare_figure(dict(SEEDS, copy=RESULTS["copy"]), "copy", overlay=LIVE, label="record")
    assert [t.name for t in only.data] == ["GPT (record)", "Mamba (record)"]


def test_switching_between_metrics_with_and_without_an_overlay_redraws_every_trace():
    view = CompareView(dict(SEEDS, copy=RESULTS["copy"]), overlay=LIVE, label="record")
    view.menu.value = "copy"  # no overlay here: two traces where there were four
    assert [t.name for t in view.figure.data] == ["GPT (record)", "Mamba (record)"]
    view.menu.value = "recall"
    assert [t.name for t in view.figure.data] == [
        "GPT (record)",
        "Hybrid (record)",
        "GPT (this page's run)",
        "Hybrid (this page's run)",
    ]
    assert view.figure.data[2].line.dash == "dot"
