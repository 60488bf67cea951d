"""The tile-schedule widget draws the kernel's own loop bounds (lib.kernels.key_block_bounds) for
every control value, and its animation reaches every visited tile exactly once."""

import numpy as np
import pytest

from lib.kernels.flash import key_block_bounds, visited_blocks
from widgets.tile_schedule import TileSchedule, TileState, tile_grid, tile_schedule_figure


@pytest.mark.parametrize("T", [1, 15, 64, 65, 200, 1000])
@pytest.mark.parametrize("blocks", [(16, 16), (64, 32), (32, 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_grid_follows_the_kernels_bounds(T, blocks, causal):
    state = TileState(T=T, block_m=blocks[0], block_n=blocks[1], causal=causal)
    grid = tile_grid(state)
    assert grid["visited"] == visited_blocks(T, *blocks, causal)
    for m, row in enumerate(grid["kind"]):
        n_full, n_end = key_block_bounds(m, T, *blocks, causal)
        assert row == [2] * n_full + [1] * (n_end - n_full) + [0] * (len(row) - n_end)
    if not causal:
        assert grid["visited"] == grid["total"]


def test_causal_skips_about_half_the_tiles_at_large_T():
    grid = tile_grid(TileState(T=4096, block_m=64, block_n=64, causal=True))
    assert abs(grid["visited"] / grid["total"] - 0.5) < 0.01  # 64 blocks: (64·65/2) / 64² = 0.508


def test_animation_reaches_each_visited_tile_once_in_key_order():
    state = TileState(T=300, block_m=64, block_n=32)
    fig = tile_schedule_figure(state)
    grid = tile_grid(state)
    final = np.array(fig.data[0].z)
    assert (final == np.array(grid["kind"])).all()
    reached_before = np.zeros_like(final, dtype=bool)
    for frame in fig.frames:
        z = np.array(frame.data[0].z)
        reached = (z == 1) | (z == 2)
        assert (reached >= reached_before).all()  # nothing is un-visited
        newly = reached & ~reached_before
        assert (newly.sum(axis=1) <= 1).all()  # each program takes one key block per step
        reached_before = reached
    assert (reached_before == (final != 0)).all()
    assert len(fig.layout.sliders[0].steps) == len(fig.frames)


def test_live_widget_survives_every_control_value_and_redraws():
    w = TileSchedule()
    title = w.figure.layout.title.text
    w.controls["block_m"].value = 16
    assert w.figure.layout.title.text != title
    for T in (w.controls["T"].min, w.controls["T"].max):
        w.controls["T"].value = T
        for bm in w.controls["block_m"].options:
            for bn in w.controls["block_n"].options:
                for causal in (True, False):
                    w.controls["block_m"].value, w.controls["block_n"].value, w.controls["causal"].value = (
                        bm,
                        bn,
                        causal,
                    )
                    assert w.figure.layout.meta["state"] == {"T": T, "block_m": bm, "block_n": bn, "causal": causal}
    assert "live widget" in w._repr_mimebundle_()["text/plain"]


def test_bad_states_are_refused():
    for bad in (dict(T=0), dict(block_m=0), dict(T=10**6), dict(block_n=2.5)):
        with pytest.raises(ValueError):
            tile_schedule_figure(**bad)
