"""The classroom gallery: every live widget of the course by name, full-size for a projector.

    from widgets.gallery import present
    present("kv_calculator")            # in a notebook cell: the widget, large, with its caption

    GALLERY["router_animator"]          # an Exhibit: title, lesson, what to notice, builder
    build("mask_explorer")              # the live ipywidget alone, at classroom defaults

`make demo` turns the same registry into one Voilà page per widget (tools/make_gallery.py).

Widgets that draw a trained model (sampling knobs, the SSM state animator, the router animator)
get a small one from `lib.course.demos`, trained when first built (much less than the lessons'
runs, so their numbers are those of a smaller model): 15 s (sampling, router) to 35 s (SSM)
each on a two-core machine, once per kernel. This module holds no model code and trains nothing.

Presenter style: `present` wraps the widget in a box of class `onemask-present` with a <style>
scoped to that class (larger text, taller controls, bigger slider handles, a thick focus ring),
and switches the kernel's default plotly template to a larger-font copy of the course template
(a live figure is rebuilt from the default template on every change, so the fonts must live
there; the gallery's Voilà pages each have a kernel of their own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lib.course import demos

__all__ = ["GALLERY", "PRESENTER_CSS", "Exhibit", "build", "names", "present", "use_presenter_template"]

PRESENT_CLASS = "onemask-present"
PRESENTER_TEMPLATE = "onemask_presenter"
PRESENTER_FONT = 17  # px in figures: readable from the back of a classroom at 1920 x 1080

# Scoped to one presented widget: nothing outside the box changes.
PRESENTER_CSS = f"""
.{PRESENT_CLASS} {{
  --jp-widgets-font-size: 19px;
  --jp-widgets-inline-height: 38px;
  --jp-widgets-inline-width: 380px;
  --jp-widgets-inline-label-width: 120px;
  --jp-widgets-slider-handle-size: 24px;
  --jp-widgets-slider-track-thickness: 6px;
  --jp-widgets-menu-item-height: 34px;
  font-size: 19px;
  line-height: 1.4;
}}
.{PRESENT_CLASS} .onemask-present-title {{ font-size: 30px; font-weight: 600; margin: 0 0 4px 0; }}
.{PRESENT_CLASS} .onemask-present-notice {{ font-size: 21px; max-width: 1100px; margin: 0 0 12px 0; }}
.{PRESENT_CLASS} .widget-label, .{PRESENT_CLASS} .widget-readout,
.{PRESENT_CLASS} .widget-dropdown select, .{PRESENT_CLASS} .widget-text input,
.{PRESENT_CLASS} .widget-toggle-button, .{PRESENT_CLASS} .widget-checkbox,
.{PRESENT_CLASS} .widget-button, .{PRESENT_CLASS} .widget-play button {{ font-size: 19px; }}
.{PRESENT_CLASS} .widget-hslider {{ margin-right: 24px; }}
.{PRESENT_CLASS} :focus-visible, .{PRESENT_CLASS} .noUi-handle:focus {{
  outline: 4px solid #E69F00; outline-offset: 3px;
}}
"""


@dataclass(frozen=True)
class Exhibit:
    """One widget of the gallery."""

    name: str
    title: str
    lesson: str  # the lesson it comes from, "04-kv-cache"
    notice: str  # one sentence: what to notice
    builder: Callable[[], object]  # () -> the live ipywidget, at classroom defaults


# --------------------------------------------------------------------------- builders
def _mask_explorer():
    from widgets.mask_explorer import MaskExplorer

    return MaskExplorer(sentence="The cat sat on the mat .", kind="causal", n_pad=1).widget


def _mlm_corruption():
    from widgets.mlm_view import MLMView

    return MLMView(prob=0.15).widget


def _sampling_knobs():
    from widgets.sampling_knobs import SamplingKnobs

    gpt, vocab = demos.char_gpt()

    @torch.no_grad()
    def next_logits(prompt: str) -> torch.Tensor:
        known = "".join(c for c in prompt.lower() if c in vocab.stoi)
        idx = vocab.encode(("\n" + known)[-(gpt.config.block_size - 1) :])[None]  # (1, T)
        return gpt(idx)[0, -1]  # (V,)

    return SamplingKnobs(next_logits, vocab.itos, prompt="ana went to the ").widget


def _kv_calculator():
    from widgets.kv_calculator import KVCalculator

    return KVCalculator(model="Mistral-7B-v0.1", batch=32, context=8192).widget


def _paging_simulator():
    from widgets.memory_map import MemoryMapView

    return MemoryMapView().widget


def _tile_schedule():
    from widgets.tile_schedule import TileSchedule, TileState

    return TileSchedule(TileState(T=300)).widget


def _ssm_state_animator():
    from lib.mamba_lm import trace_states
    from lib.tasks import BLANK, RECALL
    from widgets.ssm_state import SSMStateView

    task, models = demos.ssm_models()
    probe, _ = task(1, torch.Generator().manual_seed(7))  # (1, T)
    tokens = task.describe(probe[0]).split()
    traces = {name: trace_states(model, probe, layer=1) for name, model in models.items()}
    # the 16 channels whose Δ varies most over the sequence in the selective model, as in lesson 06
    channels = traces["selective"]["delta"][0].std(dim=0).topk(16).indices.sort().values
    runs = {name: (tr["h"][0][:, channels], tr["delta"][0][:, channels]) for name, tr in traces.items()}
    letters = {".": BLANK, "?": RECALL, **{chr(ord("A") + i): i + 2 for i in range(task.n_symbols)}}

    def recompute(text: str):
        chars = list(text.replace(" ", "").upper())
        ids = torch.tensor([[letters[c] for c in chars]])  # (1, T); a KeyError is reported by the view
        traced = {name: trace_states(model, ids, layer=1) for name, model in models.items()}
        return chars, {name: (tr["h"][0][:, channels], tr["delta"][0][:, channels]) for name, tr in traced.items()}

    return SSMStateView(tokens, runs, recompute=recompute, text="".join(tokens)).widget


def _router_animator():
    from widgets.router_view import RouterView

    return RouterView(demos.moe_runs()).widget


GALLERY: dict[str, Exhibit] = {
    e.name: e
    for e in (
        Exhibit(
            "mask_explorer",
            "The mask explorer: one equation, one mask",
            "01-masking-equation",
            "Switch the mask from bidirectional to causal: every −∞ in M becomes a weight of exactly 0, "
            "and each row of the weights still sums to 1.",
            _mask_explorer,
        ),
        Exhibit(
            "mlm_corruption",
            "MLM corruption: what BERT is asked to predict",
            "02-bert",
            "About 15% of the tokens are selected; most of those become [MASK], some a random token, some "
            "stay as they were, and the label row shows that only selected positions count in the loss.",
            _mlm_corruption,
        ),
        Exhibit(
            "sampling_knobs",
            "Sampling knobs: temperature, top-k, top-p",
            "03-gpt",
            "Lower the temperature and the favourite character takes the mass; top-k and top-p cut the "
            "tail and share what was cut among the tokens that remain.",
            _sampling_knobs,
        ),
        Exhibit(
            "kv_calculator",
            "The KV calculator: weights and cache against GPU memory",
            "04-kv-cache",
            "The cache grows in proportion to batch × context; fewer KV heads (grouped-query attention) "
            "divide it, and decide how many users fit beside the weights.",
            _kv_calculator,
        ),
        Exhibit(
            "paging_simulator",
            "The paging simulator: where KV memory goes",
            "04-kv-cache",
            "Contiguous allocation reserves each request's maximum length up front and leaves most of it "
            "empty; paging hands out small blocks as tokens arrive, so more requests run at once.",
            _paging_simulator,
        ),
        Exhibit(
            "tile_schedule",
            "The tile schedule of a flash-attention kernel",
            "05-attention-kernels",
            "With the causal mask on, every tile above the diagonal is skipped: nearly half of the work "
            "disappears, and only the tiles on the diagonal need an element mask.",
            _tile_schedule,
        ),
        Exhibit(
            "ssm_state_animator",
            "The SSM state animator: selective vs fixed",
            "06-mamba",
            "Step through the tokens: the selective model's step size Δ changes with the token, so symbols "
            "and blanks move its state differently; the fixed model treats every token alike.",
            _ssm_state_animator,
        ),
        Exhibit(
            "router_animator",
            "The router animator: experts' load over training",
            "07-moe",
            "With a balance loss (α = 0.1) the auxiliary loss sits near its floor K = 2 and the busiest "
            "expert takes about a third more than the even share 1/E (the dashed line), while without it "
            "(α = 0) the busiest expert takes over twice its share.",
            _router_animator,
        ),
    )
}


def names() -> list[str]:
    """The gallery's widget names, in course order."""
    return list(GALLERY)


def _exhibit(name: str) -> Exhibit:
    if name not in GALLERY:
        raise ValueError(f"unknown gallery widget {name!r}; valid names: {', '.join(GALLERY)}")
    return GALLERY[name]


def build(name: str):
    """The live ipywidget `name` at classroom defaults (ValueError lists the valid names)."""
    return _exhibit(name).builder()


def use_presenter_template() -> None:
    """Make the kernel's new plotly figures use the course template with larger fonts."""
    import plotly.graph_objects as go
    import plotly.io as pio

    from widgets._render import OKABE_ITO, TEMPLATE

    # the course template (what use_stable_renderer registers), built here if it is not registered yet
    template = go.layout.Template(
        pio.templates[TEMPLATE] if TEMPLATE in pio.templates else pio.templates["plotly_white"]
    )
    template.layout.colorway = OKABE_ITO
    template.layout.font.size = PRESENTER_FONT
    template.layout.hoverlabel.font.size = PRESENTER_FONT
    pio.templates[PRESENTER_TEMPLATE] = template
    pio.templates.default = PRESENTER_TEMPLATE


def presented(name: str):
    """The presenter box for `name`: scoped style, title, what to notice, the live widget."""
    import html

    import ipywidgets as W

    exhibit = _exhibit(name)
    use_presenter_template()
    widget = exhibit.builder()
    header = W.HTML(
        f"<style>{PRESENTER_CSS}</style>"
        f"<h1 class='onemask-present-title'>{html.escape(exhibit.title)}</h1>"
        f"<p class='onemask-present-notice'><b>What to notice:</b> {html.escape(exhibit.notice)}</p>"
    )
    box = W.VBox([header, widget], layout=W.Layout(width="100%"))
    box.add_class(PRESENT_CLASS)
    box.add_class(f"onemask-exhibit-{name}")
    return box


def present(name: str) -> None:
    """Display widget `name` full-size with large fonts: the teacher's one line in a notebook cell."""
    from IPython.display import display

    display(presented(name))
