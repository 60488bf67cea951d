"""A live training-loss curve: a FigureWidget that a training loop appends to.

    curve = LossCurve(title="MLM loss")
    display(curve)                      # in its own cell, tagged nbval-ignore-output
    train(..., on_step=curve.update)    # curve.update(step, loss)

The figure redraws every `every` steps (drawing each step would cost more than the step).
`curve.figure()` gives a plain static figure of the whole run for the book.
"""

from __future__ import annotations

import plotly.graph_objects as go

__all__ = ["LossCurve"]


class LossCurve:
    def __init__(self, title: str = "training loss", every: int = 10, y_title: str = "loss (nats per token)"):
        self.title, self.every, self.y_title = title, max(1, int(every)), y_title
        self.steps: list[int] = []
        self.losses: list[float] = []
        self._widget = None

    def _layout(self) -> dict:
        return {
            "title": {"text": self.title},
            "xaxis": {"title": {"text": "step"}},
            "yaxis": {"title": {"text": self.y_title}},
            "height": 320,
            "margin": {"t": 50, "b": 50},
        }

    @property
    def widget(self) -> go.FigureWidget:
        if self._widget is None:
            self._widget = go.FigureWidget(
                go.Figure(go.Scatter(x=[], y=[], mode="lines", name="loss"), layout=self._layout())
            )
        return self._widget

    def update(self, step: int, loss: float) -> None:
        self.steps.append(int(step))
        self.losses.append(float(loss))
        if self._widget is not None and (step + 1) % self.every == 0:
            with self._widget.batch_update():
                self._widget.data[0].x, self._widget.data[0].y = self.steps, self.losses

    def figure(self, digits: int = 3) -> go.Figure:
        """The finished curve as a static figure (values rounded: stable across CPUs)."""
        return go.Figure(
            go.Scatter(x=self.steps, y=[round(v, digits) for v in self.losses], mode="lines", name="loss"),
            layout=self._layout(),
        )

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = f"LossCurve({self.title!r}): live while training runs"
        return bundle
