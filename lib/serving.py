"""A serving simulator: a server's KV memory step by step, contiguous or paged.

Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP 2023 (arXiv 2309.06180). A server that stores each request's KV cache as one contiguous
range must reserve that range when the request is admitted, before it knows how long the output
will be. §3 of the paper names three ways this wastes KV memory:

    reserved slots           slots kept for tokens the request has not generated yet (they will
                             be filled, but hold nothing useful meanwhile)
    internal fragmentation   slots beyond the request's true final length: over-provisioning to
                             the maximum length, never filled
    external fragmentation   free memory between allocations, in holes too small for the next
                             request

Paging (`lib.paging`: blocks of b tokens anywhere in a pool, a block table per sequence) leaves
only the unfilled tail of each request's last block. The simulator runs one server loop (arrive,
decode, admit, measure, finish) over a memory policy:

    Contiguous                    one range per request, reserved at admission (first fit), never grown
    Paged                         blocks taken one at a time, the newest request preempted when none is free
    simulate_serving              the loop; what it measured is a `SimResult` (lib.serving_result)
    sweep_block_sizes             the paged simulation over several block sizes

The requests come from `lib.workload` (or any list of `lib.workload.Request`). Pure Python: no
tensors, no model; one slot holds one token's K/V for every layer.
"""

from __future__ import annotations

from collections import deque

from lib._checks import require_int, require_real
from lib.paging import BlockAllocator
from lib.serving_result import SimResult
from lib.workload import Request

__all__ = ["POLICIES", "RESERVE_RULES", "Contiguous", "Paged", "simulate_serving", "sweep_block_sizes"]

POLICIES = ("contiguous", "paged")
RESERVE_RULES = ("max_len", "pow2", "oracle")


# --------------------------------------------------------------------------- simulator
class _Live:
    """A request inside the server: progress and where its memory is."""

    __slots__ = ("req", "generated", "start", "size", "blocks")

    def __init__(self, req: Request):
        self.req, self.generated, self.start, self.size, self.blocks = req, 0, 0, 0, []


def _reservation(req: Request, reserve: str, max_len: int) -> int:
    """Contiguous slots reserved at admission (the three Orca baselines of the paper's §6.1)."""
    if reserve == "max_len":
        return max_len
    if reserve == "pow2":  # output over-reserved by at most 2x: the next power of two
        return min(max_len, req.prompt_len + (1 << (req.output_len - 1).bit_length()))
    return req.prompt_len + req.output_len  # "oracle": knows the output length


def _check_sim_args(requests, policy, capacity_tokens, max_len, block_size, reserve, max_snapshots, max_steps):
    if not isinstance(requests, (list, tuple)) or not requests:
        raise TypeError(f"requests must be a non-empty list of Request, got {type(requests).__name__}")
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"requests[{i}] must be a Request, got {type(r).__name__}")
    if len({r.rid for r in requests}) != len(requests):
        raise ValueError("requests must have distinct rids")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if reserve not in RESERVE_RULES:
        raise ValueError(f"reserve must be one of {RESERVE_RULES}, got {reserve!r}")
    require_int("capacity_tokens", capacity_tokens, minimum=1)
    require_int("max_len", max_len, minimum=2)
    require_int("block_size", block_size, minimum=1)
    require_int("max_snapshots", max_snapshots, minimum=1)
    require_int("max_steps", max_steps, minimum=1)
    longest = max(requests, key=lambda r: r.prompt_len + r.output_len)
    if longest.prompt_len + longest.output_len > max_len:
        raise ValueError(
            f"request {longest.rid} has prompt_len + output_len = {longest.prompt_len + longest.output_len}"
            f" > max_len={max_len}"
        )
    if policy == "contiguous":
        need = max(_reservation(r, reserve, max_len) for r in requests)
        if need > capacity_tokens:
            raise ValueError(
                f"capacity_tokens={capacity_tokens} is smaller than one request's reservation ({need} "
                f"slots under reserve={reserve!r}): that request could never run"
            )
    else:
        blocks = capacity_tokens // block_size
        need = -(-(longest.prompt_len + longest.output_len) // block_size)
        if need > blocks:
            raise ValueError(
                f"capacity_tokens={capacity_tokens} holds {blocks} blocks of {block_size}, but request "
                f"{longest.rid} needs {need}: it could never run"
            )


# --------------------------------------------------------------------------- memory policies
# A policy is where the server keeps K/V. One interface, which the loop in simulate_serving calls:
#   decode(running, waiting, res)  every running request generates one token (may preempt)
#   admit(r, running) -> bool      find memory for a waiting request's prefill, or refuse
#   reserved(r), layout(r)         its slots now, and where they are (for the memory map)
#   stranded(waiting)              free slots nobody waiting can use (external fragmentation)
#   release(r)                     a finished request's memory goes back
class Contiguous:
    """Each request reserves one contiguous range of slots when admitted, in a line of
    `capacity_tokens`, placed first-fit (lowest free address); its size follows `reserve`. A
    reservation never grows, so nothing is ever preempted."""

    def __init__(self, capacity_tokens: int, max_len: int, reserve: str):
        self.capacity, self.max_len, self.reserve = capacity_tokens, max_len, reserve
        self.ranges: list[tuple[int, int, int]] = []  # (start, end, rid), sorted by start

    def decode(self, running: list, waiting: deque, res: SimResult) -> None:
        """Every running request generates one token: its range already holds the slot."""
        for r in running:
            r.generated += 1

    def admit(self, r: _Live, running: list) -> bool:
        size = _reservation(r.req, self.reserve, self.max_len)
        start, at = _first_fit(self.ranges, size, self.capacity)
        if start is None:
            return False
        self.ranges.insert(at, (start, start + size, r.req.rid))
        r.start, r.size = start, size
        return True

    def reserved(self, r: _Live) -> int:
        return r.size

    def stranded(self, waiting: deque) -> int:
        """Free slots in holes too small for the first waiting request's reservation."""
        if not waiting:
            return 0
        need = _reservation(waiting[0].req, self.reserve, self.max_len)
        return sum(h for h in _holes(self.ranges, self.capacity) if h < need)

    def layout(self, r: _Live) -> tuple:
        return r.req.rid, r.start, r.size, r.req.prompt_len + r.generated

    def release(self, r: _Live) -> None:
        self.ranges = [x for x in self.ranges if x[2] != r.req.rid]


class Paged:
    """capacity_tokens // block_size blocks, any block for any request (lowest free id first). A
    running request takes one more block when its new token starts one; if none is free, the most
    recently admitted running request is preempted (possibly the one asking): its blocks are freed
    and it goes to the front of the waiting queue, to be recomputed on readmission. Admission
    leaves `watermark` of the blocks free while anything runs."""

    def __init__(self, capacity_tokens: int, block_size: int, watermark: float):
        self.b = block_size
        self.allocator = BlockAllocator(capacity_tokens // block_size)
        self.keep_free = int(watermark * (capacity_tokens // block_size))  # blocks admission leaves free

    def decode(self, running: list, waiting: deque, res: SimResult) -> None:
        """Every running request generates one token, oldest admission first, taking a block when
        the token opens one; `running` and `waiting` change in place when a request is preempted."""
        i = 0
        while i < len(running):
            r = running[i]
            if r.req.prompt_len + r.generated + 1 > len(r.blocks) * self.b:  # the new token opens a block
                victim = None
                while self.allocator.num_free == 0 and victim is not r:
                    victim = running.pop()
                    self.allocator.free_many(victim.blocks)
                    victim.blocks = []
                    waiting.appendleft(victim)  # older victims end up ahead of newer ones
                    res.preemptions += 1
                if victim is r:
                    break  # r preempted itself: it was the last running request
                r.blocks.append(self.allocator.allocate())
            r.generated += 1
            i += 1

    def admit(self, r: _Live, running: list) -> bool:
        need = -(-(r.req.prompt_len + r.generated + 1) // self.b)
        if need > self.allocator.num_free or (running and need + self.keep_free > self.allocator.num_free):
            return False
        r.blocks = [self.allocator.allocate() for _ in range(need)]
        return True

    def reserved(self, r: _Live) -> int:
        return len(r.blocks) * self.b

    def stranded(self, waiting: deque) -> int:
        return 0  # any free block can serve any request

    def layout(self, r: _Live) -> tuple:
        return r.req.rid, tuple(r.blocks), r.req.prompt_len + r.generated

    def release(self, r: _Live) -> None:
        self.allocator.free_many(r.blocks)


def simulate_serving(
    requests,
    *,
    policy: str,
    capacity_tokens: int,
    max_len: int = 1024,
    block_size: int = 16,
    reserve: str = "max_len",
    watermark: float = 0.0,
    max_snapshots: int = 60,
    max_steps: int = 1_000_000,
) -> SimResult:
    """Serve `requests` step by step with `capacity_tokens` KV slots; measure the memory.

    The model of a server (one slot holds one token's K/V for every layer; all slots equal):
    - Step t: (1) requests with arrival <= t join the back of the waiting queue; (2) decode: every
      running request admitted before step t generates one token, oldest admission first;
      (3) admission: the head of the queue is admitted while its memory fits, strictly first come
      first served (no skipping ahead); admission prefills the prompt (plus any tokens generated
      before a preemption: recomputation) and yields one new token in the same step;
      (4) measure; (5) requests that have generated output_len tokens finish and free memory.
    - A request holds prompt_len + generated slots of real tokens (the newest token's slot counts
      from the step it is sampled). Compute time is not modelled: every step costs the same
      whatever the batch size; there is no batch-size cap, only the memory limit.
    - policy="contiguous" (`Contiguous`): at admission the request reserves one contiguous range of slots in a
      line of capacity_tokens, placed first-fit (lowest free address). Its size under
      `reserve`: "max_len" (the model's maximum length, Orca (Max) in the paper's §6.1), "pow2"
      (prompt + the output length rounded up to a power of two, capped at max_len: Orca (Pow2)),
      "oracle" (prompt + the true output length: Orca (Oracle)). A reservation never grows, so
      nothing is ever preempted.
    - policy="paged" (`Paged`): capacity_tokens // block_size blocks, any block for any request (lowest
      free id first). Admission needs ceil((prompt + generated + 1) / b) free blocks; a running
      request takes one more block when its new token starts one. If none is free, the most
      recently admitted running request is preempted (possibly the one asking): its blocks are
      freed and it goes to the front of the waiting queue, to be recomputed on readmission
      (vLLM's recompute preemption, §4.5). `watermark` > 0 makes admission leave that fraction
      of the blocks free while anything runs (vLLM's scheduler keeps int(0.01 * blocks) by
      default), trading a little concurrency for fewer preemptions; the default 0 here admits
      whenever the blocks fit.
    `block_size` and `watermark` are ignored for contiguous, `reserve` for paged. Snapshots of the
    memory layout are taken every k-th step, k doubling as needed to keep at most `max_snapshots`.
    Raises ValueError if some request could never fit, RuntimeError past `max_steps` steps.
    """
    _check_sim_args(requests, policy, capacity_tokens, max_len, block_size, reserve, max_snapshots, max_steps)
    watermark = require_real("watermark", watermark, at_least=0)
    if watermark >= 1.0:
        raise ValueError(f"watermark must be a fraction of the blocks in [0, 1), got {watermark}")
    paged = policy == "paged"
    memory = Paged(capacity_tokens, block_size, watermark) if paged else Contiguous(capacity_tokens, max_len, reserve)
    res = SimResult(
        policy=policy,
        capacity_tokens=capacity_tokens,
        max_len=max_len,
        block_size=block_size if paged else None,
        reserve=None if paged else reserve,
        requests=tuple(requests),
    )
    arrivals = deque(sorted(requests, key=lambda r: r.arrival))  # stable: ties keep the given order
    waiting: deque[_Live] = deque()
    running: list[_Live] = []  # admission order: the last one is the preemption victim
    stride, n_done, t = 1, 0, 0

    while n_done < len(requests):
        if t >= max_steps:
            raise RuntimeError(
                f"simulation passed max_steps={max_steps} with {len(requests) - n_done} requests "
                f"unfinished; raise max_steps"
            )
        while arrivals and arrivals[0].arrival <= t:  # (1) arrivals
            waiting.append(_Live(arrivals.popleft()))

        memory.decode(running, waiting, res)  # (2) decode

        while waiting:  # (3) admission, first come first served
            r = waiting[0]
            held = r.req.prompt_len + r.generated  # tokens to prefill (recompute after preemption)
            if not memory.admit(r, running):
                break
            if r.generated:  # readmitted after a preemption: its prompt and output are prefilled again
                res.recomputed_tokens += held
            waiting.popleft()
            r.generated += 1
            running.append(r)

        used = reserved = future = 0  # (4) measure
        for r in running:
            u = r.req.prompt_len + r.generated
            size = memory.reserved(r)
            used, reserved = used + u, reserved + size
            future += min(size, r.req.prompt_len + r.req.output_len) - u
        res.used_tokens.append(used)
        res.reserved_tokens.append(reserved)
        res.future_tokens.append(future)
        res.stranded_tokens.append(memory.stranded(waiting))
        res.running.append(len(running))
        res.waiting.append(len(waiting))
        if t % stride == 0:
            res.snapshots.append((t, tuple(memory.layout(r) for r in running)))
            if len(res.snapshots) > max_snapshots:
                stride *= 2
                res.snapshots = [s for s in res.snapshots if s[0] % stride == 0]

        done = [r for r in running if r.generated >= r.req.output_len]  # (5) finish
        if done:
            running = [r for r in running if r.generated < r.req.output_len]
            for r in done:
                res.finished_steps[r.req.rid] = t
                memory.release(r)
            n_done += len(done)
        t += 1
    return res


def _first_fit(ranges, size: int, capacity: int) -> tuple[int | None, int]:
    """Lowest start where `size` slots are free, and the index to insert the range at."""
    prev_end = 0
    for i, (start, end, _) in enumerate(ranges):
        if start - prev_end >= size:
            return prev_end, i
        prev_end = end
    return (prev_end, len(ranges)) if capacity - prev_end >= size else (None, len(ranges))


def _holes(ranges, capacity: int) -> list[int]:
    """Sizes of the free gaps between contiguous ranges, the tail included."""
    holes, prev_end = [], 0
    for start, end, _ in ranges:
        holes.append(start - prev_end)
        prev_end = end
    holes.append(capacity - prev_end)
    return [h for h in holes if h > 0]


def sweep_block_sizes(
    requests,
    *,
    capacity_tokens: int,
    max_len: int = 1024,
    block_sizes=(1, 2, 4, 8, 16, 32, 64),
    max_snapshots: int = 1,
    watermark: float = 0.0,
) -> list[dict]:
    """`simulate_serving(policy="paged")` once per block size; one `summary()` dict each."""
    if not isinstance(block_sizes, (list, tuple)) or not block_sizes:
        raise TypeError(f"block_sizes must be a non-empty list of ints, got {block_sizes!r}")
    return [
        simulate_serving(
            requests,
            policy="paged",
            capacity_tokens=capacity_tokens,
            max_len=max_len,
            block_size=b,
            max_snapshots=max_snapshots,
            watermark=watermark,
        ).summary()
        for b in block_sizes
    ]
