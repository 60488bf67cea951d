"""Decoding asks the host nothing per token: no value scans (Tensor.__bool__, item, tolist) inside
the loop, outside debug mode. On a GPU each would stall the queue (a host synchronisation) and
break CUDA graphs and torch.compile; here they are counted on the CPU, where the same calls run."""

import collections
import os
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

import lib
from lib.decode import generate
from lib.gpt import GPT, GPTConfig
from lib.hybrid import HybridGPT
from lib.mamba import MambaConfig
from lib.mamba_lm import MambaLM
from lib.moe_lm import moe_gpt

SYNCS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")


class CountSyncs(TorchFunctionMode):
    """Counts the tensor calls that hand a value to Python (each is a host sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def syncs_per_token(run) -> dict[str, float]:
    """Host syncs per generated token: the difference between 8 and 3 new tokens, over 5 tokens
    (what the prompt and the call's door cost is the same in both and cancels). A first call warms
    up what runs once per process (the C loops' build and self-check)."""
    run(1)
    counts = []
    for n in (3, 8):
        with CountSyncs() as counter:
            run(n)
        counts.append(counter.calls)
    return {name: (counts[1][name] - counts[0][name]) / 5 for name in SYNCS if counts[1][name] != counts[0][name]}


@pytest.fixture(autouse=True)
def debug_off():
    before = lib.debug()
    lib.debug(False)
    yield
    lib.debug(before)


V = 32
IDX = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny(vocab_size=V))


def _sampled(model, **knobs):
    return lambda n: generate(model, IDX, n, generator=torch.Generator().manual_seed(1), **knobs)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(),
        dict(top_k=5, top_p=0.9, temperature=0.7),
        dict(temperature=0, attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])),
        dict(use_cache=False, top_p=0.8),
    ],
    ids=["cached", "top-k and top-p", "left-padded greedy", "no cache"],
)
def test_gpt_decoding_asks_the_host_nothing_per_token(knobs):
    assert syncs_per_token(_sampled(_gpt(), **knobs)) == {}


def test_mamba_and_hybrid_decoding_ask_the_host_nothing_per_token():
    torch.manual_seed(0)
    mamba = MambaLM(MambaConfig.tiny(vocab_size=V))
    assert syncs_per_token(_sampled(mamba, top_k=5)) == {}
    hybrid = HybridGPT(GPTConfig.tiny(vocab_size=V), "MAMA", MambaConfig.tiny(vocab_size=V))
    assert syncs_per_token(_sampled(hybrid)) == {}


def test_moe_decoding_syncs_only_for_its_dispatch():
    # The grouped dispatch splits the tokens into one segment per expert, and a split needs the
    # sizes on the host: one `tolist` per MoE layer per token, which a fixed-capacity (padded)
    # dispatch would avoid. No check adds to it.
    torch.manual_seed(0)
    config = GPTConfig.tiny(vocab_size=V)
    model = moe_gpt(config, num_experts=4, top_k=2)
    assert syncs_per_token(_sampled(model)) == {"tolist": config.n_layer}


def test_debug_mode_scans_values_inside_the_loop_and_catches_what_they_are_for():
    model = _gpt()
    lib.debug(True)
    assert syncs_per_token(_sampled(model)).get("__bool__", 0) > 0  # the counter sees the scans

    def poison(step, tokens):  # from the second token on, the model's logits are NaN
        if step == 0:
            with torch.no_grad():
                model.lm_head.weight.fill_(float("nan"))

    with pytest.raises(ValueError, match=r"must hold finite values or -inf \(no NaN, no \+inf\)"):
        generate(model, IDX, 4, on_token=poison, generator=torch.Generator().manual_seed(1))


def test_the_door_still_scans_values_outside_debug_mode():
    with pytest.raises(ValueError, match=r"must lie in \[0, vocab_size=32\)"):
        generate(_gpt(), torch.full((1, 3), V), 2)
    with pytest.raises(ValueError, match="left-padded"):
        generate(_gpt(), IDX, 2, attention_mask=torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]]))


def test_debug_is_a_switch_and_the_environment_sets_it():
    assert lib.debug() is False
    assert lib.debug(True) is True and lib.debug() is True
    assert lib.debug(False) is False
    with pytest.raises(TypeError, match="on must be a bool"):
        lib.debug("yes")
    env = dict(os.environ, ONEMASK_DEBUG="1")
    run = subprocess.run(
        [sys.executable, "-c", "import lib; print(lib.debug())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr


def test_code_called_back_from_the_loop_is_checked_like_any_caller():
    """The loop trusts only the values it checked at its door: an `on_token` callback is the
    caller's code, and a lib function it calls scans its arguments as it would anywhere else."""
    from lib.sampling import sample_next_token

    def careless(step, tokens):
        sample_next_token(torch.tensor([[float("nan"), 0.0]]))

    with pytest.raises(ValueError, match=r"must hold finite values or -inf \(no NaN, no \+inf\)"):
        generate(_gpt(), IDX, 2, on_token=careless)
