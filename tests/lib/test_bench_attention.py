"""The attention benchmark command measures every backend and writes a complete record (sizes kept
tiny: this checks the command, not the machine's speed)."""

import json

import pytest
import torch

from lib.course.bench.attention import (
    PUBLISHED_PEAKS,
    attention_flops,
    flash_traffic,
    main,
    markdown,
    naive_traffic,
    published_card,
    roofline_ms,
    run,
)
from lib.course.bench.memory import peak_rss_mib, peak_rss_table
from lib.kernels import count_visited_tiles


def test_flop_count_is_four_b_h_s_squared_d_halved_when_causal():
    assert attention_flops(1, 12, 512, 64, causal=False, backward=False) == 4 * 12 * 512 * 512 * 64
    assert attention_flops(1, 12, 512, 64, causal=True, backward=False) == 2 * 12 * 512 * 512 * 64
    assert attention_flops(2, 1, 8, 16, causal=True, backward=True) == 3.5 * attention_flops(2, 1, 8, 16, True, False)


def test_cpu_run_times_every_backend_and_says_it_is_scaled_down(tmp_path):
    results = run((16, 33), layers=1, heads=2, head_dim=16, repeats=1, device="cpu")
    assert results["scaled_down"] and "scaled down" in results["note"]
    assert {(r["backend"], r["seq_len"]) for r in results["rows"]} == {
        (b, s) for b in ("naive", "sdpa", "chunked") for s in (16, 33)
    }
    for r in results["rows"]:
        assert "error" not in r and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_tflops"] > 0
    table = markdown(results)
    assert table.count("\n| ") == 1 + len(results["rows"])  # header + one line per row
    out = tmp_path / "r.json"
    main(["--seq", "16", "--layers", "1", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text())["generated_by"] == "python -m lib.course.bench.attention"


def test_naive_traffic_counts_every_pass_and_its_intensity_does_not_grow_with_s():
    B, H, S, D, e = 2, 3, 128, 16, 2
    passes = naive_traffic(B, H, S, D, e, causal=True)
    mat, vec = B * H * S * S, B * H * S * D
    # QKᵀ writes the matrix; mask and softmax read and write it; PV reads it: 6 matrix passes, 4 of Q/K/V/O
    assert sum(passes.values()) == e * (6 * mat + 4 * vec)
    assert sum(naive_traffic(B, H, S, D, e, causal=False).values()) == e * (4 * mat + 4 * vec)
    intensity = [
        attention_flops(1, 12, s, 64, True, False) / sum(naive_traffic(1, 12, s, 64, 2, True).values())
        for s in (2048, 8192, 32768)
    ]
    assert max(intensity) - min(intensity) < 0.05 * min(intensity)  # both grow as S², the ratio is fixed
    assert max(intensity) < min(p["flops"] / p["bandwidth"] for p in PUBLISHED_PEAKS.values())  # memory-bound


def test_flash_traffic_streams_exactly_the_key_blocks_the_kernel_visits():
    B, H, S, D, e, bm = 1, 2, 200, 16, 4, 32
    q = torch.randn(B, H, S, D)
    for causal in (True, False):
        tiles = count_visited_tiles(q, q, q, causal, block_m=bm, block_n=bm)  # counted by the kernel itself
        expected = B * H * (e * (2 * S * D + 2 * tiles * bm * D) + 4 * S)
        assert flash_traffic(B, H, S, D, e, causal, block_m=bm) == expected
    # fp16: each K/V element loaded feeds BLOCK_M multiply-adds, so the intensity tends to BLOCK_M
    for bm in (64, 128):
        big = 1 << 16
        ratio = attention_flops(1, 1, big, 64, True, False) / flash_traffic(1, 1, big, 64, 2, True, block_m=bm)
        assert 0.95 * bm < ratio <= bm


def test_roofline_is_the_slower_of_compute_and_memory():
    assert roofline_ms(2e12, 1e9, 1e15, 1e12) == pytest.approx(2.0)  # compute: 2e12 / 1e15 s
    assert roofline_ms(1e9, 3e12, 1e15, 1e12) == pytest.approx(3000.0)  # memory: 3e12 / 1e12 s


def test_peak_memory_of_naive_attention_grows_quadratically_and_chunked_stays_small():
    pytest.importorskip("resource", reason="no peak-memory measure without the POSIX resource module")
    # T = 1024 and 2048: tens and hundreds of MiB, so the few MiB a busy process's allocator may page
    # in beside them (seen once at T = 512: 16.2 MiB instead of 12.2) cannot hide the growth
    rows = {
        (r["backend"], r["seq_len"]): r["added_mib"]
        for r in peak_rss_table(["naive", "chunked"], [1024, 2048], heads=4, head_dim=64)
    }
    one_matrix_mib = 4 * 2048 * 2048 * 4 / 2**20  # 4 heads of 2048 x 2048 float32
    assert 3.0 < rows["naive", 2048] / rows["naive", 1024] < 5.0  # doubling T: about 4x
    assert rows["naive", 2048] >= one_matrix_mib  # at least the scores themselves
    assert rows["chunked", 2048] < 0.1 * rows["naive", 2048]
    with pytest.raises(ValueError, match="backend must be one of"):
        peak_rss_mib("flash", 64)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        peak_rss_mib("naive", 0)


def test_load_record_reads_committed_records_and_refuses_paths():
    from lib.course.bench import BENCHMARKS, load_record

    names = sorted(p.stem for p in BENCHMARKS.glob("*.json"))
    assert names, "benchmarks/ holds the committed records"
    for name in names:  # every committed record parses and says which machine and script made it
        record = load_record(name)
        assert isinstance(record, dict) and record.get("generated_by"), name
        assert record.get("device") or record.get("machine", {}).get("device"), name
    assert load_record("no_such_record") is None
    for bad in ("../README", "a/b", "", ".hidden", 3):
        with pytest.raises(ValueError, match="name must be"):
            load_record(bad)


def test_published_card_matches_model_numbers_not_brands():
    assert published_card("NVIDIA H200") == "H200 SXM"
    assert published_card("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert published_card("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert published_card("NVIDIA GeForce RTX 3090") is None  # same brand, another card
    assert published_card("AMD EPYC") is None
    with pytest.raises(TypeError, match="device_name must be a str"):
        published_card(None)


def test_committed_gpu_attention_record_is_consistent_with_its_own_flop_count():
    # A GPU record is produced elsewhere (tools/gpu_checks.sh); its TFLOP/s must be its FLOP count
    # over its time, by the convention this module states, and stay below the card's peak.
    from lib.course.bench import load_record

    record = load_record("attention_gpu")
    if record is None:
        pytest.skip("no GPU record committed")
    card = published_card(record["device"])
    peak = PUBLISHED_PEAKS[card]["flops"] if card else None
    layers = 12
    for row in record["rows"]:
        if "error" in row:
            continue
        flops = layers * attention_flops(1, 12, row["seq_len"], 64, causal=True, backward=False)
        assert row["fwd_tflops"] == pytest.approx(flops / (row["fwd_ms"] / 1e3) / 1e12, rel=0.01)
        if peak:
            assert row["fwd_tflops"] * 1e12 < peak and row["fwd_bwd_tflops"] * 1e12 < peak
