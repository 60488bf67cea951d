"""KV-cache memory arithmetic: the formula counts the bytes real cache tensors hold, the published
configs are consistent, and max_batch / max_context are the largest values that fit."""

import math
from dataclasses import asdict, replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from refusals import assert_refuses, built, not_float, refusal_test, rows

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
    assert dtype_bytes("int4") == 0.5  # its refusals: DTYPE_BYTES_REFUSALS


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
_BAD_SIZES = [  # (bad size, error, the message after the argument's name)
    (0, ValueError, "must be >= 1, got 0"),
    (-1, ValueError, "must be >= 1, got -1"),
    (1.5, TypeError, "must be an int, got float"),
    ("3", TypeError, "must be an int, got str"),
    (True, TypeError, "must be an int, got bool"),
    (None, TypeError, "must be an int, got NoneType"),
]
_NUMBER = (
    "must be a number of bytes per element (2 for fp16, 0.5 for int4; bytes_per_element('fp16') converts a dtype name)"
)
_BAD_BPE = [  # (bad bytes per element, error, the message after the argument's name)
    (0, ValueError, "must be a finite number > 0, got 0"),
    (-2, ValueError, "must be a finite number > 0, got -2"),
    (float("inf"), ValueError, "must be a finite number > 0, got inf"),
    (float("nan"), ValueError, "must be a finite number > 0, got nan"),
    ("fp16", TypeError, f"{_NUMBER}, got str"),
    (True, TypeError, f"{_NUMBER}, got bool"),
]


def bpe_rows(name):
    return [(name, bad, error, f"{name} {tail}") for bad, error, tail in _BAD_BPE]


KV_CACHE_BYTES_REFUSALS = [
    *[(name, bad, error, f"{name} {tail}") for name in GOOD_SIZES for bad, error, tail in _BAD_SIZES],
    *bpe_rows("bytes_per_elem"),
]
test_kv_cache_bytes_refusals = refusal_test(kv_cache_bytes, dict(GOOD_SIZES, bytes_per_elem=2), KV_CACHE_BYTES_REFUSALS)


WEIGHT_BYTES_REFUSALS = [
    ("n_params", 0, ValueError, "n_params must be >= 1, got 0"),
    ("n_params", 7e9, TypeError, "n_params must be an int, got float"),
    *bpe_rows("bytes_per_elem"),
]
test_weight_bytes_refusals = refusal_test(weight_bytes, dict(n_params=10, bytes_per_elem=2), WEIGHT_BYTES_REFUSALS)


_NOT_A_MODEL = "model must be a ModelShape (e.g. PUBLIC_CONFIGS['Llama-2-7B']), got str"
MAX_BATCH_REFUSALS = [
    ("model", "GPT-2", TypeError, _NOT_A_MODEL),
    ("memory_bytes", 80e9, TypeError, "memory_bytes must be an int, got float"),
    ("seq_len", 0, ValueError, "seq_len must be >= 1, got 0"),
    ("bytes_per_elem", 0, ValueError, "bytes_per_elem must be a finite number > 0, got 0"),
    *bpe_rows("weight_bytes_per_elem"),
]
test_max_batch_refusals = refusal_test(
    max_batch,
    dict(model=PUBLIC_CONFIGS["GPT-2"], seq_len=1, memory_bytes=GB, weight_bytes_per_elem=None),
    MAX_BATCH_REFUSALS,
)


MAX_CONTEXT_REFUSALS = [
    ("model", "GPT-2", TypeError, _NOT_A_MODEL),
    ("memory_bytes", -1, ValueError, "memory_bytes must be >= 0, got -1"),
    ("batch", 0, ValueError, "batch must be >= 1, got 0"),
    ("weight_bytes_per_elem", 0, ValueError, "weight_bytes_per_elem must be a finite number > 0, got 0"),
]
test_max_context_refusals = refusal_test(
    max_context,
    dict(model=PUBLIC_CONFIGS["GPT-2"], batch=1, memory_bytes=GB, weight_bytes_per_elem=None),
    MAX_CONTEXT_REFUSALS,
)


def test_max_batch_and_max_context_take_their_sizes_by_keyword_only():
    """Which number is which must be visible at the call (Python's own refusal, not a table row)."""
    m = PUBLIC_CONFIGS["GPT-2"]
    for fn in (max_batch, max_context):
        with pytest.raises(TypeError) as info:
            fn(m, 1, GB)
        assert str(info.value) == f"{fn.__name__}() takes 1 positional argument but 3 were given"


_NAMES = "['fp32', 'fp16', 'bf16', 'fp8', 'int4']"
BYTES_PER_ELEMENT_REFUSALS = [
    ("dtype_name", "fp64", ValueError, f"dtype_name must be one of {_NAMES}, got 'fp64'"),
    ("dtype_name", 2, TypeError, f"dtype_name must be a str, one of {_NAMES}, got int"),
]
test_bytes_per_element_refusals = refusal_test(bytes_per_element, dict(dtype_name="fp16"), BYTES_PER_ELEMENT_REFUSALS)


DTYPE_BYTES_REFUSALS = [
    ("dtype", 2, TypeError, "dtype must be a torch.dtype or a name like 'fp16', got int"),
    ("dtype", "fp12", ValueError, f"dtype must be a torch.dtype or one of {_NAMES}, got 'fp12'"),
]
test_dtype_bytes_refusals = refusal_test(dtype_bytes, dict(dtype=torch.float16), DTYPE_BYTES_REFUSALS)


_GPUS = "['24 GB (RTX 4090)', '80 GB (A100/H100)', '141 GB (H200)']"
GPU_MEMORY_BYTES_REFUSALS = [
    ("gpu", "8 GB", ValueError, f"gpu must be one of {_GPUS}, got '8 GB'"),
    ("gpu", 80, TypeError, f"gpu must be a str, one of {_GPUS}, got int"),
]
test_gpu_memory_bytes_refusals = refusal_test(
    gpu_memory_bytes, dict(gpu="80 GB (A100/H100)"), GPU_MEMORY_BYTES_REFUSALS
)


FORMAT_BYTES_REFUSALS = [
    ("n_bytes", -1, ValueError, "n_bytes must be >= 0, got -1"),
    ("binary", 1, TypeError, "binary must be a bool, got int"),
]
test_format_bytes_refusals = refusal_test(format_bytes, dict(n_bytes=512, binary=True), FORMAT_BYTES_REFUSALS)


ESTIMATE_PARAMS_REFUSALS = [
    ("n_layers", 0, ValueError, "n_layers must be >= 1, got 0"),
    ("n_heads", -1, ValueError, "n_heads must be >= 1, got -1"),
    ("n_kv_heads", None, TypeError, "n_kv_heads must be an int, got NoneType"),
    ("head_dim", 0, ValueError, "head_dim must be >= 1, got 0"),
    ("mlp_ratio", 4.0, TypeError, "mlp_ratio must be an int, got float"),
]
test_estimate_params_refusals = refusal_test(
    estimate_params, dict(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_ratio=4), ESTIMATE_PARAMS_REFUSALS
)


# fmt: off
MODEL_SHAPE_REFUSALS = [  # against Llama-2-7B's numbers: 32 heads of 128
    ("n_layers", 0, ValueError, "n_layers must be >= 1, got 0"),
    ("head_dim", 64.0, TypeError, "head_dim must be an int, got float"),
    ("n_kv_heads", 33, ValueError, "n_kv_heads must be <= n_heads = 32, got 33"),
    ("n_kv_heads", 5, ValueError,
     "n_kv_heads must divide n_heads = 32 (each KV head serves a whole group of query heads), got 5"),
    ("n_params", 0, ValueError, "n_params must be >= 1, got 0"),
    ("source", None, TypeError, "source must be a str, got NoneType"),
    ("name", 1, TypeError, "name must be a str, got int"),
]
# fmt: on
test_model_shape_refusals = refusal_test(
    ModelShape, built(lambda: asdict(PUBLIC_CONFIGS["Llama-2-7B"])), MODEL_SHAPE_REFUSALS
)


KV_CACHE_INIT_REFUSALS = [
    ("batch_size", 0, ValueError, "batch_size must be >= 1, got 0"),
    ("batch_size", True, TypeError, "batch_size must be an int, got bool"),
    ("n_kv_heads", 1.5, TypeError, "n_kv_heads must be an int, got float"),
    ("max_len", -1, ValueError, "max_len must be >= 1, got -1"),
    ("head_dim", "8", TypeError, "head_dim must be an int, got str"),
]
test_kv_cache_init_refusals = refusal_test(
    KVCache, dict(batch_size=2, n_kv_heads=3, max_len=8, head_dim=4), KV_CACHE_INIT_REFUSALS
)


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
_CACHE_SHAPE = "k must have shape (self.batch_size, self.n_kv_heads, T, self.head_dim)"
# fmt: off
UPDATE_REFUSALS = [
    ("start", 4, ValueError, "start must be <= the cache length 3 (no gaps), got 4"),
    ("start", -1, ValueError, "start must be >= 0, got -1"),
    ("start", 2.0, TypeError, "start must be an int, got float"),
    ("k, v", (torch.zeros(2, 3, 6, 4),) * 2, ValueError, "the cache holds 8 positions; writing 3..8 would overflow it"),
    ("k, v", (torch.zeros(1, 3, 2, 4),) * 2, ValueError, f"{_CACHE_SHAPE} with self.batch_size = 2, got (1, 3, 2, 4)"),
    ("k, v", (torch.zeros(2, 3, 2, 5),) * 2, ValueError, f"{_CACHE_SHAPE} with self.head_dim = 4, got (2, 3, 2, 5)"),
    ("k, v", (torch.zeros(2, 2, 2, 4),) * 2, ValueError, f"{_CACHE_SHAPE} with self.n_kv_heads = 3, got (2, 2, 2, 4)"),
    ("v", torch.zeros(2, 3, 1, 4), ValueError,
     "v must have shape (self.batch_size, self.n_kv_heads, T, self.head_dim) with T = 2 as in k, got (2, 3, 1, 4)"),
    ("k", _K[0], ValueError, f"{_CACHE_SHAPE} (4 dims), got (3, 2, 4)"),
    ("k", _K.long(), TypeError, not_float("k")),
]
# fmt: on


@pytest.mark.parametrize("argument, bad, error, message", rows(UPDATE_REFUSALS))
def test_update_refusals(argument, bad, error, message):
    cache = KVCache(2, 3, 8, 4)
    cache.update(0, torch.zeros(2, 3, 3, 4), torch.zeros(2, 3, 3, 4))  # 3 positions held
    assert_refuses(cache.update, dict(start=3, k=_K, v=_K), argument, bad, error, message)
    assert cache.length == 3  # a refused write changes nothing
