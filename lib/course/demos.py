"""The small trained models the classroom gallery's widgets draw (`widgets.gallery`).

Each is trained here, seeded, in float64 on one thread (tiny models train faster on one), so it is the same
model on every CPU, and
much smaller and shorter than the lessons' runs (its numbers are those of a smaller model): 15 s
(the character GPT, the MoE runs) to 35 s (the two Mamba models) each on a two-core machine. Each
is trained once per Python process (`functools.lru_cache`).

    char_gpt     a 2-layer character GPT on the facts corpus, and its vocabulary
    ssm_models   a selective and a fixed-Δ Mamba on short selective-copying sequences, and the task
    moe_runs     two small MoE language models' routing records, without and with a balance loss
"""

from __future__ import annotations

import functools

import torch

from lib.corpus import CharVocab, facts_corpus
from lib.course.bench import torch_threads
from lib.course.precision import default_dtype
from lib.gpt import GPT, GPTConfig
from lib.mamba import MambaConfig
from lib.mamba_lm import MambaLM
from lib.moe_lm import train_moe_lm
from lib.tasks import SelectiveCopying, train_on_task
from lib.train import train_lm

__all__ = ["char_gpt", "moe_runs", "ssm_models"]


@functools.lru_cache(maxsize=1)
def char_gpt():
    """A 2-layer character GPT on the facts corpus, 200 steps (lesson 03 trains a wider one longer)."""
    text = "\n".join(facts_corpus(2000, seed=0)) + "\n"
    vocab = CharVocab.build(text)
    with torch_threads(1), default_dtype(torch.float64):  # the same trained model on every CPU
        torch.manual_seed(0)
        gpt = GPT(GPTConfig.tiny(vocab_size=len(vocab), n_layer=2, n_embd=64, block_size=32))
        train_lm(gpt, vocab.encode(text), steps=200, batch_size=16, lr=6e-3, seed=0)
    return gpt, vocab


@functools.lru_cache(maxsize=1)
def ssm_models():
    """Selective and fixed-Δ Mamba (2 layers, width 32) on short selective-copying sequences,
    150 steps each (lesson 06 trains on much longer sequences for 1,200 steps)."""
    task = SelectiveCopying(n_data=3, n_blank=9, n_symbols=8)
    models = {}
    with torch_threads(1), default_dtype(torch.float64):  # the same trained models on every CPU
        for name, selective in (("selective", True), ("fixed Δ, B, C", False)):
            torch.manual_seed(0)
            models[name] = MambaLM(MambaConfig(vocab_size=task.vocab_size, d_model=32, n_layers=2, selective=selective))
            train_on_task(models[name], task, steps=150, batch_size=32, lr=5e-3, seed=0)
    return task, models


@functools.lru_cache(maxsize=1)
def moe_runs():
    """Two small MoE language models (8 experts, top-2), without and with a balance loss (α = 0.1,
    per layer), 80 steps each (lesson 07 sweeps six α for 150 steps; at α = 1 a layer can still
    send every token to two experts while its probabilities stay flat, which lesson 07 explains)."""
    with torch_threads(1), default_dtype(torch.float64):  # the same trained models on every CPU
        records = {alpha: train_moe_lm(alpha, steps=80, seed=0) for alpha in (0.0, 0.1)}
    return {
        f"α = {alpha:g}": {
            "load": rec.load,
            "loss": rec.loss,
            "aux_loss": rec.aux_loss,
            "assignments": rec.assignments,
            "assignment_steps": rec.assignment_steps,
            "tokens": rec.tokens,
        }
        for alpha, rec in records.items()
    }
