"""Visualizers for One Mask. Each draws numbers computed by `lib` as a plain plotly figure
(for the static book) and wraps the same drawing in ipywidgets for live use in JupyterLab."""

from widgets._render import use_stable_renderer
from widgets.bertviz_offline import head_view, model_view
from widgets.compare_view import CompareView, compare_figure, seed_range_figure
from widgets.kv_calculator import KVCalcState, KVCalculator, attention_kinds_figure, kv_calculator_figure
from widgets.live_loss import LossCurve
from widgets.mask_explorer import MaskExplorer, MaskState, attention_heatmap, mask_explorer_figure
from widgets.memory_map import (
    MemoryMapState,
    MemoryMapView,
    memory_map_figure,
    memory_map_pair,
    memory_map_view_figure,
    sweep_figure,
    utilisation_figure,
)
from widgets.mlm_view import MLMState, MLMView, mlm_view_figure
from widgets.router_view import RouterView, balance_figure, router_figure
from widgets.sampling_knobs import SamplingKnobs, SamplingState, sampling_figure
from widgets.ssm_state import SSMStateView, masked_attention_figure, ssm_state_figure
from widgets.tile_schedule import TileSchedule, TileState, tile_schedule_figure

__all__ = [
    "CompareView",
    "KVCalcState",
    "KVCalculator",
    "LossCurve",
    "MLMState",
    "MLMView",
    "MaskExplorer",
    "MaskState",
    "MemoryMapState",
    "MemoryMapView",
    "RouterView",
    "SSMStateView",
    "SamplingKnobs",
    "SamplingState",
    "TileSchedule",
    "TileState",
    "attention_heatmap",
    "attention_kinds_figure",
    "balance_figure",
    "compare_figure",
    "head_view",
    "kv_calculator_figure",
    "mask_explorer_figure",
    "memory_map_figure",
    "memory_map_pair",
    "memory_map_view_figure",
    "masked_attention_figure",
    "mlm_view_figure",
    "model_view",
    "router_figure",
    "sampling_figure",
    "seed_range_figure",
    "ssm_state_figure",
    "sweep_figure",
    "tile_schedule_figure",
    "use_stable_renderer",
    "utilisation_figure",
]
