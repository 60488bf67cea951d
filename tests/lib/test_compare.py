"""lib.compare: the four matched models, the FLOP counter, and a whole (tiny) comparison run."""

import dataclasses
import json
import time

import pytest
import torch

import lib.compare as compare
from lib.compare import (ARCHITECTURES, SETTINGS, MixedTask, Recipe, active_parameters, build_models, expert_scaling,
                         forward_flops, parameter_table, scaling_exponent, train_all)
from lib.gpt import GPT, GPTConfig
from lib.gpt import forward_flops as gpt_formula
from lib.tasks import AssociativeRecall, SelectiveCopying
from lib.mamba import SelectiveSSM

TINY = dataclasses.replace(SETTINGS["default"], name="tiny", d_model=32,
                           recall={name: Recipe(steps=3, batch_size=4, lr=1e-3) for name in ARCHITECTURES},
                           copy={name: Recipe(steps=2, batch_size=4, lr=1e-3) for name in ARCHITECTURES}, recall_train_pairs=(1, 2),
                           recall_eval_pairs=(1, 3), copy_train_blanks=(2,), copy_eval_blanks=(2, 6), eval_batches=1,
                           flop_lengths=(8, 16), decode_contexts=(4,), memory_contexts=(8, 64), expert_counts=(2, 4),
                           seeds=(0, 1), dtype="float32", state_sizes=(2,))


def test_the_four_models_are_matched_in_size_and_the_moe_in_active_parameters():
    models = build_models("default", 34)
    assert tuple(models) == ARCHITECTURES
    table = {row["model"]: row for row in parameter_table(models)}
    dense = [table[n]["total"] for n in ("GPT", "Mamba", "Hybrid")]
    assert max(dense) / min(dense) < 1.1
    assert table["MoE GPT"]["total"] > 1.5 * table["GPT"]["total"]
    assert abs(table["MoE GPT"]["active"] / table["GPT"]["active"] - 1) < 0.01
    assert all(table[n]["active"] == table[n]["total"] for n in ("GPT", "Mamba", "Hybrid"))
    assert models["Hybrid"].pattern == "MMA"
    # seeded: building again gives the same weights
    again = build_models("default", 34)
    assert all(torch.equal(a, b) for a, b in zip(models["Mamba"].parameters(), again["Mamba"].parameters()))


def test_build_model_builds_one_of_the_four_with_the_same_weights():
    models = build_models(TINY, 12, seed=5)
    for name in ARCHITECTURES:  # each from its own seed (seed + index), whichever others are built
        alone = compare.build_model(TINY, name, 12, seed=5)
        assert type(alone) is type(models[name])
        assert all(torch.equal(a, b) for a, b in zip(alone.state_dict().values(), models[name].state_dict().values()))
    other = compare.build_model(TINY, "Mamba", 12, seed=6)
    assert not torch.equal(next(other.parameters()), next(models["Mamba"].parameters()))
    torch.rand(7)  # whatever ran before, a model is seeded by its own (seed, architecture) alone
    again = compare.build_model(TINY, "Mamba", 12, seed=6)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), other.parameters()))
    with pytest.raises(ValueError, match="name must be one of"):
        compare.build_model(TINY, "RWKV", 12)


def test_active_parameters_count_k_of_e_experts():
    from lib.moe import moe_gpt
    config = GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8)
    m = moe_gpt(config, num_experts=4, top_k=1, d_ff=16)
    expert = 2 * 8 * 16
    assert sum(p.numel() for p in m.parameters()) - active_parameters(m) == 3 * expert


def test_flop_count_equals_the_gpt_formula_and_is_linear_for_mamba():
    models = build_models(TINY, 12)
    gpt = models["GPT"]
    for T in (1, 7, 16):
        assert forward_flops(gpt, T) == gpt_formula(gpt.config, T)
    for name in ("Mamba",):
        f = [forward_flops(models[name], T) for T in (8, 16, 32)]
        assert f[1] == 2 * f[0] and f[2] == 2 * f[1]  # every term is linear in T
    assert scaling_exponent((8, 16), [forward_flops(models["Mamba"], T) for T in (8, 16)]) == pytest.approx(1.0)
    # the scan is counted once, by its formula, whichever implementation the model runs (the chunked one
    # reads C·h with a matmul the counter would also see), and the model's own choice is left as it was
    mamba = models["Mamba"]
    counts = {}
    for scan in ("chunked", "ref", "auto"):
        for m in mamba.modules():
            if isinstance(m, SelectiveSSM):
                m.scan = scan
        counts[scan] = forward_flops(mamba, 24)
        assert all(m.scan == scan for m in mamba.modules() if isinstance(m, SelectiveSSM))
    assert len(set(counts.values())) == 1, counts
    with pytest.raises(TypeError, match="model must be a lib.gpt.GPT"):
        forward_flops(torch.nn.Linear(2, 2), 4)


def test_scaling_exponent_reads_the_power():
    xs = [10, 100, 1000]
    assert scaling_exponent(xs, [x ** 2 for x in xs]) == pytest.approx(2.0)
    assert scaling_exponent(xs, [3 * x + 0 for x in xs]) == pytest.approx(1.0)
    assert scaling_exponent(xs, [5, 5, 5]) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="same length >= 2"):
        scaling_exponent([1], [1])
    with pytest.raises(ValueError, match="positive, distinct x"):
        scaling_exponent([4, 4], [1, 2])


def test_expert_flops_grow_only_by_the_router():
    rows = expert_scaling(TINY, 12, T=16)
    (a, b) = rows
    C, layers = TINY.d_model, 2
    assert b["flops"] - a["flops"] == 2 * 16 * C * (b["experts"] - a["experts"]) * layers  # the router's C·E column
    assert b["total"] > a["total"] and b["active"] - a["active"] == C * (b["experts"] - a["experts"]) * layers


def test_mixed_task_is_seeded_and_checks_its_parts():
    mix = MixedTask([AssociativeRecall(2, 2, 4, 4), AssociativeRecall(3, 3, 4, 4)])
    shapes = [mix(2, g)[0].shape[1] for g in [torch.Generator().manual_seed(0)] for _ in range(20)]
    assert set(shapes) == {7, 10}
    again = [mix(2, g)[0].shape[1] for g in [torch.Generator().manual_seed(0)] for _ in range(20)]
    assert shapes == again
    with pytest.raises(ValueError, match="share one vocabulary"):
        MixedTask([AssociativeRecall(2, 2, 8, 8), SelectiveCopying()])
    with pytest.raises(ValueError, match="non-empty list"):
        MixedTask([])


def test_a_whole_tiny_run_measures_everything(tmp_path, monkeypatch):
    out = compare.run(TINY)
    assert out["seeds"] == [0, 1]
    assert set(out["recall_accuracy"]) == set(ARCHITECTURES)
    assert all(len(accs) == 2 and all(0.0 <= a <= 1.0 for a in accs)
               for row in out["recall_accuracy"].values() for accs in row.values())
    assert list(out["copy_accuracy"]["GPT"]) == [str(2 * TINY.copy_data + b) for b in TINY.copy_eval_blanks]
    assert [len(c) for c in out["recall_loss"]["Mamba"]] == [1, 1]  # 3 steps: one mean of LOSS_EVERY
    assert out["state_bytes"]["Mamba"][0] == out["state_bytes"]["Mamba"][1]  # constant in the context
    assert out["state_bytes"]["GPT"][1] == 8 * out["state_bytes"]["GPT"][0]  # linear: 8 -> 64 positions
    assert all(s > 0 for row in out["seconds_per_token"].values() for s in row)
    # seed 1's numbers are those of a run of seed 1 alone, and two processes give the run of one
    alone = compare.run(dataclasses.replace(TINY, seeds=(1,)), timing=False)
    assert all(out["recall_accuracy"][n][k][1] == alone["recall_accuracy"][n][k][0]
               for n in ARCHITECTURES for k in alone["recall_accuracy"][n])
    assert out["recall_loss"]["GPT"][1] == alone["recall_loss"]["GPT"][0]
    # the state sweep: the setting's own d_state is the main Mamba; d_state = 2 is a Mamba with that state
    assert list(out["state_accuracy"]) == ["2", str(TINY.d_state)]
    assert out["state_accuracy"][str(TINY.d_state)] == out["recall_accuracy"]["Mamba"]
    small = compare.run(dataclasses.replace(TINY, d_state=2, state_sizes=()), timing=False)
    assert out["state_accuracy"]["2"] == small["recall_accuracy"]["Mamba"] and "state_accuracy" not in small
    assert out["state_loss"]["2"] == small["recall_loss"]["Mamba"] != out["recall_loss"]["Mamba"]
    small_mamba = build_models(dataclasses.replace(TINY, d_state=2), 10)["Mamba"]
    assert all(m.d_state == 2 for m in small_mamba.modules() if isinstance(m, SelectiveSSM))
    monkeypatch.setitem(compare.SETTINGS, "tiny", TINY)
    [path] = compare.main(["--setting", "tiny", "--jobs", "2", "--no-timing", "--out", str(tmp_path / "r.json")])
    saved = json.loads(path.read_text())
    assert saved["command"] == "python -m lib.compare --setting tiny --jobs 2 --no-timing"
    assert "seconds_per_token" not in saved and saved["recall_accuracy"] == out["recall_accuracy"]
    assert saved["setting"]["recall"]["GPT"]["lr"] == 1e-3 and saved["machine"]["torch_threads"] == 1 and saved["generated_by"] == "python -m lib.compare"
    assert compare.load_results("full", root=tmp_path) is None
    # one command writes several records, each saying the command that writes it alone
    monkeypatch.setitem(compare.SETTINGS, "tinystate", dataclasses.replace(TINY, name="tinystate", seeds=(0,)))
    monkeypatch.setattr(compare, "SWEEPS", ("tinystate",))
    monkeypatch.setattr(compare, "BENCHMARKS", tmp_path)
    paths = compare.main(["--setting", "tiny", "tinystate", "--jobs", "1", "--no-timing"])
    assert [p.name for p in paths] == ["compare_tiny.json", "compare_tinystate.json"]
    sweep = json.loads(paths[1].read_text())
    assert sweep["command"] == "python -m lib.compare --setting tinystate --jobs 1"
    assert list(sweep["recall_accuracy"]) == ["GPT", "Mamba (d_state 2)"] and "copy_accuracy" not in sweep
    with pytest.raises(SystemExit):
        compare.main(["--setting", "tiny", "tinystate", "--out", str(tmp_path / "r.json")])


def test_each_model_trains_with_its_own_recipe():
    """train_all hands each model its recipe: a model trained alone with its recipe gets the same
    bits; a mapping that misses a model is refused."""
    task = compare.recall_task(TINY, 2)
    recipes = {"GPT": Recipe(steps=2, batch_size=3, lr=1e-2), "Mamba": Recipe(steps=3, batch_size=2, lr=5e-3)}
    models = {k: v for k, v in build_models(TINY, task.vocab_size).items() if k in recipes}
    losses = train_all(models, task, recipes, seed=4)
    assert [len(losses[k]) for k in recipes] == [2, 3]
    again = build_models(TINY, task.vocab_size)["Mamba"]
    assert train_all({"Mamba": again}, task, recipes["Mamba"], seed=4)["Mamba"] == losses["Mamba"]
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), models["Mamba"].parameters()))
    with pytest.raises(ValueError, match="none for \\['Mamba'\\]"):
        train_all(models, task, {"GPT": recipes["GPT"]})
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        Recipe(steps=1, batch_size=1, lr=0.0)
    with pytest.raises(ValueError, match="recall must map each of"):
        dataclasses.replace(TINY, recall={"GPT": recipes["GPT"]})
    with pytest.raises(ValueError, match="seeds must be a non-empty tuple"):
        dataclasses.replace(TINY, seeds=())
    with pytest.raises(ValueError, match="state_sizes must be a tuple of ints >= 1"):
        dataclasses.replace(TINY, state_sizes=(0,))
    with pytest.raises(ValueError, match="d_state must be >= 1"):
        dataclasses.replace(TINY, d_state=0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="setting must be a Setting or one of"):
        build_models("huge", 10)
    with pytest.raises(TypeError, match="setting must be a lib.compare.Setting"):
        build_models(3, 10)
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        build_models("default", 0)
    with pytest.raises(ValueError, match="context must be >= 1"):
        compare.decode_seconds_per_token(GPT(GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=1, n_embd=4)), 0)


class _SlowStep(GPT):
    """A GPT whose every one-token decoding step sleeps 3 ms more: a known slowdown to measure."""

    def forward(self, idx, *args, **kwargs):
        if idx.shape[1] == 1:
            time.sleep(0.003)
        return super().forward(idx, *args, **kwargs)


def test_decode_time_ratio_measures_a_known_slowdown_side_by_side():
    config = GPTConfig(vocab_size=7, block_size=40, n_layer=1, n_head=1, n_embd=8)
    torch.manual_seed(0)
    fast, slow = GPT(config), _SlowStep(config)
    slow.train()
    # a tiny step takes well under 3 ms on any CPU, so the sleep sets the ratio far above 1, and its inverse below 1
    assert compare.decode_time_ratio(slow, fast, 8, new_tokens=4, rounds=3) > 1.5
    assert compare.decode_time_ratio(fast, slow, 8, new_tokens=4, rounds=3) < 1 / 1.5
    assert slow.training and torch.is_grad_enabled()  # modes restored
    assert compare.decode_seconds_per_token(slow, 8, new_tokens=4, repeats=1) > 0.003
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        compare.decode_time_ratio(slow, fast, 8, rounds=0)


def test_seed_ranges_and_gaps_that_no_seed_closes():
    acc = {"GPT": {"8": [1.0, 0.97, 0.99]}, "Mamba": {"8": [0.6, 0.91, 0.7]}, "Hybrid": {"8": [0.9, 0.95, 0.99]}}
    assert compare.seed_range(acc, "Mamba", 8) == compare.seed_range(acc, "Mamba", "8") == (0.6, 0.91)
    assert compare.beats(acc, "GPT", "Mamba", 8)  # 0.97 > 0.91 + 0.05
    assert not compare.beats(acc, "GPT", "Mamba", 8, margin=0.06)  # one seed of Mamba comes within 6 points
    assert not compare.beats(acc, "GPT", "Hybrid", 8) and not compare.beats(acc, "Mamba", "GPT", 8)
    assert compare.trained(acc, "8") == {"GPT": True, "Mamba": False, "Hybrid": False}  # Hybrid's 0.90 fails
    single = {"GPT": {4: 0.96}, "Mamba": {4: 0.5}}  # one live run: one seed
    assert compare.trained(single, 4) == {"GPT": True, "Mamba": False} and compare.beats(single, "GPT", "Mamba", 4)


def test_a_gap_is_judged_only_between_models_that_learned():
    acc = {"GPT": {"4": [1.0, 1.0], "8": [1.0, 0.99], "16": [0.8, 0.9]},
           "Mamba": {"4": [1.0, 0.97], "8": [0.7, 0.9], "16": [0.4, 0.5]},
           "Hybrid": {"4": [0.3, 1.0], "8": [0.2, 1.0], "16": [0.1, 0.9]}}
    j = compare.judge_gap(acc, "GPT", "Mamba", easiest=4, judged=(8, 16))
    assert j == dict(learned=True, not_learned=[], at={"8": True, "16": True})
    j = compare.judge_gap(acc, "GPT", "Mamba", easiest=4, judged=(8, 16), margin=0.1)
    assert j["at"] == {"8": False, "16": True}  # 0.99 is not above 0.9 + 0.1
    assert compare.judge_gap(acc, "Hybrid", "Mamba", easiest=4, judged=(8,))["not_learned"] == ["Hybrid"]


def test_state_sweep_is_the_gpt_and_each_state_size_trained_on_recall():
    s = dataclasses.replace(TINY, state_sizes=(2, 1), seeds=(0, 1), recall_train_pairs=(1, 3))
    out = compare.state_sweep(s)
    assert list(out["recall_accuracy"]) == ["GPT", "Mamba (d_state 2)", "Mamba (d_state 1)"]
    assert all(list(acc) == ["1", "3"] and all(len(v) == 2 for v in acc.values()) for acc in out["recall_accuracy"].values())
    # each entry is the one run of that model, state size and seed: the parts computed alone agree
    alone = compare._train_one(s, 1, "recall", "Mamba", 1)
    assert [out["recall_accuracy"]["Mamba (d_state 1)"][k][1] for k in ("1", "3")] == list(alone["accuracy"].values())
    assert out["recall_loss"]["Mamba (d_state 1)"][1] == alone["loss"]
    gpt = compare._train_one(s, 0, "recall", "GPT")
    assert out["recall_loss"]["GPT"][0] == gpt["loss"]
    json.dumps(out)
    with pytest.raises(ValueError, match="state_sizes must name at least one"):
        compare.state_sweep(dataclasses.replace(TINY, state_sizes=()))
    assert compare.SETTINGS["state"].recall_train_pairs == compare.SETTINGS["state"].recall_eval_pairs[2:]


def test_learned_runs_keep_each_models_seeds_that_reached_the_threshold():
    acc = {"GPT": {"4": [1.0, 1.0, 0.99], "16": [1.0, 0.98, 1.0]},
           "Mamba (d_state 1)": {"4": [0.32, 0.98, 0.96], "16": [0.19, 0.79, 0.85]}}
    good = compare.learned_runs(acc, 4)
    assert good["GPT"] == acc["GPT"]
    assert good["Mamba (d_state 1)"] == {"4": [0.98, 0.96], "16": [0.79, 0.85]}  # seed 0 left out everywhere
    assert compare.learned_runs(acc, "4", threshold=0.99)["Mamba (d_state 1)"] == {"4": [], "16": []}


def test_a_state_sweep_is_judged_on_the_runs_that_learned():
    acc = {"GPT": {"4": [1.0, 1.0, 1.0], "16": [1.0, 1.0, 0.99]},
           "Mamba (d_state 16)": {"4": [1.0, 1.0, 1.0], "16": [1.0, 0.97, 1.0]},
           "Mamba (d_state 1)": {"4": [0.32, 0.98, 0.97], "16": [0.19, 0.79, 0.85]},
           "Mamba (d_state 2)": {"4": [0.32, 0.98, 0.5], "16": [0.19, 0.79, 0.3]}}
    j = compare.judge_state_sweep(acc, easiest=4, judged=(16,))
    assert list(j) == ["Mamba (d_state 16)", "Mamba (d_state 1)", "Mamba (d_state 2)"]
    assert j["Mamba (d_state 16)"] == dict(runs=(3, 3), at={"16": False})  # within the margin
    # the seed that never learned (32% at P = 4) is left out: the judgement rests on the two that did
    assert j["Mamba (d_state 1)"] == dict(runs=(2, 3), at={"16": True})
    assert j["Mamba (d_state 2)"] == dict(runs=(1, 3), at=None)  # one run decides nothing
    assert compare.judge_state_sweep(acc, easiest=4, judged=(16,), min_runs=1)["Mamba (d_state 2)"]["at"] == {"16": True}
    with pytest.raises(ValueError, match="attention must name a model"):
        compare.judge_state_sweep(acc, easiest=4, judged=(16,), attention="Transformer")
