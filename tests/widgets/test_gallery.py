"""The classroom gallery: the registry names all eight live widgets, each builds at classroom
defaults, `present` shows one with a scoped presenter style, and tools/make_gallery.py writes one
Voilà notebook per widget plus an index, with an offline template."""

import importlib.util
import json
import re
from pathlib import Path

import ipywidgets as W
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from lib.course import demos
from lib.course.lessons import LESSONS
from widgets import gallery
from widgets.gallery import GALLERY, PRESENTER_CSS, build, present, presented

ROOT = Path(__file__).resolve().parents[2]
EIGHT = [
    "mask_explorer",
    "mlm_corruption",
    "sampling_knobs",
    "kv_calculator",
    "paging_simulator",
    "tile_schedule",
    "ssm_state_animator",
    "router_animator",
]


@pytest.fixture
def plotly_template():
    """present() switches the kernel's default plotly template: put it back after the test."""
    before = pio.templates.default
    yield
    pio.templates.default = before


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


def _load_make_gallery():
    spec = importlib.util.spec_from_file_location("make_gallery", ROOT / "tools" / "make_gallery.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_registry_holds_the_eight_classroom_widgets_in_course_order():
    assert list(GALLERY) == EIGHT == gallery.names()
    stems = [lesson.stem for lesson in LESSONS]
    assert [stems.index(e.lesson) for e in GALLERY.values()] == sorted(stems.index(e.lesson) for e in GALLERY.values())
    for name, exhibit in GALLERY.items():
        assert exhibit.name == name and exhibit.title and callable(exhibit.builder)
        # one sentence: what to notice
        assert exhibit.notice.endswith(".") and not re.search(r"[.!?] [A-Z]", exhibit.notice), exhibit.notice


def _router_claim(_widget):
    """The notice: with α = 0.1 the auxiliary loss (per layer) comes within 0.1 of its floor K = 2
    (about 2.02 over the last 10 of 80 steps) and the busiest expert takes about 1.34x the even
    share; with α = 0 the loss stays above 2.3 (about 2.9) and the busiest takes over twice its share
    (about 2.27x). The runs train in float64, so these are the same numbers on every CPU."""
    runs = demos.moe_runs()
    aux = {label: sum(run["aux_loss"][-10:]) / 10 for label, run in runs.items()}
    busiest = {
        label: (run["load"][-10:].max(dim=-1).values.max(dim=-1).values.mean() * run["load"].shape[-1]).item()
        for label, run in runs.items()
    }
    assert abs(aux["α = 0.1"] - 2) < 0.1 and aux["α = 0"] > 2.3, aux
    assert 1.15 < busiest["α = 0.1"] < 1.6 and busiest["α = 0"] > 2.0, busiest


def _ssm_claim(widget):
    """The notice: the selective model's Δ changes with the token, the fixed model's never does."""
    view_slider = next(w for w in _walk(widget) if isinstance(w, W.IntSlider))
    assert view_slider.description == "token" and view_slider.value == 1
    _, models = demos.ssm_models()
    import torch

    from lib.mamba_lm import trace_states

    idx = torch.tensor([[2, 0, 0, 3, 0, 1, 1]])  # A . . B . ? ?
    spread = {name: trace_states(m, idx, layer=1)["delta"][0].std(dim=0).max().item() for name, m in models.items()}
    assert spread["selective"] > 1e-2 and spread["fixed Δ, B, C"] < 1e-6, spread


CLAIMS = {"router_animator": _router_claim, "ssm_state_animator": _ssm_claim}


@pytest.mark.parametrize("name", EIGHT)
def test_every_builder_returns_a_live_widget_with_a_figure(name):
    widget = build(name)
    assert isinstance(widget, W.Widget)
    figures = [w for w in _walk(widget) if isinstance(w, go.FigureWidget)]
    assert len(figures) == 1 and len(figures[0].data) >= 1
    controls = [w for w in _walk(widget) if isinstance(w, W.ValueWidget) and not isinstance(w, W.HTML)]
    assert controls, "a live widget has at least one control"
    if name in CLAIMS:
        CLAIMS[name](widget)


def test_present_displays_the_widget_in_a_scoped_presenter_box(monkeypatch, plotly_template):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.extend(objs))
    assert present("kv_calculator") is None  # nothing returned: the cell would display it twice
    (box,) = shown
    assert isinstance(box, W.VBox) and "onemask-present" in box._dom_classes
    header, widget = box.children
    assert "<style>" in header.value and GALLERY["kv_calculator"].title in header.value
    assert any(isinstance(w, go.FigureWidget) for w in _walk(widget))
    # every rule of the style is scoped to the presenter box: nothing else on the page changes
    selectors = re.findall(r"([^{}]+)\{", PRESENTER_CSS)
    assert selectors and all(s.strip().startswith(".onemask-present") for sel in selectors for s in sel.split(","))
    # figures built from now on (also every redraw of the live one) use the larger fonts
    assert pio.templates.default == gallery.PRESENTER_TEMPLATE
    assert go.Figure().layout.template.layout.font.size == gallery.PRESENTER_FONT


def test_present_rejects_an_unknown_name_and_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid names: mask_explorer, mlm_corruption, .*router_animator"):
        present("kv_calculater")
    with pytest.raises(ValueError, match="unknown gallery widget"):
        presented("")


def test_generator_writes_one_notebook_per_widget_an_index_and_an_offline_template(tmp_path):
    make_gallery = _load_make_gallery()
    notebooks = make_gallery.write_gallery(tmp_path)
    files = sorted(p.name for p in notebooks.glob("*.ipynb"))
    expected = [f"{i:02d}-{name}.ipynb" for i, name in enumerate(EIGHT, start=1)]
    assert files == sorted(expected + ["index.ipynb"])
    index = json.loads((notebooks / "index.ipynb").read_text())
    index_text = "".join(index["cells"][0]["source"])
    assert re.findall(r"\]\((\d\d-\w+\.ipynb)\)", index_text) == expected
    for i, file in enumerate(expected):
        nb = json.loads((notebooks / file).read_text())
        nav, code = ("".join(c["source"]) for c in nb["cells"])
        assert code.endswith(f"present({EIGHT[i]!r})")  # one widget per view
        assert ('rel="prev"' in nav) == (i > 0) and ('rel="next"' in nav) == (i < len(expected) - 1)
        if i > 0:
            assert f'href="{expected[i - 1]}"' in nav
        if i < len(expected) - 1:
            assert f'href="{expected[i + 1]}"' in nav
        assert 'href="index.ipynb"' in nav
    template = tmp_path / "share" / "voila" / "templates" / "onemask"
    assert json.loads((template / "conf.json").read_text())["base_template"] == "lab"
    assert (template / "static" / "font-awesome" / "css" / "font-awesome.min.css").exists()
    assert (template / "static" / "font-awesome" / "fonts" / "fontawesome-webfont.woff2").exists()
    for page in ("index.html.j2", "page.html"):
        assert not re.search(r"(href|src)=\"https?://", (template / page).read_text())


def test_voila_serves_on_localhost_only_with_a_token_and_the_gallery_template(tmp_path):
    make_gallery = _load_make_gallery()
    argv, env = make_gallery.voila_command(tmp_path, 8899, "t0k3n")
    assert str(tmp_path / "notebooks") in argv
    for flag in (
        "--Voila.ip=127.0.0.1",
        "--port=8899",
        "--Voila.token=t0k3n",
        "--template=onemask",
        "--no-browser",
        "--Voila.port_retries=0",
    ):
        assert flag in argv
    assert env["JUPYTER_PATH"].split(":")[0] == str(tmp_path / "share")


def test_make_demo_is_a_documented_target():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\.PHONY:.*\bdemo\b", makefile, re.M)
    assert re.search(r"^demo: ", makefile, re.M) and "tools/make_gallery.py" in makefile
    assert "make demo" in makefile and "make demo" in (ROOT / "README.md").read_text()
    assert ".demo/" in (ROOT / ".gitignore").read_text().split()
