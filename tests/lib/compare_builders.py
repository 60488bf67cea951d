"""A tiny lib.course.compare setting, shared by the tests of lib.course.compare and lib.course.bench.compare."""

import dataclasses

from lib.course.compare import ARCHITECTURES, SETTINGS, Recipe

TINY = dataclasses.replace(
    SETTINGS["default"],
    name="tiny",
    d_model=32,
    recall={name: Recipe(steps=3, batch_size=4, lr=1e-3) for name in ARCHITECTURES},
    copy={name: Recipe(steps=2, batch_size=4, lr=1e-3) for name in ARCHITECTURES},
    recall_train_pairs=(1, 2),
    recall_eval_pairs=(1, 3),
    copy_train_blanks=(2,),
    copy_eval_blanks=(2, 6),
    eval_batches=1,
    flop_lengths=(8, 16),
    decode_contexts=(4,),
    memory_contexts=(8, 64),
    expert_counts=(2, 4),
    seeds=(0, 1),
    dtype="float32",
    state_sizes=(2,),
)
