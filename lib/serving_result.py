"""What a serving simulation measured: where each step's KV slots went, and the shares of waste.

`lib.serving.simulate_serving` fills one `SimResult` per run. Each step it records, over the running
requests, the slots they hold split three ways (Kwon et al., SOSP 2023, arXiv 2309.06180, §3):

    used                     real tokens (prompt + generated so far): K/V that exist
    future                   reserved for tokens the request has not generated yet
    internal fragmentation   reserved beyond the request's true final length, never filled

and, where requests wait, the free slots stranded in holes too small for the next one (external
fragmentation). From these come the shares (`token_share`, `future_share`,
`internal_fragmentation`, `external_fragmentation`, `token_share_of_capacity`), the batch sizes,
the throughput, `summary()` (the headline numbers) and `memory_map(i)` (snapshot i, unit by
unit: who owns it, how full it is). Pure Python: no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lib._checks import require_int
from lib.workload import Request

__all__ = ["SimResult"]


@dataclass(repr=False)
class SimResult:
    """What `simulate_serving` measured. Per-step lists are indexed by step 0..makespan-1 and
    measured after the step's decode and admissions, before finished requests release memory.

    For each running request with reserved slots R, real tokens U (prompt + generated so far) and
    true final length F = prompt_len + output_len, the R slots split into
        U                  real tokens (K/V that exist)
        min(R, F) - U      reserved for future tokens: will be filled by this request later
        R - min(R, F)      internal fragmentation: will never be filled (R beyond F)
    Contiguous reservation with max_len has all three; paged has no internal fragmentation
    except in the last block of a request's final steps, and reserves at most b - 1 future slots.
    External fragmentation (`stranded_tokens`): at a step where requests wait, the free slots
    lying in holes smaller than the reservation the first waiting request needs; 0 when nobody
    waits, and always 0 for paged (any free block can serve any request).
    """

    policy: str
    capacity_tokens: int
    max_len: int
    block_size: int | None  # paged only
    reserve: str | None  # contiguous only
    requests: tuple[Request, ...]
    used_tokens: list[int] = field(default_factory=list)
    reserved_tokens: list[int] = field(default_factory=list)
    future_tokens: list[int] = field(default_factory=list)
    stranded_tokens: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    finished_steps: dict[int, int] = field(default_factory=dict)  # rid -> step it finished
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens prefilled again when preempted requests were readmitted
    snapshots: list[tuple[int, tuple]] = field(default_factory=list)  # (step, layout), evenly spaced

    @property
    def makespan(self) -> int:
        """Steps from step 0 until the last request finished."""
        return len(self.used_tokens)

    @property
    def unit(self) -> int:
        """Tokens per memory unit of the snapshots: 1 (token slots) or the block size."""
        return self.block_size if self.policy == "paged" else 1

    @property
    def num_units(self) -> int:
        return self.capacity_tokens // self.unit

    def token_share(self) -> float:
        """Σ used / Σ reserved over all steps: the share of reserved slots holding real tokens."""
        return sum(self.used_tokens) / sum(self.reserved_tokens)

    def waste_share(self) -> float:
        """1 - token_share(): reserved for future tokens + internal fragmentation."""
        return 1.0 - self.token_share()

    def future_share(self) -> float:
        """Σ reserved-for-future-tokens / Σ reserved."""
        return sum(self.future_tokens) / sum(self.reserved_tokens)

    def internal_fragmentation(self) -> float:
        """Σ (reserved slots beyond each request's true final length) / Σ reserved."""
        reserved = sum(self.reserved_tokens)
        return (reserved - sum(self.used_tokens) - sum(self.future_tokens)) / reserved

    def external_fragmentation(self) -> float:
        """Σ stranded free slots / Σ capacity, over the steps where some request was waiting
        (0.0 if none ever waited)."""
        steps = sum(1 for w in self.waiting if w)
        return sum(self.stranded_tokens) / (steps * self.capacity_tokens) if steps else 0.0

    def token_share_of_capacity(self) -> float:
        """Σ used / (capacity × makespan): the share of the whole KV pool holding real tokens."""
        return sum(self.used_tokens) / (self.capacity_tokens * self.makespan)

    def mean_running(self) -> float:
        """Requests in the batch, averaged over all steps."""
        return sum(self.running) / self.makespan

    def max_running(self) -> int:
        return max(self.running)

    def throughput(self) -> float:
        """Output tokens of all requests per step (recomputation after preemption not counted)."""
        return sum(r.output_len for r in self.requests) / self.makespan

    def memory_map(self, index: int) -> dict:
        """Snapshot `index` as per-unit lists: `owner` (rid, or -1 when free) and `filled` (real
        tokens in the unit: 0/1 for token slots, 0..b for blocks); also `step` and `unit`."""
        require_int("index", index, minimum=0)
        if index >= len(self.snapshots):
            raise ValueError(f"index must be < {len(self.snapshots)} (the number of snapshots), got {index}")
        step, layout = self.snapshots[index]
        owner, filled = [-1] * self.num_units, [0] * self.num_units
        if self.policy == "contiguous":
            for rid, start, size, used in layout:
                owner[start : start + size] = [rid] * size
                filled[start : start + used] = [1] * used
        else:
            b = self.block_size
            for rid, blocks, used in layout:
                for block in blocks:
                    owner[block], filled[block] = rid, b
                filled[blocks[-1]] = used - (len(blocks) - 1) * b  # only the last block may have slack
        return {"step": step, "unit": self.unit, "owner": owner, "filled": filled}

    def label(self) -> str:
        if self.policy == "paged":
            return f"paged, {self.block_size}-token blocks"
        return f"contiguous, reserve {self.reserve}" + (f"={self.max_len}" if self.reserve == "max_len" else "")

    def summary(self) -> dict:
        """The headline numbers, rounded (shares to 4 decimals, means to 2)."""
        return {
            "policy": self.policy,
            "block_size": self.block_size,
            "reserve": self.reserve,
            "capacity_tokens": self.capacity_tokens,
            "max_len": self.max_len,
            "token_share": round(self.token_share(), 4),
            "future_share": round(self.future_share(), 4),
            "internal_fragmentation": round(self.internal_fragmentation(), 4),
            "external_fragmentation": round(self.external_fragmentation(), 4),
            "token_share_of_capacity": round(self.token_share_of_capacity(), 4),
            "mean_running": round(self.mean_running(), 2),
            "max_running": self.max_running(),
            "preemptions": self.preemptions,
            "makespan": self.makespan,
            "throughput": round(self.throughput(), 2),
        }

    def __repr__(self) -> str:
        return (
            f"SimResult({self.label()}, {len(self.requests)} requests, capacity {self.capacity_tokens} tokens, "
            f"makespan {self.makespan} steps, token share {self.token_share():.1%})"
        )
