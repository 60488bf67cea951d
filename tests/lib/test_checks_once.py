"""Checks once, at the door: a decoded token runs no check helper, only one `checking()` guard per
door it passes (the model, each layer's cache and attention, the sampler and its filter), and the
tokens are the same with every check on (`lib.debug(True)`), which runs them inside the loop."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import tiny_models
import torch

import lib
import lib._checks as checks
import lib._door
from lib.attention import attention
from lib.decode import generate
from lib.encdec import EncDecConfig, EncoderDecoder, greedy_decode
from lib.kv_cache import KVCache

LIB = str(Path(lib.__file__).resolve().parent)
CHECKS = str(Path(checks.__file__).resolve())
DOOR = str(Path(lib._door.__file__).resolve())


def calls_per_token(model, prompt, new_tokens: int = 6, decode=None, **knobs) -> Counter:
    """The lib functions called for each decoded token: a run of `new_tokens` minus a run of 1 (the
    prefill and its first token), divided by the difference. `decode(n)` runs n tokens (default:
    `generate` on model and prompt)."""

    def run(n):
        counted = Counter()

        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(LIB):
                counted[(frame.f_code.co_filename, frame.f_code.co_name)] += 1

        sys.setprofile(profile)
        try:
            if decode is not None:
                decode(n)
            else:
                generate(model, prompt, max_new_tokens=n, generator=torch.Generator().manual_seed(0), **knobs)
        finally:
            sys.setprofile(None)
        return counted

    one, many = run(1), run(new_tokens)
    return Counter({key: (many[key] - one[key]) / (new_tokens - 1) for key in many if many[key] != one[key]})


def helpers(per_token: Counter) -> dict:
    """Check helpers per token: the functions of lib._checks and lib._door and every _check_* of any
    module; not `checking` (the guard) nor `_door` (a declared door, which only asks `checking` when
    trusted)."""
    return {
        name: n
        for (file, name), n in per_token.items()
        if (file in (CHECKS, DOOR) or name.startswith("_check") or name.startswith("require_"))
        and name not in ("checking", "_door")
    }


def models():
    return {
        "gpt": tiny_models.gpt(vocab_size=50, n_embd=32),
        "llama": tiny_models.llama(vocab_size=50, n_layer=4),
        "mamba": tiny_models.mamba(vocab_size=50),
    }


# The raw C kernels' own device guard, one per kernel call (the convolution, RMSNorm, ...): it stands
# between a CUDA tensor's pointer and a segfault, so it is not skipped in trusted loops.
KERNEL_GUARDS = {"require_cpu"}


@pytest.mark.parametrize("name", ["gpt", "llama", "mamba"])
@pytest.mark.parametrize("knobs", [{"temperature": 0.0}, {"temperature": 0.8, "top_k": 5, "top_p": 0.9}])
def test_a_decoded_token_runs_no_check_only_one_guard_per_door(name, knobs):
    model = models()[name]
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    per_token = calls_per_token(model, prompt, **knobs)
    assert {k: v for k, v in helpers(per_token).items() if k not in KERNEL_GUARDS} == {}
    # the model; each layer's cache and attention (and Llama's RoPE: apply_rope and its rotation, for
    # q and for k; Mamba: each layer's state); the sampler
    per_layer = {"gpt": 2, "llama": 6, "mamba": 1}[name]
    doors = 1 + per_layer * model.config.n_layer + 1
    doors += 0 if knobs["temperature"] == 0 else 1 + ("top_k" in knobs) + ("top_p" in knobs)  # the filters
    assert per_token[(CHECKS, "checking")] <= doors, per_token[(CHECKS, "checking")]


def test_the_encoder_decoders_greedy_decode_runs_no_check_per_token():
    # greedy_decode checks the source at its door; its steps' decode calls run inside inputs_checked
    model = EncoderDecoder(EncDecConfig(vocab_size=40, max_position_embeddings=32)).eval()
    source = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    per_token = calls_per_token(model, source, decode=lambda n: greedy_decode(model, source, max_new_tokens=n))
    assert helpers(per_token) == {}
    doors = 1 + 3 * model.config.decoder_layers  # decode; each layer's cache, self- and cross-attention
    assert per_token[(CHECKS, "checking")] <= doors, per_token[(CHECKS, "checking")]


def test_debug_mode_checks_inside_the_loop_and_changes_no_token():
    model = models()["gpt"]
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    quiet = generate(model, prompt, max_new_tokens=6, temperature=0.9, generator=torch.Generator().manual_seed(0))
    before = checks.debug()
    try:
        checks.debug(True)
        per_token = calls_per_token(model, prompt, temperature=0.9)
        loud = generate(model, prompt, max_new_tokens=6, temperature=0.9, generator=torch.Generator().manual_seed(0))
    finally:
        checks.debug(before)
    assert helpers(per_token), "in debug mode the doors inside the loop check again"
    assert torch.equal(quiet, loud)


def test_a_layer_called_directly_is_still_checked():
    # outside lib's own loops every door checks: a student calling a layer gets the clear error
    cache = KVCache(batch_size=1, n_kv_heads=2, max_len=8, head_dim=4)
    with pytest.raises(ValueError, match="start must be <= the cache length"):
        cache.update(3, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(ValueError, match=r"k must have shape \(B, H_kv, S, D\) with D = 4 as in q"):
        attention(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5), torch.zeros(1, 2, 3, 5))
