"""Where attention's T² products overtake the rest of a block, found from the FLOP counter: the
closed form 6·C for a GPT block (lesson 08 once said 12·C, which is where they reach twice it), and a
brute-force scan of the counter."""

import pytest
import torch
from compare_builders import TINY

from lib.course.compare import attention_crossover, attention_flop_split, build_models
from lib.gpt import GPT, GPTConfig
from lib.moe_lm import moe_gpt

C = 8


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=12, block_size=256, n_layer=2, n_head=2, n_embd=C, positions="rope", **kw))


def _scan(model, ratio, T_max):
    """The first T whose counted split puts attention at `ratio` times the rest or more."""
    for T in range(1, T_max + 1):
        attention, rest = attention_flop_split(model, T)
        if attention >= ratio * rest:
            return T
    raise AssertionError("no crossover below T_max")


def test_the_crossover_of_a_gpt_block_is_6c_and_twice_the_rest_at_12c():
    gpt = _gpt()
    assert attention_crossover(gpt) == 6 * C  # 4T²C = 24TC²: Q, K, V, O (8TC²) and the 4C MLP (16TC²)
    assert attention_crossover(gpt) != 12 * C  # the old claim: 12·C is where attention is twice the rest
    assert attention_crossover(gpt, ratio=2) == 12 * C
    attention, rest = attention_flop_split(gpt, 6 * C)
    assert attention == rest == 2 * 24 * 6 * C * C * C  # two blocks


@pytest.mark.parametrize("ratio", [1, 2, 0.5])
def test_the_crossover_is_the_first_length_a_scan_of_the_counter_finds(ratio):
    torch.manual_seed(0)
    moe = moe_gpt(
        GPTConfig(vocab_size=12, block_size=256, n_layer=1, n_head=2, n_embd=C, positions="rope"),
        num_experts=4,
        top_k=2,
        d_ff=2 * C,
    )
    for model in (_gpt(), moe):
        found = attention_crossover(model, ratio)
        assert found == _scan(model, ratio, found)  # none earlier, and this one


def test_the_hybrid_split_counts_its_attention_block_only():
    hybrid = build_models(TINY, 12)["Hybrid"]
    width = hybrid.config.n_embd
    attention, rest = attention_flop_split(hybrid, 8)
    assert attention == 4 * 8 * 8 * width  # one attention block of "MMA"
    assert rest == 24 * 8 * width * width
    with pytest.raises(ValueError, match="no attention block"):
        attention_flop_split(build_models(TINY, 12)["Mamba"], 8)
