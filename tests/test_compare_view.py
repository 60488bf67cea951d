"""The results explorer draws exactly the numbers it is given, for every metric its menu offers."""

import pytest

from widgets.compare_view import METRICS, CompareView, compare_figure

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
        assert [list(t.y) for t in view.figure.data] == [list(compare_figure(RESULTS, metric).data[i].y) for i in range(2)]
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
