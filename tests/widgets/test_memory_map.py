"""The memory-map figures draw lib.serving.simulate_serving's numbers: every cell's counts add up
to the simulator's used and reserved slots at that step, whatever the aggregation; titles carry
the computed token shares; the stored figures are byte-stable; the live view survives every
control value."""

import json

import numpy as np
import plotly.io as pio
import pytest

from lib.serving import simulate_serving, sweep_block_sizes
from lib.workload import make_workload
from widgets._render import use_stable_renderer
from widgets.memory_map import (
    STATES,
    MemoryMapState,
    MemoryMapView,
    memory_grid,
    memory_map_figure,
    memory_map_pair,
    memory_map_view_figure,
    sweep_figure,
    utilisation_figure,
)

REQS = make_workload(40, seed=3, arrival_rate=0.3, prompt_mean=30, output_mean=30, max_len=64)
CAP = 300  # token slots; not a multiple of max_len or of the block size 8
CONTIGUOUS = simulate_serving(REQS, policy="contiguous", capacity_tokens=CAP, max_len=64, reserve="pow2")
PAGED = simulate_serving(REQS, policy="paged", capacity_tokens=CAP, max_len=64, block_size=8)


def columns(trace):
    """(rows, steps) state codes and (rows, steps, 3) [rid, real, empty] from a drawn heatmap."""
    return np.asarray(trace.z), np.asarray(trace.customdata)


@pytest.mark.parametrize("result", [CONTIGUOUS, PAGED], ids=["contiguous", "paged"])
@pytest.mark.parametrize("max_slots", [400, 37, 1])
def test_every_column_adds_up_to_the_simulators_slots(result, max_slots):
    trace = memory_map_figure(result, max_slots=max_slots).data[0]
    z, custom = columns(trace)
    assert z.shape[0] <= max_slots and list(trace.x) == [s for s, _ in result.snapshots]
    for col, step in enumerate(trace.x):
        real, empty = custom[:, col, 1], custom[:, col, 2]
        assert real.sum() == result.used_tokens[step]
        assert (real + empty).sum() == result.reserved_tokens[step]
        # The colour says what the counts say.
        assert ((z[:, col] == 0) == (real + empty == 0)).all()
        assert ((z[:, col] == 1) == ((real == 0) & (empty > 0))).all()
        assert ((z[:, col] == 3) == ((real > 0) & (empty == 0))).all()
        assert ((custom[:, col, 0] == -1) == (z[:, col] == 0)).all()


def test_unmerged_contiguous_map_has_one_real_token_cell_per_token():
    trace = memory_map_figure(CONTIGUOUS, max_slots=CAP).data[0]
    z, custom = columns(trace)
    assert list(trace.y) == list(range(CAP))
    for col, step in enumerate(trace.x):
        assert (z[:, col] == 3).sum() == CONTIGUOUS.used_tokens[step]
        assert (z[:, col] >= 1).sum() == CONTIGUOUS.reserved_tokens[step]
        assert custom[:, col, 0].tolist() == CONTIGUOUS.memory_map(col)["owner"]


def test_unmerged_paged_map_shows_blocks_and_only_last_blocks_are_partial():
    trace = memory_map_figure(PAGED, max_slots=CAP).data[0]
    z, custom = columns(trace)
    assert list(trace.y) == list(range(0, CAP - CAP % 8, 8))  # first token slot of each block
    for col, step in enumerate(trace.x):
        owners = custom[:, col, 0]
        assert owners.tolist() == PAGED.memory_map(col)["owner"]
        assert (z[:, col] == 1).sum() == 0  # a block is taken only when a token needs it
        assert (z[:, col] == 2).sum() <= PAGED.running[step]  # at most one partial block per request
        assert 8 * (z[:, col] == 3).sum() + custom[z[:, col] == 2, col, 1].sum() == PAGED.used_tokens[step]


def test_merged_rows_name_the_request_holding_most_slots():
    g = memory_grid(CONTIGUOUS, max_slots=30)  # 10 slots per row
    assert g["slots_per_row"] == 10 and g["y"] == list(range(0, CAP, 10))
    for col in range(len(g["x"])):
        owner = np.array(CONTIGUOUS.memory_map(col)["owner"]).reshape(30, 10)
        for row in range(30):
            held = owner[row][owner[row] >= 0]
            want = -1 if held.size == 0 else min(set(held.tolist()), key=lambda o: (-(held == o).sum(), o))
            assert g["customdata"][row, col, 0] == want


def test_pair_titles_carry_each_runs_token_share():
    fig = memory_map_pair(CONTIGUOUS, PAGED)
    titles = [a.text for a in fig.layout.annotations]
    c, p = f"{CONTIGUOUS.token_share():.1%}", f"{PAGED.token_share():.1%}"
    assert titles == [
        f"contiguous, reserve pow2: {c} of reserved slots hold real tokens",
        f"paged, 8-token blocks: {p} of reserved slots hold real tokens",
    ]
    assert f"contiguous reservations hold {c} real tokens, paged {p}" in fig.layout.title.text
    assert fig.data[0].coloraxis == fig.data[1].coloraxis == "coloraxis"  # one colour meaning
    assert fig.layout.xaxis2.matches == "x"
    assert fig.layout.meta["paged"] == PAGED.summary()
    with pytest.raises(ValueError, match="contiguous then a paged"):
        memory_map_pair(PAGED, CONTIGUOUS)


def test_states_are_named_in_words_and_axes_have_units():
    fig = memory_map_figure(PAGED)
    bar = fig.layout.coloraxis.colorbar
    assert list(bar.ticktext) == list(STATES) and list(bar.tickvals) == [0, 1, 2, 3]
    assert fig.layout.coloraxis.cmin == -0.5 and fig.layout.coloraxis.cmax == 3.5
    assert "token slot" in fig.layout.yaxis.title.text and "step" in fig.layout.xaxis.title.text
    assert "request %{customdata[0]}" in fig.data[0].hovertemplate
    assert f"{PAGED.token_share():.1%}" in fig.layout.title.text
    assert memory_map_figure(PAGED, title="mine").layout.title.text == "mine"


def test_utilisation_figure_draws_the_per_step_numbers():
    fig = utilisation_figure({"contiguous": CONTIGUOUS, "paged": PAGED}, max_points=50)
    names = [t.name for t in fig.data]
    assert names == ["contiguous: reserved", "contiguous: real tokens", "paged: reserved", "paged: real tokens"]
    for trace, res, values in (
        (fig.data[0], CONTIGUOUS, CONTIGUOUS.reserved_tokens),
        (fig.data[1], CONTIGUOUS, CONTIGUOUS.used_tokens),
        (fig.data[3], PAGED, PAGED.used_tokens),
    ):
        assert 25 <= len(trace.x) <= 50 and trace.x[0] == 0 and trace.x[-1] < res.makespan
        assert list(trace.y) == [values[s] for s in trace.x]
    assert fig.layout.shapes[0].y0 == CAP  # the capacity line


def test_sweep_figure_draws_the_sweep_rows():
    rows = sweep_block_sizes(REQS, capacity_tokens=CAP, max_len=64, block_sizes=[1, 4, 16])
    fig = sweep_figure(rows, contiguous=CONTIGUOUS)
    assert list(fig.data[0].x) == [1, 4, 16]
    assert list(fig.data[0].y) == [round(100 * r["token_share"], 2) for r in rows] and fig.data[0].y[0] == 100.0
    assert list(fig.data[1].y) == [r["mean_running"] for r in rows]
    assert fig.data[2].y[0] == round(100 * CONTIGUOUS.token_share(), 2)
    with pytest.raises(ValueError, match="paged summary"):
        sweep_figure([CONTIGUOUS.summary()])


def test_figures_are_byte_stable_small_and_finite():
    use_stable_renderer()
    again_c = simulate_serving(list(REQS), policy="contiguous", capacity_tokens=CAP, max_len=64, reserve="pow2")
    again_p = simulate_serving(list(REQS), policy="paged", capacity_tokens=CAP, max_len=64, block_size=8)
    for make in (
        lambda c, p: memory_map_pair(c, p),
        lambda c, p: utilisation_figure({"c": c, "p": p}),
        lambda c, p: memory_map_figure(c),
    ):
        a = pio.renderers._build_mime_bundle(make(CONTIGUOUS, PAGED).to_dict())
        b = pio.renderers._build_mime_bundle(make(again_c, again_p).to_dict())
        assert a == b
        text = json.dumps(a["application/vnd.plotly.v1+json"])
        assert "NaN" not in text and "Infinity" not in text
    pair = json.dumps(
        pio.renderers._build_mime_bundle(memory_map_pair(CONTIGUOUS, PAGED).to_dict())["application/vnd.plotly.v1+json"]
    )
    assert '"bdata"' in pair and len(pair) < 60_000  # integer typed arrays, not nested JSON lists


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: memory_map_figure(CONTIGUOUS.summary()), TypeError, "result must be a SimResult"),
        (lambda: memory_map_figure(CONTIGUOUS, max_slots=0), ValueError, "max_slots"),
        (lambda: utilisation_figure({}), TypeError, "non-empty dict"),
        (lambda: utilisation_figure({"x": 3}), TypeError, r"results\['x'\]"),
        (lambda: utilisation_figure({"x": PAGED}, max_points=1), ValueError, "max_points"),
        (lambda: sweep_figure([]), TypeError, "rows"),
    ],
)
def test_bad_input_is_refused_clearly(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --------------------------------------------------------------------------- live view
SMALL = MemoryMapState(n_requests=25, prompt_mean=30, output_mean=30, max_len=128, capacity_tokens=512)


def assert_shows(figure, state):
    want = memory_map_view_figure(state)
    for got, new in zip(figure.data, want.data):
        assert np.array_equal(np.asarray(got.z), np.asarray(new.z)) and list(got.x) == list(new.x)
    assert figure.layout.title.text == want.layout.title.text
    assert figure.layout.meta["state"]["block_size"] == state.block_size


def test_live_view_survives_every_control_extreme():
    view = MemoryMapView(SMALL)
    c = view.controls
    assert list(c) == ["block_size", "arrival_rate", "capacity_tokens", "reserve", "seed"]
    assert c["capacity_tokens"].min >= SMALL.max_len  # every capacity holds one max_len request
    assert_shows(view.figure, view.state)
    for name in ("block_size", "arrival_rate", "capacity_tokens", "seed"):
        for value in (c[name].min, c[name].max):
            c[name].value = value
            assert getattr(view.state, name) == value
    assert_shows(view.figure, view.state)
    for rule in c["reserve"].options:
        c["reserve"].value = rule
        assert view.state.reserve == rule
    assert_shows(view.figure, view.state)


def test_live_view_redraws_in_place_and_has_a_stable_text_repr():
    view = MemoryMapView(SMALL)
    figure, title = view.figure, view.figure.layout.annotations[1].text
    view.controls["block_size"].value = 1
    assert view.figure is figure and figure.layout.annotations[1].text != title
    assert "paged, 1-token blocks: 100.0%" in figure.layout.annotations[1].text
    bundle = view._repr_mimebundle_()
    assert bundle["text/plain"] == "MemoryMapView (a live widget: run this cell in JupyterLab to use it)"
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_smallest_capacity_works_with_every_block_size():
    view = MemoryMapView(SMALL)
    c = view.controls
    c["capacity_tokens"].value = c["capacity_tokens"].min
    for b in range(c["block_size"].min, c["block_size"].max + 1):  # 48 once left too few blocks for max_len
        c["block_size"].value = b
        assert view.state.block_size == b and view.state.capacity_tokens == c["capacity_tokens"].min
