"""KV-cache memory arithmetic: the formula counts the bytes real cache tensors hold, the published
configs are consistent, and max_batch / max_context are the largest values that fit."""

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from refusals import assert_refuses, rows

from lib.kv_cache import (
    DTYPE_BYTES,
    GB,
    GIB,
    GPU_MEMORY_GB,
    PUBLIC_CONFIGS,
    KVCache,
    ModelShape,
    bytes_per_element,
    dtype_bytes,
    estimate_params,
    format_bytes,
    gpu_memory_bytes,
    kv_cache_bytes,
    max_batch,
    max_context,
    weight_bytes,
)

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
SHAPES = [  # (n_layers, batch, seq_len, n_kv_heads, head_dim)
    (1, 1, 1, 1, 1),
    (2, 3, 17, 4, 8),
    (12, 1, 64, 12, 64),
    (4, 2, 33, 1, 96),
    (3, 5, 8, 2, 80),
]


def real_cache_bytes(n_layers, batch, seq_len, n_kv_heads, head_dim, dtype) -> int:
    """Bytes held by one lib KVCache per layer, as a decoder would build them."""
    caches = [KVCache(batch, n_kv_heads, seq_len, head_dim, dtype=dtype) for _ in range(n_layers)]
    held = sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size() for c in caches)
    assert sum(c.nbytes for c in caches) == held  # the cache's own count agrees
    return held


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_formula_equals_the_bytes_of_real_cache_tensors(shape, name):
    expected = real_cache_bytes(*shape, TORCH_DTYPES[name])
    assert kv_cache_bytes(*shape, bytes_per_element(name)) == expected
    assert kv_cache_bytes(*shape, DTYPE_BYTES[name]) == expected


def test_dtype_bytes_takes_a_torch_dtype_or_a_name():
    for name, dtype in TORCH_DTYPES.items():
        assert dtype_bytes(dtype) == dtype_bytes(name) == bytes_per_element(name)
    assert dtype_bytes("int4") == 0.5
    with pytest.raises(TypeError, match="dtype must be a torch.dtype or a name"):
        dtype_bytes(2)
    with pytest.raises(ValueError, match="must be one of"):
        dtype_bytes("fp12")


def test_dtype_table_matches_torch_element_sizes():
    for name, dtype in TORCH_DTYPES.items():
        assert bytes_per_element(name) == torch.empty(0, dtype=dtype).element_size()
    assert bytes_per_element("int4") == 0.5 and set(DTYPE_BYTES) == {*TORCH_DTYPES, "int4"}


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_equals_two_values_packed_per_byte(shape):
    """int4 storage: a uint8 tensor holding two 4-bit values per byte."""
    n_layers, batch, seq_len, n_kv_heads, head_dim = shape
    n_values = 2 * n_layers * batch * seq_len * n_kv_heads * head_dim
    packed = torch.empty(math.ceil(n_values / 2), dtype=torch.uint8)
    assert kv_cache_bytes(*shape, 0.5) == packed.numel() * packed.element_size()


def test_bytes_are_rounded_up_to_whole_bytes():
    assert weight_bytes(3, 0.5) == 2  # three int4 values need two bytes
    assert weight_bytes(4, 0.5) == 2
    assert kv_cache_bytes(1, 1, 1, 1, 1, 0.375) == 1  # 2 values at 3 bits = 6 bits -> one byte
    assert kv_cache_bytes(1, 1, 1, 1, 3, 0.375) == 3  # 6 values × 3 bits = 18 bits -> 3 bytes
    assert weight_bytes(10**18 + 1, 0.5) == 5 * 10**17 + 1  # exact beyond float precision


def test_llama2_7b_example_is_exactly_32_gib():
    """32 layers, batch 16, 4096 tokens, 32 KV heads of 128, fp16."""
    n = kv_cache_bytes(32, 16, 4096, 32, 128, 2)
    assert n == 34_359_738_368 == 32 * GIB
    assert PUBLIC_CONFIGS["Llama-2-7B"].cache_bytes(16, 4096) == n
    assert format_bytes(n) == "34.4 GB (32.0 GiB)"
    assert format_bytes(n, binary=False) == "34.4 GB"


def test_opt_13b_needs_800_kib_per_token():
    """vLLM (Kwon et al. 2023) §3: 2 × 5120 × 40 layers × 2 bytes, "800 KB" per token."""
    per_token = kv_cache_bytes(40, 1, 1, 40, 128, 2)
    assert per_token == 819_200 == 800 * 1024 == 2 * 5120 * 40 * 2
    opt = PUBLIC_CONFIGS["OPT-13B"]
    assert opt.cache_bytes(1, 1) == per_token
    assert 1.6e9 < opt.cache_bytes(1, 2048) < 1.7e9  # "about 1.6 GB per 2048-token request"


def test_grouped_and_multi_query_attention_shrink_the_cache_by_the_group_size():
    for name in ("Mistral-7B-v0.1", "Llama-2-70B", "Llama-3-8B", "Falcon-7B"):
        shape = PUBLIC_CONFIGS[name]
        as_mha = replace(shape, n_kv_heads=shape.n_heads)
        ratio = shape.n_heads // shape.n_kv_heads
        assert as_mha.cache_bytes(4, 1000) == ratio * shape.cache_bytes(4, 1000)
    mistral = PUBLIC_CONFIGS["Mistral-7B-v0.1"]
    assert replace(mistral, n_kv_heads=32).cache_bytes(1, 4096) == 4 * mistral.cache_bytes(1, 4096)
    assert kv_cache_bytes(32, 1, 4096, 32, 128) == 4 * kv_cache_bytes(32, 1, 4096, 8, 128)


def test_cache_grows_linearly_in_every_size():
    base = (3, 2, 5, 4, 8)
    for i in range(5):
        doubled = list(base)
        doubled[i] *= 2
        assert kv_cache_bytes(*doubled) == 2 * kv_cache_bytes(*base)


def test_public_configs_are_consistent():
    kinds = {
        "GPT-2": "MHA",
        "OPT-13B": "MHA",
        "Llama-2-7B": "MHA",
        "Llama-2-70B": "GQA",
        "Mistral-7B-v0.1": "GQA",
        "Llama-3-8B": "GQA",
        "Falcon-7B": "MQA",
    }
    assert {name: s.attention for name, s in PUBLIC_CONFIGS.items()} == kinds
    for name, s in PUBLIC_CONFIGS.items():
        assert s.name == name
        assert s.n_heads * s.head_dim == s.d_model  # true of every config listed here
        assert s.n_heads % s.n_kv_heads == 0
        assert "config.json" in s.source
    assert PUBLIC_CONFIGS["Llama-2-7B"].weight_bytes() == 2 * 6_738_415_616
    assert PUBLIC_CONFIGS["Llama-2-7B"].weight_bytes(0.5) == 6_738_415_616 // 2


def test_public_param_counts_equal_the_transformers_architectures():
    """Each n_params is what transformers builds from that config (on the meta device: no
    weights, no download); tied embeddings counted once."""
    from transformers import AutoModelForCausalLM, FalconConfig, GPT2Config, LlamaConfig, MistralConfig, OPTConfig

    configs = {
        "GPT-2": GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024),
        "OPT-13B": OPTConfig(
            hidden_size=5120,
            num_hidden_layers=40,
            num_attention_heads=40,
            ffn_dim=20480,
            vocab_size=50272,
            max_position_embeddings=2048,
            word_embed_proj_dim=5120,
        ),
        "Llama-2-7B": LlamaConfig(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
        ),
        "Llama-2-70B": LlamaConfig(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=32000,
        ),
        "Mistral-7B-v0.1": MistralConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
        ),
        "Llama-3-8B": LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
        "Falcon-7B": FalconConfig(
            hidden_size=4544,
            num_hidden_layers=32,
            num_attention_heads=71,
            multi_query=True,
            vocab_size=65024,
            parallel_attn=True,
            bias=False,
            new_decoder_architecture=False,
        ),
    }
    assert set(configs) == set(PUBLIC_CONFIGS)
    for name, config in configs.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == PUBLIC_CONFIGS[name].n_params, name


def test_estimate_params_is_12_L_d_squared_for_mha_and_smaller_for_gqa():
    assert estimate_params(32, 32, 32, 128) == 12 * 32 * 4096**2
    assert estimate_params(32, 32, 8, 128) == 12 * 32 * 4096**2 - 2 * 32 * 4096 * (32 - 8) * 128
    for s in PUBLIC_CONFIGS.values():  # a rough estimate, but the right size for every published model
        assert 0.6 < estimate_params(s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim) / s.n_params < 1.05


def test_memory_units_are_decimal_gb():
    assert GB == 10**9 and GIB == 2**30
    assert {name: gpu_memory_bytes(name) for name in GPU_MEMORY_GB} == {n: g * 10**9 for n, g in GPU_MEMORY_GB.items()}
    assert format_bytes(80 * GB) == "80.0 GB (74.5 GiB)"
    assert format_bytes(0) == "0 B" and format_bytes(512) == "512 B" and format_bytes(1000) == "1.0 kB (1,000 B)"
    assert format_bytes(999_960) == "1.0 MB (976.5 KiB)"  # never "1,000.0 kB"
    assert format_bytes(10**15) == "1.0 PB (909.5 TiB)"
    assert format_bytes(10**22) == "10,000.0 EB (8,673.6 EiB)"  # past the largest unit: 10²² / 2⁶⁰ = 8673.6


# --------------------------------------------------------------------------- max_batch / max_context
def small_shapes():
    return st.builds(
        lambda L, H, g, D, P: ModelShape("t", L, H * g, H, D, H * g * D, P, "test"),
        st.integers(1, 8),
        st.integers(1, 8),
        st.sampled_from([1, 2, 4]),
        st.sampled_from([8, 64, 128]),
        st.integers(1, 10**9),
    )


def used(model, batch, seq_len, bpe, w_bpe):
    return weight_bytes(model.n_params, w_bpe) + kv_cache_bytes(
        model.n_layers, batch, seq_len, model.n_kv_heads, model.head_dim, bpe
    )


BPES = st.sampled_from(sorted(set(DTYPE_BYTES.values())))


@given(model=small_shapes(), seq_len=st.integers(1, 10**5), memory=st.integers(0, 10**11), bpe=BPES, w_bpe=BPES)
def test_max_batch_is_the_largest_batch_that_fits(model, seq_len, memory, bpe, w_bpe):
    b = max_batch(model, seq_len=seq_len, memory_bytes=memory, bytes_per_elem=bpe, weight_bytes_per_elem=w_bpe)
    assert b >= 0
    if b:
        assert used(model, b, seq_len, bpe, w_bpe) <= memory
    assert used(model, b + 1, seq_len, bpe, w_bpe) > memory


@given(model=small_shapes(), batch=st.integers(1, 512), memory=st.integers(0, 10**11), bpe=BPES, w_bpe=BPES)
def test_max_context_is_the_longest_context_that_fits(model, batch, memory, bpe, w_bpe):
    s = max_context(model, batch=batch, memory_bytes=memory, bytes_per_elem=bpe, weight_bytes_per_elem=w_bpe)
    assert s >= 0
    if s:
        assert used(model, batch, s, bpe, w_bpe) <= memory
    assert used(model, batch, s + 1, bpe, w_bpe) > memory


def test_fitting_exactly_counts_and_one_byte_less_does_not():
    m = PUBLIC_CONFIGS["Llama-2-7B"]
    exact = m.weight_bytes() + m.cache_bytes(16, 4096)
    assert max_batch(m, seq_len=4096, memory_bytes=exact) == 16
    assert max_batch(m, seq_len=4096, memory_bytes=exact - 1) == 15
    assert max_context(m, batch=16, memory_bytes=exact) == 4096
    assert max_context(m, batch=16, memory_bytes=exact - 1) == 4095


def test_nothing_fits_when_the_weights_alone_exceed_memory():
    m = PUBLIC_CONFIGS["Llama-2-70B"]  # 138 GB of fp16 weights
    for gpu in ("24 GB (RTX 4090)", "80 GB (A100/H100)"):
        assert max_batch(m, seq_len=1, memory_bytes=gpu_memory_bytes(gpu)) == 0
        assert max_context(m, batch=1, memory_bytes=gpu_memory_bytes(gpu)) == 0
    assert max_batch(m, seq_len=1, memory_bytes=0) == 0
    assert max_batch(m, seq_len=1, memory_bytes=m.weight_bytes()) == 0  # weights fit, no room for one token
    assert max_batch(m, seq_len=1, memory_bytes=80 * GB, weight_bytes_per_elem=0.5) > 0  # int4 weights fit


def test_the_weights_dtype_defaults_to_the_cache_dtype():
    m = PUBLIC_CONFIGS["Mistral-7B-v0.1"]
    kw = {"seq_len": 8192, "memory_bytes": 24 * GB}
    assert max_batch(m, bytes_per_elem=1, **kw) == max_batch(m, bytes_per_elem=1, weight_bytes_per_elem=1, **kw)
    assert max_batch(m, bytes_per_elem=1, **kw) != max_batch(m, bytes_per_elem=1, weight_bytes_per_elem=2, **kw)


# --------------------------------------------------------------------------- bad input
GOOD_SIZES = {"n_layers": 2, "batch": 3, "seq_len": 4, "n_kv_heads": 2, "head_dim": 8}


@pytest.mark.parametrize("name", list(GOOD_SIZES))
@pytest.mark.parametrize(
    "bad, error",
    [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("3", TypeError), (True, TypeError), (None, TypeError)],
)
def test_kv_cache_bytes_refuses_bad_sizes_by_name(name, bad, error):
    with pytest.raises(error, match=name):
        kv_cache_bytes(**{**GOOD_SIZES, name: bad})


@pytest.mark.parametrize(
    "bad, error",
    [
        (0, ValueError),
        (-2, ValueError),
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        ("fp16", TypeError),
        (True, TypeError),
    ],
)
def test_bytes_per_elem_must_be_a_positive_number(bad, error):
    with pytest.raises(error, match="bytes_per_elem"):
        kv_cache_bytes(**GOOD_SIZES, bytes_per_elem=bad)
    with pytest.raises(error, match="bytes_per_elem"):
        weight_bytes(10, bad)
    with pytest.raises(error, match="weight_bytes_per_elem"):
        max_batch(PUBLIC_CONFIGS["GPT-2"], seq_len=1, memory_bytes=GB, weight_bytes_per_elem=bad)


def test_bad_names_and_counts_are_refused_clearly():
    with pytest.raises(ValueError, match=r"dtype_name must be one of \['fp32', 'fp16', 'bf16', 'fp8', 'int4'\]"):
        bytes_per_element("fp64")
    with pytest.raises(TypeError, match="dtype_name"):
        bytes_per_element(2)
    with pytest.raises(ValueError, match="gpu must be one of"):
        gpu_memory_bytes("8 GB")
    with pytest.raises(ValueError, match="n_params"):
        weight_bytes(0)
    with pytest.raises(TypeError, match="n_params"):
        weight_bytes(7e9)
    with pytest.raises(ValueError, match="n_bytes"):
        format_bytes(-1)


def test_max_batch_and_max_context_refuse_bad_arguments_by_name():
    m = PUBLIC_CONFIGS["GPT-2"]
    with pytest.raises(TypeError, match="model must be a ModelShape"):
        max_batch("GPT-2", seq_len=1, memory_bytes=GB)
    with pytest.raises(TypeError, match="memory_bytes"):
        max_batch(m, seq_len=1, memory_bytes=80e9)
    with pytest.raises(ValueError, match="memory_bytes"):
        max_context(m, batch=1, memory_bytes=-1)
    with pytest.raises(ValueError, match="seq_len"):
        max_batch(m, seq_len=0, memory_bytes=GB)
    with pytest.raises(ValueError, match="batch"):
        max_context(m, batch=0, memory_bytes=GB)
    with pytest.raises(TypeError):
        max_batch(m, 1, GB)  # keyword-only: which number is which must be visible at the call


@pytest.mark.parametrize(
    "field, bad, error, message",
    [
        ("n_layers", 0, ValueError, "n_layers"),
        ("head_dim", 64.0, TypeError, "head_dim"),
        ("n_kv_heads", 33, ValueError, "n_kv_heads must be <= n_heads"),
        ("n_kv_heads", 5, ValueError, "n_kv_heads must divide n_heads"),
        ("n_params", 0, ValueError, "n_params"),
        ("source", None, TypeError, "source"),
    ],
)
def test_model_shape_refuses_inconsistent_numbers(field, bad, error, message):
    with pytest.raises(error, match=message):
        replace(PUBLIC_CONFIGS["Llama-2-7B"], **{field: bad})


def test_kv_cache_module_is_unchanged_by_the_arithmetic():
    cache = KVCache(2, 4, 16, 8, dtype=torch.float16)
    k = torch.randn(2, 4, 5, 8)
    ks, vs = cache.update(0, k, 2 * k)
    assert ks.shape == (2, 4, 5, 8) and torch.equal(vs, (2 * k).half()) and cache.length == 5
    assert (cache.k.numel() + cache.v.numel()) * 2 == kv_cache_bytes(1, 2, 16, 4, 8, 2)


def test_kv_cache_update_returns_every_position_written_in_order_without_gaps():
    """Writes of 3, then 1, then 2 positions read back as their concatenation (no gap, no stale
    slot); rewriting from an earlier start overwrites and shortens; a gap is refused by name."""
    g = torch.Generator().manual_seed(0)
    cache = KVCache(2, 3, 8, 4)
    writes = [(torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)) for n in (3, 1, 2)]
    start = 0
    for k, v in writes:
        got_k, got_v = cache.update(start, k, v)
        start += k.shape[2]
        assert cache.length == start and got_k.shape[2] == start
    assert torch.equal(got_k, torch.cat([k for k, _ in writes], dim=2))
    assert torch.equal(got_v, torch.cat([v for _, v in writes], dim=2))
    k2, v2 = torch.randn(2, 3, 1, 4, generator=g), torch.randn(2, 3, 1, 4, generator=g)
    got_k, got_v = cache.update(2, k2, v2)  # a rewind: position 2 rewritten, the cache now holds 3
    assert cache.length == 3 and torch.equal(got_k, torch.cat([writes[0][0][:, :, :2], k2], dim=2))
    assert torch.equal(got_v[:, :, 2:], v2)
    cache.reset()
    assert cache.length == 0


_K = torch.zeros(2, 3, 2, 4)
_CACHE_SHAPE = "k and v must have shape (B, H_kv, T, D) with (B, H_kv, D) = (2, 3, 4), the cache's, got"
UPDATE_REFUSALS = [
    ("start", 4, ValueError, "start must be <= the cache length 3 (no gaps), got 4"),
    ("start", -1, ValueError, "start must be >= 0, got -1"),
    ("start", 2.0, TypeError, "start must be an int, got float"),
    ("k, v", (torch.zeros(2, 3, 6, 4),) * 2, ValueError, "the cache holds 8 positions; writing 3..8 would overflow it"),
    ("k, v", (torch.zeros(1, 3, 2, 4),) * 2, ValueError, f"{_CACHE_SHAPE} (1, 3, 2, 4)"),
    ("k, v", (torch.zeros(2, 3, 2, 5),) * 2, ValueError, f"{_CACHE_SHAPE} (2, 3, 2, 5)"),
    (
        "v",
        torch.zeros(2, 3, 1, 4),
        ValueError,
        "v must have shape (B, H_kv, T, D) with T = 2 as in k, got (2, 3, 1, 4)",
    ),
    ("k", _K[0], ValueError, "k must have shape (B, H_kv, T, D) (4 dims), got (3, 2, 4)"),
    (
        "k",
        _K.long(),
        TypeError,
        "k must have a floating dtype (float16, bfloat16, float32 or float64), got torch.int64",
    ),
]


@pytest.mark.parametrize("argument, bad, error, message", rows(UPDATE_REFUSALS))
def test_update_refusals(argument, bad, error, message):
    cache = KVCache(2, 3, 8, 4)
    cache.update(0, torch.zeros(2, 3, 3, 4), torch.zeros(2, 3, 3, 4))  # 3 positions held
    assert_refuses(cache.update, dict(start=3, k=_K, v=_K), argument, bad, error, message)
    assert cache.length == 3  # a refused write changes nothing
