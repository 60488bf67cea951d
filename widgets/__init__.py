"""Visualizers for One Mask. Each draws numbers computed by `lib` as a plain plotly figure
(for the static book) and wraps the same drawing in ipywidgets for live use in JupyterLab."""

from widgets._render import use_stable_renderer
from widgets.bertviz_offline import head_view, model_view
from widgets.live_loss import LossCurve
from widgets.mask_explorer import MaskExplorer, MaskState, attention_heatmap, mask_explorer_figure
from widgets.mlm_view import MLMState, MLMView, mlm_view_figure
from widgets.sampling_knobs import SamplingKnobs, SamplingState, sampling_figure

__all__ = ["LossCurve", "MLMState", "MLMView", "MaskExplorer", "MaskState", "SamplingKnobs", "SamplingState",
           "attention_heatmap", "head_view", "mask_explorer_figure", "mlm_view_figure", "model_view", "sampling_figure",
           "use_stable_renderer"]
