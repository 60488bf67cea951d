"""widgets._base.LiveView, the live face the state-driven widgets share: one redraw per change, the
controls follow set_state without redrawing again, a refused state changes nothing."""

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import pytest

from widgets import KVCalculator, MaskExplorer, MemoryMapView, MLMView, SamplingKnobs, TileSchedule
from widgets._base import LiveView, as_array, rounded

W = pytest.importorskip("ipywidgets")


@dataclass(frozen=True)
class Dot:
    x: int = 1
    label: str = "a"


class DotView(LiveView):
    def __init__(self, state=Dot()):
        self.drawn = []
        self.controls = {"x": W.IntSlider(value=1, min=0, max=5), "label": W.Text(value="a")}
        self._start(state, lambda figure: W.VBox([*self.controls.values(), figure]))

    def _checked(self, state):
        if state.x < 0:
            raise ValueError("x must be >= 0")
        return state

    def _figure(self, state):
        self.drawn.append(state)
        return go.Figure(go.Scatter(x=[state.x], y=[0], text=[state.label]))


def test_a_control_change_draws_once_and_set_state_moves_the_controls_quietly():
    view = DotView()
    assert view.drawn == [Dot()]
    view.controls["x"].value = 3
    assert view.drawn[-1] == Dot(3, "a") and len(view.drawn) == 2 and view.figure.data[0].x == (3,)
    view.set_state(Dot(9, "b"))  # 9 is past the slider's max: the slider widens to show it
    assert len(view.drawn) == 3 and view.controls["x"].value == 9 and view.controls["x"].max == 9
    assert view.controls["label"].value == "b" and view.figure.data[0].text == ("b",)


def test_a_refused_state_leaves_the_view_as_it_was():
    view = DotView(Dot(2, "z"))
    with pytest.raises(ValueError, match="x must be >= 0"):
        view.set_state(Dot(-1, "q"))
    assert view.state == Dot(2, "z") and view.controls["x"].value == 2 and view.figure.data[0].x == (2,)


def test_every_state_driven_widget_is_a_live_view():
    for cls in (KVCalculator, MaskExplorer, MemoryMapView, MLMView, SamplingKnobs, TileSchedule):
        assert issubclass(cls, LiveView), cls.__name__


def test_the_shared_helpers_refuse_what_they_cannot_draw():
    assert as_array("h", [[1, 2], [3, 4]]).dtype == np.float64
    with pytest.raises(ValueError, match="h holds non-finite values"):
        as_array("h", [1.0, float("nan")])
    with pytest.raises(ValueError, match="h must be numbers"):
        as_array("h", ["a", "b"])
    assert rounded([0.123456, 12345.678]) == [0.1235, 12350.0] and rounded([]) == []
