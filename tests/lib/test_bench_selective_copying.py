"""lib.course.bench.selective_copying: the record's grid of runs, models built as lesson 06 builds them,
one run trained and measured reproducibly, the command's record, bad input."""

import json

import pytest
import torch

import lib.course.bench.selective_copying as sc
from lib.course.bench.selective_copying import (
    LESSON,
    LONG_STEPS,
    SEEDS,
    SHORTER_BLANKS,
    CopyRun,
    build,
    run,
    runs,
    train_one,
)
from lib.mamba_lm import MambaLM


def test_the_grid_covers_every_seed_model_and_length_once():
    grid = runs()
    assert len(grid) == len(set(grid)) == len(SEEDS) * 2 * (2 + len(SHORTER_BLANKS))
    for seed in SEEDS:
        for selective in (True, False):
            mine = {(r.n_blank, r.steps) for r in grid if r.seed == seed and r.selective == selective}
            assert mine == {
                (LESSON["n_blank"], LESSON["steps"]),
                (LESSON["n_blank"], LONG_STEPS),
                *((b, LONG_STEPS) for b in SHORTER_BLANKS),
            }
    assert LONG_STEPS > LESSON["steps"] and all(b < LESSON["n_blank"] for b in SHORTER_BLANKS)
    lesson_run = CopyRun(LESSON["n_blank"], True, LESSON["steps"], 0)
    assert {k: getattr(lesson_run, k) for k in LESSON} == LESSON  # CopyRun's defaults are the lesson's


def test_models_are_built_as_the_lesson_builds_them():
    for selective in (True, False):
        task, model = build(CopyRun(LESSON["n_blank"], selective, 10, seed=3))
        assert task.seq_len == 2 * LESSON["n_data"] + LESSON["n_blank"] and task.vocab_size == LESSON["n_symbols"] + 2
        assert isinstance(model, MambaLM) and model.config.selective == selective
        assert model.config.d_model == LESSON["d_model"] and model.config.n_layers == LESSON["n_layers"]
        assert {p.dtype for p in model.parameters()} == {torch.float64}
        torch.manual_seed(3)  # the seed alone decides the initial weights
        _, again = build(CopyRun(LESSON["n_blank"], selective, 10, seed=3))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_one_run_is_trained_measured_and_reproducible():
    r = CopyRun(n_blank=3, selective=True, steps=4, seed=1, n_data=2, n_symbols=4, d_model=8, batch_size=4)
    first, second = train_one(r), train_one(r)
    assert first["seq_len"] == 7 and first["steps"] == 4 and first["selective"] is True
    assert 0.0 <= first["accuracy"] <= 1.0 and first["final_loss"] > 0
    assert {k: v for k, v in first.items() if k != "seconds"} == {k: v for k, v in second.items() if k != "seconds"}
    other = train_one(
        CopyRun(n_blank=3, selective=True, steps=4, seed=2, n_data=2, n_symbols=4, d_model=8, batch_size=4)
    )
    assert other["final_loss"] != first["final_loss"]  # another seed, another run


def test_the_command_writes_a_record(tmp_path, monkeypatch):
    tiny = [
        CopyRun(n_blank=2, selective=s, steps=2, seed=0, n_data=1, n_symbols=3, d_model=8, batch_size=2)
        for s in (True, False)
    ]
    monkeypatch.setattr(sc, "runs", lambda seeds: tiny)
    lines = []
    record = run((0,), threads=1, progress=lines.append)
    assert [r["selective"] for r in record["results"]] == [True, False] and len(lines) == 2
    assert record["lesson"] == LESSON and record["long_steps"] == LONG_STEPS and record["seeds"] == [0]
    assert (
        record["machine"]["torch_threads"] == 1
        and record["generated_by"] == "python -m lib.course.bench.selective_copying"
    )
    out = tmp_path / "record.json"
    sc.main(["--seeds", "0", "--threads", "1", "--out", str(out)])
    assert json.loads(out.read_text())["results"][0]["n_blank"] == 2


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="seeds must name at least one seed"):
        run(())
    with pytest.raises(ValueError, match="seed must be >= 0"):
        run((-1,))
    with pytest.raises(ValueError, match="threads must be >= 1"):
        run((0,), threads=0)
    with pytest.raises(TypeError, match="r must be a CopyRun"):
        train_one({"n_blank": 3})
