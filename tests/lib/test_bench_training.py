"""lib.course.bench.training: the training-step benchmark trains copies (the models passed in are left as
they were), gives every model the same batches, counts the tokens it was timed on, builds each
lesson's models as the lesson does (size, dtype), and refuses bad input by name."""

import json

import pytest
import torch

from lib.course.bench.training import LESSONS, lesson_cases, main, training_throughput
from lib.gpt import GPT, GPTConfig


def _tiny_models():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8)
    return {"a": GPT(config), "b": GPT(config)}


def _batches(lengths, batch=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(11, (batch, t), generator=g), torch.randint(11, (batch, t), generator=g)) for t in lengths]


def test_it_trains_copies_on_the_same_batches_and_counts_their_tokens():
    models = _tiny_models()
    before = {k: {n: p.clone() for n, p in m.state_dict().items()} for k, m in models.items()}
    seen = []
    for m in models.values():
        m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))  # copied along with the model
    out = training_throughput(models, _batches([4, 6, 9]), repeats=4)
    assert set(out) == {"a", "b"}
    for name, m in models.items():  # the originals are untouched
        assert all(torch.equal(p, before[name][n]) for n, p in m.state_dict().items())
    # one warm-up on the first batch, then rounds over the batches in order, each model in turn
    lengths = [shape[1] for shape in seen]
    assert lengths == [4, 4] + [t for t in (4, 6, 9, 4) for _ in range(2)]
    for r in out.values():
        assert len(r["seconds"]) == 4 and all(s > 0 for s in r["seconds"])
        assert r["tokens_per_step"] == 3 * (4 + 6 + 9 + 4) / 4
        assert r["tokens_per_second"] == pytest.approx(r["tokens_per_step"] / r["median_seconds"])


def test_the_lessons_models_are_built_as_the_lessons_build_them():
    built_as = {
        "03": (["GPT"], torch.float64),
        "06": (["Mamba"], torch.float64),
        "07": (["MoE GPT"], torch.float32),
        "08": (["GPT", "Mamba", "MoE GPT", "Hybrid"], torch.float64),
    }
    assert set(built_as) == set(LESSONS)  # every lesson the benchmark times is checked here
    for lesson, (names, dtype) in built_as.items():
        models, batches = lesson_cases(lesson, batches=2)
        assert list(models) == names and len(batches) == 2
        assert all(p.dtype == dtype for m in models.values() for p in m.parameters())  # every one, A_log too
        idx, targets = batches[0]
        for m in models.values():
            m(idx, targets)  # the batches fit the models


def test_the_command_writes_a_record(tmp_path, capsys):
    out = tmp_path / "training.json"
    main(["--lessons", "06", "--repeats", "2", "--threads", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    (row,) = record["results"]
    assert row["lesson"] == "06" and row["model"] == "Mamba" and len(row["seconds"]) == 2
    assert record["machine"]["torch_threads"] == 1 and record["machine"]["device"]
    assert record["generated_by"] == "python -m lib.course.bench.training"
    assert "| 06 | Mamba | float64 |" in capsys.readouterr().out


def test_bad_input_is_refused_by_name():
    models = _tiny_models()
    with pytest.raises(TypeError, match="models must be a non-empty dict"):
        training_throughput({}, _batches([4]))
    with pytest.raises(ValueError, match="batches must be a non-empty list"):
        training_throughput(models, [])
    with pytest.raises(ValueError, match=r"batches\[1\] must be a pair"):
        training_throughput(models, [_batches([4])[0], (torch.zeros(3, 4, dtype=torch.long),)])
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        training_throughput(models, _batches([4]), repeats=0)
    with pytest.raises(ValueError, match="lesson must be one of"):
        lesson_cases("05")


def test_relative_step_times_pair_the_steps_of_one_batch():
    """The median over rounds of paired ratios: a long batch is divided by the long batch's step,
    never by another batch's (a ratio of the two medians would give 1.0 here)."""
    from lib.course.bench.training import relative_step_times

    timed = {"GPT": {"seconds": [1.0, 2.0, 4.0]}, "Mamba": {"seconds": [1.5, 2.0, 100.0]}}
    assert relative_step_times(timed, "GPT") == {"GPT": 1.0, "Mamba": 1.5}
    with pytest.raises(ValueError, match=r"base must name one of the timed models \['GPT', 'Mamba'\], got 'BERT'"):
        relative_step_times(timed, "BERT")
    with pytest.raises(ValueError):  # rounds that do not pair up
        relative_step_times({"GPT": {"seconds": [1.0, 2.0]}, "Mamba": {"seconds": [1.0]}}, "GPT")


def test_torch_threads_sets_and_restores_the_count_even_on_error():
    from lib.course.bench import load_average, torch_threads

    before = torch.get_num_threads()
    with torch_threads(1) as used:
        assert used == torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="inside"):
        with torch_threads(1):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with torch_threads(None) as used:
        assert used == before
    with pytest.raises(ValueError, match="threads must be >= 1"):
        with torch_threads(0):
            pass
    assert all(isinstance(x, float) and x >= 0 for x in load_average())
