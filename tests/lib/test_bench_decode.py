"""python -m lib.course.bench.decode: its baseline is transformers' Llama with our weights (same logits), its
byte count is the weights plus the cache read, its timer sees every decode step, and a tiny run
writes a record with both ratios and the profile."""

import json

import tiny_models
import torch

import lib.course.bench.decode as bench
from lib.decode import generate


def tiny():
    return tiny_models.llama(vocab_size=80, tie_word_embeddings=False)


def test_the_baseline_holds_our_weights():
    model = tiny().store_by_columns()
    hf = bench.hf_llama(model)
    idx = torch.randint(80, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), atol=1e-5, rtol=0)  # fp32, two layers
    assert all(p.is_contiguous() for p in hf.parameters())  # its own row-major storage


def test_bytes_per_step_are_the_weights_and_the_cache_read():
    model = tiny()
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert bench.decode_bytes_per_token(model, 10) == weights + 10 * model.cache_bytes(1, 1)


def test_timed_generate_times_every_decode_step(monkeypatch):
    """On a clock that ticks once per reading: the call starts at 0, the 5 tokens are stamped at
    1-5, the call ends at 6; a decode step is a gap between stamps, (5 - 1) / 4 = 1. (Real times
    would make this a race: the prefill can take less than one decode step.)"""
    model = tiny()
    idx = torch.zeros(1, 3, dtype=torch.long)
    ticks = iter(range(100))
    monkeypatch.setattr(bench, "clock", lambda: next(ticks))
    seen = []
    total, step = bench.timed_generate(
        lambda on_token: seen.append(generate(model, idx, 5, temperature=0.0, on_token=on_token))
    )
    assert seen[0].shape == (1, 8)
    assert (total, step) == (6, 1)


def test_a_tiny_run_writes_the_record(tmp_path):
    out = tmp_path / "decode.json"
    bench.main(["--new-tokens", "3", "--prompt", "8", "--repeats", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["generated_by"] == "python -m lib.course.bench.decode" and r["same_tokens_as_transformers"] is True
    assert r["bytes_read_per_decode_step"] == r["model"]["weight_bytes"] + int(9.5 * 46_080)
    assert set(r["goals"]) == {"at_least_1x_transformers", "at_least_70_percent_of_read_bandwidth"}
    # the fraction is computed before the GB/s figures are rounded to 0.1
    assert abs(r["fraction_of_read_bandwidth"] - r["decode_GBps"] / r["read_bandwidth_GBps"]["best"]) < 0.01
    assert r["profile_of_one_decode_step"]["matrix_vector_products_alone_ms"] > 0
