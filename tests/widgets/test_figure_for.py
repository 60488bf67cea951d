"""Every live widget can say, without moving, what it will draw after a control move
(`figure_for`), and that is exactly what it draws once the control moves. The lab browser test
relies on this to check a lesson's widget on the page against the kernel's answer."""

import json

import ipywidgets as W
import pytest
from plotly.utils import PlotlyJSONEncoder
from test_compare_view import LIVE, RESULTS, SEEDS
from test_router_view import _run
from test_ssm_state import _runs

from widgets import KVCalculator, MaskExplorer, TileSchedule
from widgets._base import live_view_of
from widgets.compare_view import CompareView
from widgets.router_view import RouterView
from widgets.ssm_state import SSMStateView


def data(fig) -> str:
    """The traces as JSON, less the random uid a FigureWidget gives each trace."""
    traces = [{k: v for k, v in t.to_plotly_json().items() if k != "uid"} for t in fig.data]
    return json.dumps(traces, cls=PlotlyJSONEncoder, sort_keys=True)


def moves(view):
    """One move per control: a menu's next option, a slider one step from its value."""
    for name, control in view.controls.items():
        if isinstance(control, W.Dropdown):
            values = [o[1] if isinstance(o, tuple) else o for o in control.options]
            yield name, values[(values.index(control.value) + 1) % len(values)]
        elif isinstance(control, (W.IntSlider, W.FloatSlider)):
            step = control.step if control.value + control.step <= control.max else -control.step
            yield name, control.value + step


VIEWS = {
    "mask explorer": lambda: MaskExplorer(sentence="The cat sat on the mat .", kind="causal", n_pad=1),
    "kv calculator": lambda: KVCalculator(),
    "tile schedule": lambda: TileSchedule(),
    "ssm state": lambda: SSMStateView(list("abcdef"), _runs()),
    # at step 5 of run "a": run "b" has 4 steps, so moving to it also moves the step to 3
    "router": lambda: RouterView({"a": _run(S=6), "b": _run(S=4, seed=1)}, step=5),
    "compare": lambda: CompareView(RESULTS),
    # lesson 08's: a record of several seeds, this page's run dotted over the metrics it measured
    "compare, record and overlay": lambda: CompareView(dict(SEEDS, copy=RESULTS["copy"]), overlay=LIVE, label="record"),
}


@pytest.mark.parametrize("make", VIEWS.values(), ids=list(VIEWS))
def test_figure_for_predicts_the_move_and_leaves_the_widget_alone(make):
    checked = 0
    for name, value in list(moves(make())):
        view = make()
        before = data(view.figure)
        predicted = data(view.figure_for(name, value))
        assert data(view.figure) == before, "predicting does not redraw"
        view.controls[name].value = value
        assert data(view.figure) == predicted, f"{name} -> {value!r}"
        checked += predicted != before
    assert checked >= 1, "at least one move changes the figure"


def test_live_view_of_finds_the_view_behind_a_shown_widget():
    view = TileSchedule()
    assert live_view_of(view.widget.model_id) is view
    assert live_view_of("no-such-model") is None
    with pytest.raises(ValueError, match="name must be one of"):
        view.figure_for("no_such_control", 1)
