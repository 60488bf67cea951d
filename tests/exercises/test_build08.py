"""Build track 08 (a hybrid from your own parts): each check passes a correct solution, refuses the
stub, and names the mistake in at least three plausible wrong versions of its step; the loader reads
a student's parts from saved notebooks (tagged cells only), keeps those that pass their checks and
replaces the others with lib's stand-ins, saying why."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lib.course.exercises.build08 as checks
from lib.course.exercises import CheckReport
from lib.course.exercises.build08 import (
    RECALL_RECIPE,
    RECALL_TASK,
    HybridConfig,
    LibDecoderBlock,
    LibMoE,
    PartSpec,
    lib_parts,
    student_parts,
)
from lib.mamba import MambaMixer

PARTS = lib_parts()
CFG = checks.RECALL_CONFIG


# --------------------------------------------------------------------------- solutions (as the track's)
def residual_block(*, residual=True, where="pre", unpack=True):
    class MyResidualBlock(nn.Module):
        def __init__(self, d_model, mixer):
            super().__init__()
            self.norm = nn.RMSNorm(d_model, eps=1e-5) if where != "default eps" else nn.RMSNorm(d_model)
            self.mixer = mixer

        def forward(self, x):
            if where == "post":
                h = self.mixer(x)
                h = h[0] if isinstance(h, tuple) and unpack else h
                return self.norm(x + h)
            h = self.mixer(self.norm(x))
            if isinstance(h, tuple) and unpack:
                h = h[0]
            return x + h if residual else h

    return MyResidualBlock


MyResidualBlock = residual_block()


def make_layer(block=MyResidualBlock, *, swap=False, bare=False, fallback=False, cache=None, expert_d_ff=None):
    def my_make_layer(letter, cfg, parts):
        if cache is not None and letter in cache:
            return cache[letter]
        if swap and letter in "AM":
            letter = {"A": "M", "M": "A"}[letter]
        if letter == "A":
            layer = parts.DecoderBlock(cfg.llama())
        elif letter == "M":
            mixer = parts.MambaMixer(cfg.mamba())
            layer = mixer if bare else block(cfg.d_model, mixer)
        elif letter == "E":
            layer = block(
                cfg.d_model, parts.MoE(cfg.d_model, expert_d_ff or cfg.expert_d_ff, cfg.num_experts, cfg.top_k)
            )
        elif fallback:
            layer = block(cfg.d_model, parts.MambaMixer(cfg.mamba()))
        else:
            raise ValueError(f"unknown layer letter {letter!r}: use A, M or E")
        if cache is not None:
            cache[letter] = layer
        return layer

    return my_make_layer


my_make_layer = make_layer()


def hybrid(make=my_make_layer, *, fixed_plan=None, shared=False, final_norm=True, leak=False, reverse=False):
    class MyHybrid(nn.Module):
        def __init__(self, cfg, plan, parts):
            super().__init__()
            plan = fixed_plan or plan
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            if shared:  # one layer per letter, reused wherever the letter comes back
                built = {letter: make(letter, cfg, parts) for letter in set(plan)}
                self.layers = nn.ModuleList([built[letter] for letter in plan])
            else:
                self.layers = nn.ModuleList([make(letter, cfg, parts) for letter in plan])
            self.norm = nn.RMSNorm(cfg.d_model, eps=1e-5)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

        def forward(self, idx):
            x = self.embed(idx)
            for layer in list(self.layers)[::-1] if reverse else self.layers:
                x = layer(x)
            if leak:  # normalised over (T, C): every position reads the whole sequence
                return self.head(F.rms_norm(x, x.shape[1:], None, 1e-5) * self.norm.weight)
            return self.head(self.norm(x) if final_norm else x)

    return MyHybrid


MyHybrid = hybrid()


def train(model_cls=MyHybrid, *, step=True, shift=False, masked=True, one_batch=False):
    def my_train_on_recall(plan, steps, seed):
        torch.manual_seed(seed)
        model = model_cls(CFG, plan, PARTS)
        opt = torch.optim.AdamW(model.parameters(), lr=RECALL_RECIPE.lr, betas=RECALL_RECIPE.betas)
        g = torch.Generator().manual_seed(seed)
        losses = []
        batch = RECALL_TASK(RECALL_RECIPE.batch_size, g)
        for i in range(steps):
            idx, targets = batch if one_batch or i == 0 else RECALL_TASK(RECALL_RECIPE.batch_size, g)
            logits = model(idx)
            V = logits.shape[-1]
            if shift:  # next-token training's shift, where the targets are already aligned
                logits, targets = logits[:, :-1], targets[:, 1:]
            if masked:
                loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
            else:
                loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-1)
            opt.zero_grad()
            loss.backward()
            if step:
                opt.step()
            losses.append(loss.item())
        return model, losses

    return my_train_on_recall


my_train_on_recall = train()

SOLUTIONS = {
    "check_residual_block": MyResidualBlock,
    "check_make_layer": my_make_layer,
    "check_hybrid": MyHybrid,
    "check_recall_training": my_train_on_recall,
}


# --------------------------------------------------------------------------- wrong versions
def layer_norm_block():
    class MyResidualBlock(nn.Module):
        def __init__(self, d_model, mixer):
            super().__init__()
            self.norm = nn.LayerNorm(d_model, eps=1e-5, bias=False)
            self.mixer = mixer

        def forward(self, x):
            h = self.mixer(self.norm(x))
            return x + (h[0] if isinstance(h, tuple) else h)

    return MyResidualBlock


def copied_mixer_block():
    import copy

    class MyResidualBlock(nn.Module):
        def __init__(self, d_model, mixer):
            super().__init__()
            self.norm = nn.RMSNorm(d_model, eps=1e-5)
            self.mixer = copy.deepcopy(mixer)

        def forward(self, x):
            h = self.mixer(self.norm(x))
            return x + (h[0] if isinstance(h, tuple) else h)

    return MyResidualBlock


WRONG_VERSIONS = {
    "check_residual_block": [
        (residual_block(residual=False), "residual is missing"),
        (residual_block(where="post"), "post-norm"),
        (residual_block(unpack=False), "returns a tuple"),
        (residual_block(where="default eps"), "eps is 1e-5"),
        (layer_norm_block(), "not LayerNorm"),
        (copied_mixer_block(), "the mixer you were given"),
    ],
    "check_make_layer": [
        (make_layer(swap=True), "letters map to parts"),
        (make_layer(bare=True), "bare Mamba mixer"),
        (make_layer(fallback=True), "unknown letter must raise"),
        (make_layer(cache={}), "same module"),
        (make_layer(expert_d_ff=64), "parameters"),
        (make_layer(block=residual_block(residual=False)), "Step 8.1"),
    ],
    "check_hybrid": [
        (hybrid(fixed_plan="MMA"), "plan string is ignored"),
        (hybrid(shared=True), "share their weights"),
        (hybrid(final_norm=False), "final norm is missing"),
        (hybrid(leak=True), "future token"),
        (hybrid(reverse=True), "reverse"),
        (hybrid(make=make_layer(swap=True)), "Step 8.2"),
    ],
    "check_recall_training": [
        (train(hybrid(fixed_plan="MMA")), "do not follow the plan"),
        (train(hybrid(make_layer(residual_block(residual=False)))), "no residual"),
        (train(hybrid(leak=True)), "future token"),
        (train(hybrid(final_norm=False)), "final norm is missing"),
        (train(step=False), "never moved"),
        (train(masked=False), "ignore_index=-100"),
        (train(shift=True), "no shift"),
        (train(one_batch=True), "fresh batch"),
    ],
}


# --------------------------------------------------------------------------- the references themselves
def test_stand_ins_have_the_student_interfaces_and_make_lesson_08s_hybrid_causal():
    cfg = HybridConfig()
    x = torch.randn(2, 7, cfg.d_model)
    assert LibDecoderBlock(cfg.llama())(x).shape == x.shape
    assert MambaMixer(cfg.mamba())(x).shape == x.shape
    y, logits = LibMoE(cfg.d_model, cfg.expert_d_ff, cfg.num_experts, cfg.top_k)(x)
    assert y.shape == x.shape and logits.shape == (14, cfg.num_experts)
    torch.manual_seed(0)
    model = MyHybrid(cfg, "MAE", PARTS)
    assert not checks._leaks(model, torch.randint(0, cfg.vocab_size, (2, 9)), 1e-6)


def test_the_decoder_stand_in_equals_lib_llama_with_its_positions():
    from lib.llama import Llama

    cfg = HybridConfig().llama()
    torch.manual_seed(0)
    llama = Llama(cfg)
    block = LibDecoderBlock(cfg)
    block.load_state_dict(llama.model.layers[0].state_dict())
    x = torch.randn(1, 5, cfg.n_embd)
    rope = (llama.rope_cos[:5], llama.rope_sin[:5])
    torch.testing.assert_close(block(x), llama.model.layers[0](x, rope=rope))


def test_the_hybrid_check_prints_the_layer_plan(capsys):
    assert checks.check_hybrid(MyHybrid).passed
    out = capsys.readouterr().out
    assert "Layer plan 'MAEM'" in out and "layer 3  M" in out


def test_training_reports_loss_and_accuracy_against_chance(capsys):
    report = checks.check_recall_training(my_train_on_recall)
    assert report.passed, report
    d = report.details
    assert d["last_loss"] < d["first_loss"] - checks.LOSS_MARGIN
    assert 0 <= d["accuracy"] <= 1 and d["verdict"] == checks._verdict(d["accuracy"], RECALL_TASK)
    assert "chance is 1/16" in capsys.readouterr().out


def test_verdicts_read_the_accuracy_against_chance_and_the_plateau():
    assert "chance" in checks._verdict(0.05, RECALL_TASK)
    assert "plateau" in checks._verdict(0.26, RECALL_TASK)
    assert "learned" in checks._verdict(0.97, RECALL_TASK)


def test_a_later_step_says_which_earlier_step_is_unfinished():
    class Unwritten(nn.Module):
        def __init__(self, cfg, plan, parts):
            super().__init__()
            raise NotImplementedError

    report = checks.check_recall_training(train(Unwritten))
    assert not report.passed and "Unwritten.__init__ is not written yet" in report.problem, report
    assert "finish that step first" in report.hint

    class UnwrittenBlock(nn.Module):
        def __init__(self, d_model, mixer):
            super().__init__()
            raise NotImplementedError

    report = checks.check_make_layer(make_layer(block=UnwrittenBlock))
    assert "UnwrittenBlock.__init__ is not written yet" in report.problem, report


# --------------------------------------------------------------------------- the loader
def _notebook(path, cells):
    """A minimal .ipynb: cells = [(source, tags)]."""
    nb = {
        "cells": [
            {"cell_type": "code", "metadata": {"tags": tags}, "source": src, "outputs": [], "execution_count": None}
            for src, tags in cells
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


PASSING = "def check_fake(cls):\n    return CheckReport('Step 9.9 (fake)', cls.OK, 1, None, 'wrong', 'fix it')\n"


@pytest.fixture
def fake_specs(monkeypatch):
    """Three fake parts checked by `check_fake` in this module: a class passes when its OK is True."""
    import sys
    import types

    module = types.ModuleType("fake_build_checks")
    exec(PASSING, {"CheckReport": CheckReport}, module.__dict__)
    monkeypatch.setitem(sys.modules, "fake_build_checks", module)
    specs = tuple(
        PartSpec(
            s.letter, s.what, s.notebook, s.class_name, ("fake_build_checks", "check_fake"), s.stand_in, s.stand_in_name
        )
        for s in checks.PART_SPECS
    )
    monkeypatch.setattr(checks, "PART_SPECS", specs)
    return specs


def test_loader_keeps_parts_that_pass_and_replaces_the_rest_saying_why(tmp_path, fake_specs, capsys):
    # 03: passes; its check call and an untagged cell are not run
    _notebook(
        tmp_path / "03-build-gpt.ipynb",
        [
            ("import torch.nn as nn\nSEEN = []", ["part"]),
            ("class MyDecoderBlock(nn.Module):\n    OK = True\n\ncheck_decoder_block(MyDecoderBlock)", ["part"]),
            ("raise RuntimeError('an untagged cell must not run')", []),
        ],
    )
    # 06: defines the class but it fails its check
    _notebook(tmp_path / "06-build-mamba.ipynb", [("class MyMambaMixer:\n    OK = False", ["part"])])
    # 07: missing
    parts = student_parts(tmp_path)
    out = capsys.readouterr().out
    assert parts.DecoderBlock.__name__ == "MyDecoderBlock" and parts.DecoderBlock.OK
    assert parts.MambaMixer is MambaMixer and parts.MoE is LibMoE
    assert "yours: MyDecoderBlock from 03-build-gpt.ipynb" in out
    assert "does not pass its check yet" in out and "Step 9.9 (fake)" in out and "fix it" in out
    assert "no 07-build-moe.ipynb" in out and "stand-in: lib.moe.MoE" in out


def test_loader_reports_unfinished_broken_and_untagged_notebooks(tmp_path, fake_specs):
    _notebook(tmp_path / "03-build-gpt.ipynb", [("x = 1", [])])
    _notebook(tmp_path / "06-build-mamba.ipynb", [("class MyMambaMixer:\n    OK = True\nundefined_name", ["part"])])
    _notebook(tmp_path / "07-build-moe.ipynb", [("%matplotlib inline\nraise NotImplementedError", ["part"])])
    parts = student_parts(tmp_path, quiet=True)
    assert parts.DecoderBlock is LibDecoderBlock and "no code cell tagged 'part'" in parts.origin["A"]
    assert parts.MambaMixer is MambaMixer and "NameError" in parts.origin["M"]
    assert parts.MoE is LibMoE and "not finished yet" in parts.origin["E"]


def test_loader_finds_a_track_saved_under_another_topic_name(tmp_path, fake_specs):
    _notebook(tmp_path / "06-build-selective-ssm.ipynb", [("class MyMambaMixer:\n    OK = True", ["part"])])
    parts = student_parts(tmp_path, quiet=True)
    assert parts.MambaMixer.__name__ == "MyMambaMixer" and "06-build-selective-ssm.ipynb" in parts.origin["M"]


def test_loader_runs_the_real_moe_check_on_this_tracks_own_solutions(tmp_path):
    """The generated 07 notebook with its solutions in: MyMoE passes check_moe_layer and is used;
    unsolved, the stand-in is used and the report says not attempted."""
    import jupytext
    import nbformat
    from exercise_helpers import ROOT

    source = ROOT / "lessons" / "build" / "07-build-moe.md"
    nbformat.write(jupytext.read(source), tmp_path / "07-build-moe.ipynb")
    parts = student_parts(tmp_path, quiet=True)
    assert parts.MoE.__name__ == "MyMoE" and parts.origin["E"].startswith("yours")
    unsolved = tmp_path / "unsolved"
    unsolved.mkdir()
    (unsolved / "07-build-moe.ipynb").write_text(source.with_suffix(".ipynb").read_text())
    parts = student_parts(unsolved, quiet=True)
    assert parts.MoE is LibMoE and "is not finished yet (Step 7.4" in parts.origin["E"]
