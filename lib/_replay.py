"""Where a training run can be replayed instead of repeated: one decorator, no policy.

The training functions (`lib.train.train_lm`, `lib.tasks.train_on_task`, `lib.bert_mlm.train_mlm`,
`lib.moe_lm.train_moe_lm`) are marked `@replayable`. Left alone, the mark does nothing but call
the function. The course's replay cache (`lib.course.training_cache`) plugs a player in with
`set_player`, and the player decides, from ONEMASK_TRAINING_CACHE, whether to replay a run made
before, record this one, or just train; so the models never import the course's machinery.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

__all__ = ["replayable", "set_player"]

# player(fn, args, kwargs, seeds_global_rng) -> what fn(*args, **kwargs) returns
_player: Callable | None = None


def set_player(player: Callable | None) -> None:
    """Route every `@replayable` call through `player` (None: call the functions directly)."""
    global _player
    _player = player


def replayable(fn=None, *, seeds_global_rng: bool = False):
    """Mark a training function as replayable (module docstring).

    The function must take its callback as `on_step` and, when it trains a model it is given, take
    that model as `model`; a function that builds its own model returns it inside its result.
    `@replayable(seeds_global_rng=True)` declares that the function seeds torch's global generator
    before it draws from it, so the state it is called with is no input of the run.
    """
    if fn is None:
        return functools.partial(replayable, seeds_global_rng=seeds_global_rng)
    if "on_step" not in inspect.signature(fn).parameters:
        raise TypeError(f"replayable: {fn.__qualname__} has no on_step parameter")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _player is None:
            return fn(*args, **kwargs)
        return _player(fn, args, kwargs, seeds_global_rng)

    return run
