"""A synthetic serving workload: requests arriving over time with prompts and outputs to generate.

What a serving simulator (`lib.serving`) is fed: each request arrives at some step, brings a
prompt, and will generate some number of tokens the server does not know in advance. Arrivals
follow a Poisson process and lengths a geometric distribution (many short requests, a long
tail), the usual shape of chat traffic; all draws are seeded, so a workload is the same list on
every machine.

    Request         one request: rid, arrival step, prompt_len, output_len
    make_workload   n seeded synthetic requests in arrival order
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lib._checks import require_int, require_real

__all__ = ["Request", "make_workload"]


@dataclass(frozen=True)
class Request:
    """A serving request: arrives at step `arrival`, brings `prompt_len` tokens, will generate
    `output_len` (which the server does not know in advance, except under reserve="oracle")."""

    rid: int
    arrival: int
    prompt_len: int
    output_len: int

    def __post_init__(self):
        require_int("rid", self.rid, minimum=0)
        require_int("arrival", self.arrival, minimum=0)
        require_int("prompt_len", self.prompt_len, minimum=1)
        require_int("output_len", self.output_len, minimum=1)


def _geometric(rng: random.Random, mean: float) -> int:
    """A draw from the geometric distribution on {1, 2, ...} with the given mean, by inversion."""
    if mean == 1.0:
        return 1
    u = 1.0 - rng.random()  # in (0, 1]
    return 1 + int(math.log(u) / math.log(1.0 - 1.0 / mean))


def make_workload(
    n_requests: int,
    *,
    seed: int = 0,
    arrival_rate: float = 1.0,
    prompt_mean: float = 200,
    output_mean: float = 200,
    max_len: int = 1024,
) -> list[Request]:
    """`n_requests` synthetic requests, rid 0..n-1 in arrival order.

    Arrivals: a Poisson process with `arrival_rate` requests per step (exponential gaps with mean
    1/arrival_rate, the first gap counted from time 0); a request arriving at time τ is seen at
    step floor(τ). Lengths: prompt and output are independent geometric draws on {1, 2, ...} with
    means `prompt_mean` and `output_mean` (the discrete exponential: many short requests, a long
    tail). Then the prompt is cut to max_len - 1 and the output to max_len - prompt, so every
    request fits the model's context; the cut puts a little probability mass at the cap.
    Draws come from `random.Random(seed)`, per request in the order gap, prompt, output.
    """
    require_int("n_requests", n_requests, minimum=1)
    require_int("seed", seed, minimum=0)
    rate = require_real("arrival_rate", arrival_rate, above=0)
    p_mean = require_real("prompt_mean", prompt_mean, at_least=1)
    o_mean = require_real("output_mean", output_mean, at_least=1)
    require_int("max_len", max_len, minimum=2)
    rng = random.Random(seed)
    time, out = 0.0, []
    for rid in range(n_requests):
        time += rng.expovariate(rate)
        prompt = min(_geometric(rng, p_mean), max_len - 1)
        output = min(_geometric(rng, o_mean), max_len - prompt)
        out.append(Request(rid=rid, arrival=int(time), prompt_len=prompt, output_len=output))
    return out
