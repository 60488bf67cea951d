"""lib.course.compare: the four matched models, their recipes and tasks, the FLOP counter, and the
judging of several seeds."""

import dataclasses

import pytest
import torch
from compare_builders import TINY
from refusals import assert_refuses, built, refusal_test, rows

import lib.course.compare as compare
from lib.course.compare import (
    ARCHITECTURES,
    MixedTask,
    Recipe,
    Setting,
    active_parameters,
    build_models,
    expert_scaling,
    forward_flops,
    parameter_table,
    scaling_exponent,
    train_all,
)
from lib.gpt import GPTConfig
from lib.gpt import forward_flops as gpt_formula
from lib.mamba import SelectiveSSM
from lib.tasks import AssociativeRecall, SelectiveCopying


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


BUILD_MODEL_REFUSALS = [
    ("name", "RWKV", ValueError, "name must be one of ('GPT', 'Mamba', 'MoE GPT', 'Hybrid'), got 'RWKV'"),
    ("vocab_size", 0, ValueError, "vocab_size must be >= 1, got 0"),
    ("seed", 1.5, TypeError, "seed must be an int, got float"),
]
test_build_model_refusals = refusal_test(
    compare.build_model, dict(setting=TINY, name="Mamba", vocab_size=12, seed=5), BUILD_MODEL_REFUSALS
)


def test_active_parameters_count_k_of_e_experts():
    from lib.moe_lm import moe_gpt

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


# fmt: off
FORWARD_FLOPS_REFUSALS = [
    ("model", built(lambda: torch.nn.Linear(2, 2)), TypeError,
     "model must be a lib.gpt.GPT, lib.hybrid.HybridGPT or lib.mamba_lm.MambaLM, got Linear"),
    ("T", 0, ValueError, "T must be >= 1, got 0"),
    ("T", 4.0, TypeError, "T must be an int, got float"),
    ("batch", 0, ValueError, "batch must be >= 1, got 0"),
]
# fmt: on
test_forward_flops_refusals = refusal_test(
    forward_flops, built(lambda: dict(model=compare.build_model(TINY, "GPT", 12), T=4, batch=1)), FORWARD_FLOPS_REFUSALS
)


def test_scaling_exponent_reads_the_power():
    xs = [10, 100, 1000]
    assert scaling_exponent(xs, [x**2 for x in xs]) == pytest.approx(2.0)
    assert scaling_exponent(xs, [3 * x + 0 for x in xs]) == pytest.approx(1.0)
    assert scaling_exponent(xs, [5, 5, 5]) == pytest.approx(0.0)


_LAST_TWO = "the last two points must have positive, distinct x and positive y, got"
SCALING_EXPONENT_REFUSALS = [
    ("xs, ys", ([1], [1]), ValueError, "xs and ys must have the same length >= 2, got 1 and 1"),
    ("ys", [1, 2], ValueError, "xs and ys must have the same length >= 2, got 3 and 2"),
    ("xs, ys", ([4, 4], [1, 2]), ValueError, f"{_LAST_TWO} [4, 4], [1, 2]"),
    ("ys", [1, 0, 2], ValueError, f"{_LAST_TWO} [100, 1000], [0, 2]"),
]
test_scaling_exponent_refusals = refusal_test(
    scaling_exponent, dict(xs=[10, 100, 1000], ys=[1, 2, 4]), SCALING_EXPONENT_REFUSALS
)


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


_TASKS = "tasks must be a non-empty list of tasks (callables (batch, generator) -> (idx, targets))"
# fmt: off
MIXED_TASK_REFUSALS = [
    ("tasks", [AssociativeRecall(2, 2, 8, 8), SelectiveCopying()], ValueError,
     "the tasks must share one vocabulary, got vocab sizes ['10', '18']"),
    ("tasks", [], ValueError, _TASKS),
    ("tasks", [3], ValueError, _TASKS),
]
# fmt: on
test_mixed_task_refusals = refusal_test(
    MixedTask,
    built(lambda: dict(tasks=[AssociativeRecall(2, 2, 4, 4), AssociativeRecall(3, 3, 4, 4)])),
    MIXED_TASK_REFUSALS,
)


def test_each_model_trains_with_its_own_recipe():
    """train_all hands each model its recipe: a model trained alone with its recipe gets the same
    bits (a mapping that misses a model is refused: TRAIN_ALL_REFUSALS)."""
    task = compare.recall_task(TINY, 2)
    recipes = {"GPT": Recipe(steps=2, batch_size=3, lr=1e-2), "Mamba": Recipe(steps=3, batch_size=2, lr=5e-3)}
    models = {k: v for k, v in build_models(TINY, task.vocab_size).items() if k in recipes}
    losses = train_all(models, task, recipes, seed=4)
    assert [len(losses[k]) for k in recipes] == [2, 3]
    again = build_models(TINY, task.vocab_size)["Mamba"]
    assert train_all({"Mamba": again}, task, recipes["Mamba"], seed=4)["Mamba"] == losses["Mamba"]
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), models["Mamba"].parameters()))


_GPT_RECIPE = Recipe(steps=2, batch_size=3, lr=1e-2)
_MAP_EVERY = "recipe must be a lib.course.compare.Recipe or map every model to one; none for"
TRAIN_ALL_REFUSALS = [
    ("recipe", {"GPT": _GPT_RECIPE}, ValueError, f"{_MAP_EVERY} ['Mamba']"),
    ("recipe", None, ValueError, f"{_MAP_EVERY} ['GPT', 'Mamba']"),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(TRAIN_ALL_REFUSALS))
def test_train_all_refusals(argument, bad, error, message):
    task = compare.recall_task(TINY, 2)
    models = {name: compare.build_model(TINY, name, task.vocab_size) for name in ("GPT", "Mamba")}
    good = dict(models=models, task=task, recipe=Recipe(steps=1, batch_size=2, lr=1e-3))
    assert_refuses(train_all, good, argument, bad, error, message)


RECIPE_REFUSALS = [
    ("lr", 0.0, ValueError, "lr must be a finite number > 0, got 0.0"),
    ("lr", "1e-3", TypeError, "lr must be a real number, got str"),
    ("steps", 0, ValueError, "steps must be >= 1, got 0"),
    ("batch_size", 1.0, TypeError, "batch_size must be an int, got float"),
]
test_recipe_refusals = refusal_test(Recipe, dict(steps=1, batch_size=1, lr=1e-3), RECIPE_REFUSALS)


_MAP_EACH = "must map each of ('GPT', 'Mamba', 'MoE GPT', 'Hybrid') to a Recipe, got"
SETTING_REFUSALS = [
    ("recall", {"GPT": _GPT_RECIPE}, ValueError, f"recall {_MAP_EACH} {{'GPT': {_GPT_RECIPE!r}}}"),
    ("copy", None, ValueError, f"copy {_MAP_EACH} None"),
    ("seeds", (), ValueError, "seeds must be a non-empty tuple of ints, got ()"),
    ("seeds", (True,), ValueError, "seeds must be a non-empty tuple of ints, got (True,)"),
    ("state_sizes", (0,), ValueError, "state_sizes must be a tuple of ints >= 1 (Mamba's d_state), got (0,)"),
    ("d_state", 0, ValueError, "d_state must be >= 1, got 0"),
    ("dtype", "float16", ValueError, "dtype must be 'float32' or 'float64', got 'float16'"),
]
test_setting_refusals = refusal_test(
    Setting,
    built(lambda: {f.name: getattr(TINY, f.name) for f in dataclasses.fields(Setting)}),  # TINY, field by field
    SETTING_REFUSALS,
)


_SETTINGS = "['default', 'full', 'state']"
BUILD_MODELS_REFUSALS = [
    ("setting", "huge", ValueError, f"setting must be a Setting or one of {_SETTINGS}, got 'huge'"),
    ("setting", 3, TypeError, f"setting must be a lib.course.compare.Setting or one of {_SETTINGS}, got int"),
    ("vocab_size", 0, ValueError, "vocab_size must be >= 1, got 0"),
    ("seed", "0", TypeError, "seed must be an int, got str"),
]
test_build_models_refusals = refusal_test(build_models, dict(setting="default", vocab_size=10), BUILD_MODELS_REFUSALS)


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
    acc = {
        "GPT": {"4": [1.0, 1.0], "8": [1.0, 0.99], "16": [0.8, 0.9]},
        "Mamba": {"4": [1.0, 0.97], "8": [0.7, 0.9], "16": [0.4, 0.5]},
        "Hybrid": {"4": [0.3, 1.0], "8": [0.2, 1.0], "16": [0.1, 0.9]},
    }
    j = compare.judge_gap(acc, "GPT", "Mamba", easiest=4, judged=(8, 16))
    assert j == dict(learned=True, not_learned=[], at={"8": True, "16": True})
    j = compare.judge_gap(acc, "GPT", "Mamba", easiest=4, judged=(8, 16), margin=0.1)
    assert j["at"] == {"8": False, "16": True}  # 0.99 is not above 0.9 + 0.1
    assert compare.judge_gap(acc, "Hybrid", "Mamba", easiest=4, judged=(8,))["not_learned"] == ["Hybrid"]


JUDGE_STATE_SWEEP_REFUSALS = [
    ("attention", "RWKV", ValueError, "attention must name a model of acc (['GPT', 'Mamba']), got 'RWKV'"),
    ("min_runs", 0, ValueError, "min_runs must be >= 1, got 0"),
]
test_judge_state_sweep_refusals = refusal_test(
    compare.judge_state_sweep,
    dict(acc={"GPT": {"4": [1.0, 1.0]}, "Mamba": {"4": [1.0, 0.5]}}, easiest=4, judged=(4,)),
    JUDGE_STATE_SWEEP_REFUSALS,
)
