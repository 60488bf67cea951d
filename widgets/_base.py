"""What the widgets share: the live face of a state-driven widget, and two small data helpers.

A live widget here is a plain figure function `f(state) -> go.Figure` (which renders in the static
book) wrapped in controls. `LiveView` is that wrapping, once: a dataclass `state`, `controls`
named like the state's fields, a `figure` (a plotly FigureWidget redrawn in place, so the page
keeps its place) and `widget`, what the notebook shows. A control change builds the next state,
`set_state` checks it, draws it, moves the controls to it and redraws; while it moves them, their
own change events are ignored (otherwise each move would redraw again).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import plotly.graph_objects as go

from widgets._render import live_mimebundle, redraw

__all__ = ["LiveView", "as_array", "live_view_of", "move_control", "rounded"]


class LiveView:
    """The live face. A subclass sets `self.controls` ({field name: ipywidget}), calls
    `self._start(state, layout)` (`layout(figure)` arranges the controls and the figure) and
    defines `_figure(state)`. It may override `_checked(state)` (check or clamp a state; the one
    that comes back is drawn), `_state_from_controls(name, value)` (when a control does not set
    its field alone) and `_sync_controls(state)` (when a control's range depends on the state)."""

    controls: dict
    state: object

    def _start(self, state, layout) -> None:
        self._redrawing = False
        self.state = self._checked(state)
        self._sync_controls(self.state)
        self.figure = go.FigureWidget(self._figure(self.state))
        for name, control in self.controls.items():
            control.observe(functools.partial(self._on_change, name), names="value")
        self.widget = layout(self.figure)

    def _figure(self, state) -> go.Figure:
        raise NotImplementedError

    def _checked(self, state):
        return state

    def _state_from_controls(self, name: str, value):
        """The state once control `name` holds `value`, the other controls as they stand."""
        values = {field: control.value for field, control in self.controls.items()}
        return replace(self.state, **dict(values, **{name: value}))

    def _sync_controls(self, state) -> None:
        with self._quietly():
            for name, control in self.controls.items():
                move_control(control, getattr(state, name))

    @contextmanager
    def _quietly(self):
        """Move controls without their change events redrawing (set_state is already doing it)."""
        self._redrawing = True
        try:
            yield
        finally:
            self._redrawing = False

    def _on_change(self, name: str, change: dict) -> None:
        if self._redrawing:  # set_state itself moved a control
            return
        self.set_state(self._state_from_controls(name, change["new"]))

    def set_state(self, state) -> None:
        """Redraw for `state` (also what every control change calls). A state the check refuses
        leaves the widget as it was."""
        state = self._checked(state)
        new = self._figure(state)
        self.state = state
        self._sync_controls(state)
        redraw(self.figure, new)

    def figure_for(self, name: str, value) -> go.Figure:
        """The figure this widget draws once control `name` is moved to `value` from the current
        state, computed afresh and leaving the widget as it is (what a browser test compares
        the page with after moving that control)."""
        if name not in self.controls:
            raise ValueError(f"name must be one of this widget's controls {sorted(self.controls)}, got {name!r}")
        return self._figure(self._checked(self._state_from_controls(name, value)))

    def _repr_mimebundle_(self, **kwargs):
        return live_mimebundle(self.widget, type(self).__name__, **kwargs)


def live_view_of(model_id: str):
    """The live view (any object with `figure_for` and a `widget`) whose widget has this
    ipywidgets model id, as a page shows it; None if there is none. Lets a browser test ask the
    kernel what a widget on the page must draw."""
    import gc

    for obj in gc.get_objects():
        if not callable(getattr(type(obj), "figure_for", None)):  # a class attribute, not a dynamic one
            continue
        widget = getattr(obj, "widget", None)
        if widget is not None and getattr(widget, "model_id", None) == model_id:
            return obj
    return None


def move_control(control, value) -> None:
    """Set a control to `value`, widening a slider's range first if the value lies outside it."""
    if hasattr(control, "max") and hasattr(control, "min"):
        control.max = max(control.max, value)
        control.min = min(control.min, value)
    control.value = value


def as_array(name: str, x) -> np.ndarray:
    """Numbers (an array, list or torch tensor) as a float64 array; refuses non-numbers and
    non-finite values, saying which argument."""
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().cpu().numpy()
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be numbers (an array, list or tensor): {err}") from None
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} holds non-finite values (inf or NaN): nothing sensible to draw")
    return arr


def rounded(a) -> list:
    """Four significant digits: the eye cannot see more, and a notebook with frames stays small."""
    a = np.asarray(a, dtype=np.float64)
    return np.vectorize(lambda v: float(f"{v:.4g}"))(a).tolist() if a.size else a.tolist()
