"""Visualizers for One Mask. Each draws numbers computed by `lib` as a plain plotly figure
(for the static book) and wraps the same drawing in ipywidgets for live use in JupyterLab."""

from widgets._render import use_stable_renderer
from widgets.mask_explorer import MaskExplorer, MaskState, mask_explorer_figure

__all__ = ["MaskExplorer", "MaskState", "mask_explorer_figure", "use_stable_renderer"]
